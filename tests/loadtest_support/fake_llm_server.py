"""A fake streaming LLM server with injected, known behaviour, for loadtest's tests and benchmark.

Runs as its own process (so its timers do not share the load generator's event loop), listens on
127.0.0.1 on an ephemeral port and prints `PORT <n>` when ready. Endpoints: OpenAI
/v1/completions and /v1/chat/completions, KServe v2 /v2/models/{m}/generate_stream. Behaviour is set
with POST /__control (a JSON object of the fields of `Behaviour`; counters reset) and read back with
GET /__stats.

Token k (k = 0..n-1) of a request is written at arrival + ttft + k * itl on an absolute timeline, so
timer jitter does not accumulate into the gaps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict, dataclass, fields

from aiohttp import web


@dataclass
class Behaviour:
    ttft: float = 0.0  # s from arrival to the first token
    itl: float = 0.0  # s between tokens
    tokens_per_chunk: int = 1  # tokens per SSE event
    usage: bool = True  # send a usage chunk when stream_options.include_usage asks for it
    done: bool = True  # end OpenAI streams with data: [DONE]
    error_every: int = 0  # arrivals n with n % error_every == 0 get HTTP 500 (n counts from 1)
    abort_every: int = 0  # arrivals n % abort_every == 0 (and not an error) drop the connection mid-stream
    slow_every: int = 0  # arrivals n % slow_every == 0 use slow_ttft
    slow_ttft: float = 0.0
    non_streaming: bool = False  # reply with one JSON body, as a server without streaming
    max_concurrent: int = 0  # > 0: at most this many requests served at once, the rest queue
    service_time: float = 0.0  # s a request holds its slot (with max_concurrent); tokens sent at the end
    role_chunk: bool = True  # chat: an opening chunk with only the role, as OpenAI and vLLM send
    hold_text: bool = False  # chat: deltas without content, as when every token is a partial character


class State:
    def __init__(self) -> None:
        self.set(Behaviour())

    def set(self, b: Behaviour) -> None:
        self.b = b
        self.arrivals = 0
        self.active = 0
        self.max_active = 0
        self.last_body: dict | None = None
        self.sem = asyncio.Semaphore(b.max_concurrent) if b.max_concurrent > 0 else None


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(kind: str, model: str, text: str) -> dict:
    if kind == "chat":
        return {
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{"index": 0, "delta": {"content": text}}],
        }
    if kind == "kserve":
        return {"model_name": model, "text_output": text}
    return {"object": "text_completion", "model": model, "choices": [{"index": 0, "text": text}]}


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    st: State = request.app["state"]
    b = st.b
    loop = asyncio.get_running_loop()
    t_arrival = loop.time()
    st.arrivals += 1
    n = st.arrivals
    body = await request.json()
    st.last_body = body
    model = request.match_info.get("model") or body.get("model", "")
    max_tokens = int(body.get("max_tokens") or 16)
    if b.error_every and n % b.error_every == 0:
        return web.json_response({"error": {"message": "injected failure"}}, status=500)
    if b.non_streaming:
        await asyncio.sleep(b.ttft)
        return web.json_response({"choices": [{"index": 0, "text": " tok" * max_tokens}]})
    st.active += 1
    st.max_active = max(st.max_active, st.active)
    try:
        if st.sem is not None:
            async with st.sem:
                await asyncio.sleep(b.service_time)
                t_first = loop.time()
        else:
            t_first = t_arrival + (b.slow_ttft if b.slow_every and n % b.slow_every == 0 else b.ttft)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if kind == "chat" and b.role_chunk:
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        chunks = [b.tokens_per_chunk] * (max_tokens // b.tokens_per_chunk)
        if max_tokens % b.tokens_per_chunk:
            chunks.append(max_tokens % b.tokens_per_chunk)
        sent = 0
        for i, size in enumerate(chunks):
            due = t_first + sent * b.itl  # absolute timeline: jitter does not accumulate
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            event = _chunk(kind, model, " tok" * size)
            if kind == "chat" and b.hold_text:
                event["choices"][0]["delta"] = {}
            await resp.write(_sse(event))
            sent += size
            if b.abort_every and n % b.abort_every == 0 and i == 0:
                request.transport.close()  # drop the connection mid-stream
                return resp
        opts = body.get("stream_options") or {}
        if kind != "kserve" and b.usage and opts.get("include_usage"):
            usage = {"prompt_tokens": 1, "completion_tokens": max_tokens, "total_tokens": max_tokens + 1}
            await resp.write(_sse({"choices": [], "usage": usage}))
        if kind != "kserve" and b.done:
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    except ConnectionResetError:  # the client went away (a load test stopped early): nothing to send
        return web.Response(status=499)
    finally:
        st.active -= 1


async def _control(request: web.Request) -> web.Response:
    data = await request.json()
    known = {f.name for f in fields(Behaviour)}
    unknown = set(data) - known
    if unknown:
        return web.json_response({"error": f"unknown fields {sorted(unknown)}"}, status=400)
    request.app["state"].set(Behaviour(**data))
    return web.json_response(asdict(request.app["state"].b))


async def _stats(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    return web.json_response(
        {"arrivals": st.arrivals, "max_active": st.max_active, "last_body": st.last_body}
    )


def make_app() -> web.Application:
    app = web.Application()
    app["state"] = State()
    app.router.add_post("/v1/completions", lambda r: _generate(r, "completions"))
    app.router.add_post("/v1/chat/completions", lambda r: _generate(r, "chat"))
    app.router.add_post("/v2/models/{model}/generate_stream", lambda r: _generate(r, "kserve"))
    app.router.add_post("/__control", _control)
    app.router.add_get("/__stats", _stats)
    return app


async def _serve(behaviour: Behaviour) -> None:
    app = make_app()
    app["state"].set(behaviour)
    # handler_cancellation: a client that goes away cancels its handler (and frees its slot), as a
    # real server aborts a disconnected request.
    runner = web.AppRunner(app, access_log=None, handle_signals=True, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    port = runner.addresses[0][1]
    print(f"PORT {port}", flush=True)
    # Stop when the parent closes our stdin (or dies), so no server outlives its test.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await runner.cleanup()


def main() -> None:
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # dropped clients are expected
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--behaviour", default="{}", help="JSON object of Behaviour fields")
    parser.add_argument("--uvloop", action="store_true", help="use uvloop if it is installed")
    args = parser.parse_args()
    behaviour = Behaviour(**json.loads(args.behaviour))
    factory = None
    if args.uvloop:
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(behaviour))


if __name__ == "__main__":
    main()
