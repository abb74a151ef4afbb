"""Streaming HTTP clients: OpenAI completions and chat (SSE), KServe v2 `generate_stream` (SSE).

Each request's bytes are timestamped as they are read (one `perf_counter` per network read); every
SSE `data:` event in that read that carries output is an output chunk at that time. From those
timestamps come TTFT, every inter-chunk gap (ITL) and the end-to-end latency (last chunk, as vLLM).
Output tokens come from the stream's `usage` when the server sends it, else from the tokenizer on
the generated text, else one per chunk (recorded per request as `output_tokens_source`).
"""

from __future__ import annotations

import json
from time import perf_counter
from urllib.parse import urlsplit

import aiohttp

from loadtest.config import LoadTestConfig
from loadtest.errors import LoadTestError
from loadtest.metrics import RequestRecord
from loadtest.prompts import PromptBuilder
from loadtest.workload import RequestSpec

NOT_STREAMING = (
    "the server replied with a JSON body (Content-Type: application/json), not a text/event-stream: "
    "it did not stream the response. The load test needs `stream: true` responses to time tokens"
)


def endpoint_url(config: LoadTestConfig) -> str:
    """The URL to POST to. A bare base URL (or one ending in /v1, or /v2 for KServe) gets the
    backend's standard path; any other path is taken as the full endpoint."""
    url = config.url.rstrip("/")
    path = urlsplit(url).path
    if config.backend == "kserve-generate-stream":
        if path in ("", "/v2"):
            return url.removesuffix("/v2") + f"/v2/models/{config.model}/generate_stream"
        return url
    tail = "/chat/completions" if config.backend == "openai-chat" else "/completions"
    if path == "":
        return url + "/v1" + tail
    return url + tail if path.endswith("/v1") else url


class StreamingClient:
    """Sends one request and fills its RequestRecord. Subclasses build the payload and read events."""

    requires_done = False  # the stream must end with `data: [DONE]`

    def __init__(
        self, config: LoadTestConfig, session: aiohttp.ClientSession, counter: PromptBuilder
    ) -> None:
        self.config = config
        self.session = session
        self.counter = counter
        self.url = endpoint_url(config)
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if config.api_key:
            self.headers["Authorization"] = f"Bearer {config.api_key}"

    def payload(self, spec: RequestSpec) -> dict:
        raise NotImplementedError

    def parse(self, event: dict) -> tuple[str | None, int | None, str | None]:
        """(output text or None if the event carries no output, usage output tokens, error)."""
        raise NotImplementedError

    async def send(self, spec: RequestSpec, rec: RequestRecord, t0: float) -> None:
        """Send `spec` and record timings relative to `t0` (a perf_counter value) into `rec`.
        Never raises for a failed request: the failure goes into rec.error_kind."""
        body = json.dumps(self.payload(spec)).encode()
        rec.input_tokens, rec.requested_output_tokens = spec.input_tokens, spec.output_tokens
        st = perf_counter()
        rec.sent_s = st - t0
        try:
            async with self.session.post(self.url, data=body, headers=self.headers) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:300].strip()
                    rec.fail(f"http_{resp.status}", f"HTTP {resp.status} {resp.reason}: {detail}")
                elif resp.content_type == "application/json":
                    rec.fail("not_streaming", NOT_STREAMING)
                else:
                    await self._read_stream(resp, rec, st)
        except TimeoutError:  # aiohttp's timeouts subclass it
            rec.fail("timeout", f"no complete reply within --timeout {self.config.timeout:g} s")
        except aiohttp.ClientConnectorError as exc:
            rec.fail("connection_error", str(exc))
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            rec.fail("disconnected", f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientError as exc:
            rec.fail("client_error", f"{type(exc).__name__}: {exc}")
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
            # An event of an unexpected shape (e.g. `choices` not a list of objects).
            rec.fail("bad_event", f"{type(exc).__name__}: {exc}")
        finally:
            rec.done_s = perf_counter() - t0

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, st: float) -> None:
        buf = b""
        last = st
        itl = rec.itl_s
        pieces: list[str] = []
        usage = None
        saw_done = False
        events = 0
        async for data in resp.content.iter_any():
            now = perf_counter()  # arrival time of every event in this read
            buf += data
            if b"\n" not in data:
                continue
            lines = buf.split(b"\n")
            buf = lines.pop()  # an incomplete line waits for the next read
            for line in lines:
                if not line.startswith(b"data:"):
                    continue  # blank separators, `event:`, `id:`, `: keep-alive` comments
                raw = line[5:].strip()
                if raw == b"[DONE]":
                    saw_done = True
                    continue
                try:
                    event = json.loads(raw)
                except ValueError:
                    rec.fail("bad_event", f"SSE data is not JSON: {raw[:100]!r}")
                    return
                events += 1
                text, n_usage, err = self.parse(event)
                if err is not None:
                    rec.fail("stream_error", err)
                    return
                if n_usage is not None:
                    usage = n_usage
                if text is not None:
                    if not pieces:
                        rec.ttft_s = now - st
                    else:
                        itl.append(now - last)
                    last = now
                    pieces.append(text)
        if not pieces and not events:
            rec.fail("empty_response", "the reply had no SSE `data:` events")
            return
        if not pieces:  # e.g. every token decoded to a held-back partial UTF-8 character
            rec.fail("no_output", f"none of the stream's {events} events carried output text")
            return
        if self.requires_done and not saw_done:
            rec.fail("incomplete_stream", "the stream ended before `data: [DONE]`")
            return
        rec.e2el_s = last - st
        if usage is not None:
            rec.output_tokens, rec.output_tokens_source = usage, "usage"
        elif self.counter.exact:
            rec.output_tokens, rec.output_tokens_source = self.counter.count("".join(pieces)), "tokenizer"
        else:
            rec.output_tokens, rec.output_tokens_source = len(pieces), "chunks"

    async def probe(self) -> None:
        """One short request before the run: raise LoadTestError with a clear message if the
        server is unreachable, the endpoint is wrong, or the server does not stream."""
        rec = RequestRecord(index=-1, warmup=True, scheduled_s=0.0)
        await self.send(RequestSpec("Hello, world.", 4, 4), rec, perf_counter())
        if rec.ok or rec.error_kind == "no_output":  # the server streams; a few tokens may show no text
            return
        kind, url = rec.error_kind, self.url
        if kind == "connection_error":
            msg = f"cannot connect to {url} ({rec.error}). Is the server running, and are --url and the port right?"
        elif kind == "http_404":
            msg = f"{url} returned 404 Not Found: check --url, --model and --backend ({self.config.backend})"
        elif kind in ("http_401", "http_403"):
            msg = f"{url} refused the request ({kind[5:]}): pass a valid --api-key"
        elif kind == "not_streaming":
            msg = f"{url}: {NOT_STREAMING}"
        elif kind == "empty_response":
            msg = f"{url} sent no SSE `data:` events with output: does it support stream=true for {self.config.backend}?"
        else:
            msg = f"the preflight request to {url} failed ({kind}): {rec.error}"
        raise LoadTestError(msg)


class OpenAICompletions(StreamingClient):
    """POST /v1/completions with stream=true; the stream ends with `data: [DONE]`."""

    requires_done = True

    def _common(self, spec: RequestSpec) -> dict:
        c = self.config
        body = {"model": c.model, "max_tokens": spec.output_tokens, "temperature": 0.0, "stream": True}
        if c.include_usage:
            body["stream_options"] = {"include_usage": True}
        if c.ignore_eos:  # vLLM / SGLang extensions that hold the output at exactly max_tokens
            body["ignore_eos"] = True
            body["min_tokens"] = spec.output_tokens
        return body

    def payload(self, spec: RequestSpec) -> dict:
        return {**self._common(spec), "prompt": spec.prompt}

    def parse(self, event: dict) -> tuple[str | None, int | None, str | None]:
        if "error" in event:
            return None, None, json.dumps(event["error"])[:300]
        usage = event.get("usage")
        n = usage.get("completion_tokens") if isinstance(usage, dict) else None
        choices = event.get("choices")
        if not choices:  # the usage-only chunk at the end has choices == []
            return None, n, None
        choice = choices[0]
        text = choice.get("text")
        # As vLLM, an empty text still counts as a token (a special token decodes to ""), unless
        # the chunk only closes the stream (finish_reason set and no text).
        if not text and choice.get("finish_reason") is not None:
            return None, n, None
        return text or "", n, None


class OpenAIChat(OpenAICompletions):
    """POST /v1/chat/completions with stream=true; output is in choices[0].delta.content."""

    def payload(self, spec: RequestSpec) -> dict:
        messages = list(spec.messages) if spec.messages else [{"role": "user", "content": spec.prompt}]
        return {**self._common(spec), "messages": messages}

    def parse(self, event: dict) -> tuple[str | None, int | None, str | None]:
        if "error" in event:
            return None, None, json.dumps(event["error"])[:300]
        usage = event.get("usage")
        n = usage.get("completion_tokens") if isinstance(usage, dict) else None
        choices = event.get("choices")
        if not choices:
            return None, n, None
        delta = choices[0].get("delta") or {}
        text = delta.get("content")
        if text is None:
            text = delta.get("reasoning_content")
        # The opening chunk carries only the role (content "" or absent): no token was generated yet.
        if text is None or (text == "" and "role" in delta):
            return None, n, None
        return text, n, None


class KServeGenerateStream(StreamingClient):
    """POST /v2/models/{model}/generate_stream (Triton's generate extension): SSE events with
    `text_output`; the stream ends when the connection closes."""

    def payload(self, spec: RequestSpec) -> dict:
        body = {
            "text_input": spec.prompt,
            "max_tokens": spec.output_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        if self.config.ignore_eos:  # the same extensions as on the OpenAI routes (shardserve, vLLM)
            body["ignore_eos"] = True
            body["min_tokens"] = spec.output_tokens
        return body

    def parse(self, event: dict) -> tuple[str | None, int | None, str | None]:
        if "error" in event:
            return None, None, str(event["error"])[:300]
        text = event.get("text_output")
        return (text if isinstance(text, str) and text else None), None, None


CLIENTS: dict[str, type[StreamingClient]] = {
    "openai-completions": OpenAICompletions,
    "openai-chat": OpenAIChat,
    "kserve-generate-stream": KServeGenerateStream,
}


def make_client(
    config: LoadTestConfig, session: aiohttp.ClientSession, counter: PromptBuilder
) -> StreamingClient:
    return CLIENTS[config.backend](config, session, counter)


__all__ = ["CLIENTS", "NOT_STREAMING", "StreamingClient", "endpoint_url", "make_client"]
