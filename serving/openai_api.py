"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streaming responses are server-sent events, one event per chunk from the model server (a chunk
may carry several tokens under load; see docs/serving.md), ending with `data: [DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.core.plan import TokenLogprob
from serving.chat import render_chat
from serving.disconnect import unless_disconnected
from serving.errors import APIError
from serving.gateway import (
    ServedModel,
    gateway_of,
    new_request_id,
    now_s,
    read_json,
    renamed,
    sampling_params,
)
from serving.protocol import ChatCompletionRequest, CompletionRequest, parse
from serving.wire import GenerateChunk, GenerateRequest

router = APIRouter()
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
COMPLETION_MAX_TOKENS = 16
"""/v1/completions' max_tokens when the request and generation_config.json leave it out (OpenAI's)."""


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    data = [{"id": name, "object": "model", "created": gw.created(name), "owned_by": "shardserve",
             **({"weight_dtype": gw.weight_dtype(name)} if gw.weight_dtype(name) else {})} for name in gw.names]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> JSONResponse:
    m = await gateway_of(request).model(name)
    return JSONResponse({"id": m.name, "object": "model", "created": m.info.created, "owned_by": "shardserve",
                         "max_model_len": m.info.max_model_len, "weight_dtype": m.info.weight_dtype})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _note(request: Request, model: ServedModel, stream: bool) -> None:
    request.state.model = model.name
    request.state.stream = stream


async def _chunks(first: GenerateChunk, rest: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
    yield first
    async for c in rest:
        yield c


# /v1/completions
@router.post("/v1/completions")
async def completions(request: Request):
    gw = gateway_of(request)
    body = parse(CompletionRequest, await read_json(request, gw))
    model = await gw.model(body.model)
    _note(request, model, bool(body.stream))
    prompts = body.prompts()
    texts: list[str | None] = []
    ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        texts.append(p if isinstance(p, str) else None)
        ids.append(model.encode(p, param) if isinstance(p, str) else list(p))
    echo_lp = body.echo and body.logprobs is not None
    # max_tokens left out or null: the model's generation_config.json max_new_tokens, else the API's 16
    # (within server.limits.max_tokens; Gateway.open resolves it)
    default = model.info.sampling_defaults.get("max_tokens", COMPLETION_MAX_TOKENS)
    sent = body.max_tokens if "max_tokens" in body.model_fields_set else None
    params = sampling_params(model.info.sampling_defaults, max_tokens=sent, logprobs=body.logprobs,
                             prompt_logprobs=body.logprobs if echo_lp else None, **body.sampling_kwargs(),
                             structured=body.response_format.structured() if body.response_format else None)
    req = GenerateRequest(_engine_id(request), ids, params, task=body.task, stream=bool(body.stream))
    return await _respond(request, _CompletionView(model, body, ids, texts, request.state.request_id), model, req,
                          default)


def usage_dict(prompt: int, completion: int, virtual: int) -> dict:
    """OpenAI usage; a p-tuned task's virtual tokens are counted apart (`virtual_tokens`), not in
    prompt_tokens or total_tokens, though they take context positions and KV blocks like prompt tokens."""
    u = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if virtual:
        u["virtual_tokens"] = virtual
    return u


def _engine_id(request: Request) -> str:
    # the client may reuse X-Request-Id; engine ids must be unique, so they are always fresh
    return new_request_id()


def _record(request: Request, usage: tuple[int, int] | None) -> None:
    if usage is not None:
        request.state.prompt_tokens, request.state.completion_tokens = usage


class _CompletionView:
    """Accumulates a completion request's chunks into OpenAI response objects."""

    def __init__(self, model: ServedModel, body: CompletionRequest, ids: list[list[int]], texts: list[str | None],
                 rid: str):
        self.model, self.body, self.ids, self.texts = model, body, ids, texts
        self.n = body.n or 1
        self.id = f"cmpl-{rid}"
        self.created = now_s()
        count = len(ids) * self.n
        self.text = [""] * count
        self.lp: list[dict | None] = [self._empty_lp() for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.prompt_lp: dict[int, list[TokenLogprob | None]] = {}
        self.started: set[int] = set()
        self.offset = [0] * count
        """Per choice: where its next token's text_offset starts (echo text + earlier tokens' text)."""
        self.usage: tuple[int, int] | None = None
        self.virtual = 0
        self.names: dict[str, str] = {}
        """Engine field -> this request's field (gateway.renamed): the same names here."""

    def _empty_lp(self) -> dict | None:
        if self.body.logprobs is None:
            return None
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _echo(self, idx: int) -> tuple[str, dict | None]:
        """The prompt part of choice idx when echo is on (text, logprobs of the prompt tokens)."""
        j = idx // self.n
        text = self.texts[j] if self.texts[j] is not None else self.model.decode(self.ids[j])
        lp = None
        if self.body.logprobs is not None:
            entries = self.prompt_lp.get(j) or [None] * len(self.ids[j])
            lp = self._lp(self.ids[j], entries, 0)
        return text, lp

    def _lp(self, token_ids: list[int], entries: list[TokenLogprob | None], offset: int) -> dict:
        k = self.body.logprobs or 0
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, e in zip(token_ids, entries):
            tok = self.model.token_text(tid)
            out["tokens"].append(tok)
            out["token_logprobs"].append(None if e is None else e.logprob)
            out["top_logprobs"].append(None if e is None else {self.model.token_text(t): lp for t, lp in e.top[:k]})
            out["text_offset"].append(offset)
            offset += len(tok)
        return out

    def delta_choices(self, chunk: GenerateChunk) -> list[dict]:
        """Choices of one streamed event (the deltas of the chunk)."""
        if chunk.prompt_logprobs:
            self.prompt_lp.update(chunk.prompt_logprobs)
        choices = []
        for d in chunk.deltas:
            text, lp, echo = d.text, None, None
            if self.body.echo and d.index not in self.started:
                echo = self._echo(d.index)
                self.offset[d.index] += len(echo[0])
            if self.body.logprobs is not None:
                # offsets count token texts, not the text sent so far: that lags behind while a
                # possible stop string or part of a UTF-8 character is held back
                lp = self._lp(d.token_ids, d.logprobs, self.offset[d.index])
                self.offset[d.index] += sum(len(t) for t in lp["tokens"])
            if echo is not None:
                etext, elp = echo
                text = etext + text
                if lp is not None and elp is not None:
                    lp = {k: elp[k] + lp[k] for k in lp}
            self.started.add(d.index)
            self.text[d.index] += text
            choices.append({"index": d.index, "text": text, "logprobs": lp,
                            "finish_reason": _finish(d.finish_reason)})
        return choices

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.error is not None:
            raise APIError(chunk.error)
        for c in self.delta_choices(chunk):
            i = c["index"]
            if c["logprobs"] is not None:
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    self.lp[i][k].extend(c["logprobs"][k])
            if c["finish_reason"] is not None:
                self.finish[i] = c["finish_reason"]
        if chunk.usage is not None:
            self.usage = chunk.usage
            self.virtual = chunk.virtual_tokens

    def usage_block(self) -> dict | None:
        if self.usage is None:
            return None
        p, c = self.usage
        return usage_dict(p, c, self.virtual)

    def response(self) -> dict:
        for i in range(len(self.text)):
            if self.body.echo and i not in self.started:
                text, lp = self._echo(i)
                self.text[i] = text + self.text[i]
                if lp is not None:
                    self.lp[i] = lp
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model.name,
                "choices": [{"index": i, "text": self.text[i], "logprobs": self.lp[i], "finish_reason": self.finish[i]}
                            for i in range(len(self.text))],
                "usage": self.usage_block(), "system_fingerprint": None}

    def event(self, choices: list[dict]) -> dict:
        ev = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model.name,
              "choices": choices}
        if self.body.include_usage:
            ev["usage"] = None
        return ev


def _finish(reason: str | None) -> str | None:
    return None if reason == "abort" else reason


async def _respond(request: Request, view: _CompletionView | _ChatView, model: ServedModel, req: GenerateRequest,
                   default_max_tokens: int | None):
    """A generation's HTTP answer, completions and chat alike: server-sent events as the view renders
    each chunk, or the whole response once the last chunk is in.

    Until the first byte is sent nothing notices a client that leaves, so the wait for the first
    chunk (the whole generation when not streaming) is cancelled on its disconnect: the cancel
    reaches the model server's stream, which aborts the engine requests (serving/disconnect.py)."""
    gw = gateway_of(request)
    if req.stream:
        first, rest = await unless_disconnected(request, _named(gw.open(model, req, default_max_tokens), view.names))
        return StreamingResponse(_stream(request, view, first, rest), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    await unless_disconnected(request, _named(_gather(gw.open(model, req, default_max_tokens), view), view.names))
    _record(request, view.usage)
    return JSONResponse(view.response())


async def _named(aw: Awaitable[T], names: dict[str, str]) -> T:
    """`aw`'s result; its APIError in the route's field names (view.names, gateway.renamed)."""
    try:
        return await aw
    except APIError as exc:
        raise APIError(renamed(exc.info, names)) from None


async def _gather(opening: Awaitable[tuple[GenerateChunk, AsyncIterator[GenerateChunk]]],
                  view: _CompletionView | _ChatView) -> None:
    """Every chunk of a non-streaming request (`opening`: Gateway.open's) into `view`."""
    first, rest = await opening
    try:
        async for chunk in _chunks(first, rest):
            view.add(chunk)
    finally:
        await rest.aclose()


async def _stream(request: Request, view: _CompletionView | _ChatView, first: GenerateChunk,
                  rest: AsyncIterator[GenerateChunk]) -> AsyncIterator[str]:
    """The SSE events of either endpoint: one per chunk with choices (the view turns a chunk's
    deltas into its endpoint's choices, tool calls included), the usage event, then [DONE]."""
    try:
        async for chunk in _chunks(first, rest):
            if chunk.error is not None:
                yield _sse(renamed(chunk.error, view.names).body())
                request.state.stream_error = chunk.error.code
                break
            choices = view.delta_choices(chunk)
            if choices:
                yield _sse(view.event(choices))
            if chunk.usage is not None:
                view.usage = chunk.usage
                view.virtual = chunk.virtual_tokens
        if view.body.include_usage and view.usage is not None:
            ev = view.event([])
            ev["usage"] = view.usage_block()
            yield _sse(ev)
        _record(request, view.usage)
        yield "data: [DONE]\n\n"
    finally:
        await rest.aclose()


# /v1/chat/completions
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    gw = gateway_of(request)
    body = parse(ChatCompletionRequest, await read_json(request, gw))
    model = await gw.model(body.model)
    _note(request, model, bool(body.stream))
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {}),
                 **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
                 **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in body.messages]
    info = model.info
    structured = body.structured()
    tools = {"tools": [t.model_dump(exclude_none=True) for t in body.tools]} if body.tool_mode else {}
    add_generation_prompt, variables = body.template_variables()
    text = render_chat(messages, info.chat_template, add_generation_prompt, info.bos_token, info.eos_token,
                       {**variables, **tools})
    ids = model.encode(text, "messages", add_special_tokens=False)
    # no max_tokens / max_completion_tokens: generation_config.json's max_new_tokens, else the context, within
    # server.limits.max_tokens (Gateway.open resolves it)
    params = sampling_params(model.info.sampling_defaults, max_tokens=body.output_limit,
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None, **body.sampling_kwargs(),
                             structured=structured)
    req = GenerateRequest(_engine_id(request), [ids], params, task=body.task, stream=bool(body.stream))
    return await _respond(request, _ChatView(model, body, request.state.request_id), model, req,
                          info.sampling_defaults.get("max_tokens"))


class _ChatView:
    """Accumulates a chat request's chunks into OpenAI response objects. With tool_choice "required"
    or a named function the output is tool calls: a named function's text is its arguments (streamed
    as they come); "required" makes a JSON array of {name, parameters}, sent as calls once complete
    (a truncated array, finish_reason "length", is sent as content)."""

    def __init__(self, model: ServedModel, body: ChatCompletionRequest, rid: str):
        self.model, self.body = model, body
        self.n = body.n or 1
        self.id = f"chatcmpl-{rid}"
        self.created = now_s()
        self.text = [""] * self.n
        self.lp: list[list[dict]] = [[] for _ in range(self.n)]
        self.finish: list[str | None] = [None] * self.n
        self.started: set[int] = set()
        self.usage: tuple[int, int] | None = None
        self.virtual = 0
        self.tool_mode = body.tool_mode
        self.names = {"prompt": "messages", "logprobs": "top_logprobs",
                      "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"}
        """Engine field -> this request's field (gateway.renamed): a chat's prompt is its messages."""
        self.call_ids = [f"call_{new_request_id()[:24]}" for _ in range(self.n)]

    def _lp(self, token_ids: list[int], entries: list[TokenLogprob]) -> list[dict]:
        k = self.body.top_logprobs or 0
        out = []
        for tid, e in zip(token_ids, entries):
            m = self.model
            tops = [{"token": m.token_text(a), "logprob": lp, "bytes": list(m.token_bytes(a))} for a, lp in e.top[:k]]
            out.append({"token": m.token_text(tid), "logprob": e.logprob, "bytes": list(m.token_bytes(tid)),
                        "top_logprobs": tops})
        return out

    def _calls(self, i: int) -> list[dict] | None:
        """Choice i's tool calls (OpenAI shape), or None when its text is not a complete call array."""
        if self.tool_mode != "required":
            return [{"id": self.call_ids[i], "type": "function",
                     "function": {"name": self.tool_mode, "arguments": self.text[i]}}]
        try:
            calls = json.loads(self.text[i])
        except ValueError:
            return None
        return [{"id": f"{self.call_ids[i]}_{k}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
                for k, c in enumerate(calls)]

    def _finish(self, reason: str | None, calls: bool) -> str | None:
        return "tool_calls" if calls and reason == "stop" else _finish(reason)

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.error is not None:
            raise APIError(chunk.error)
        for d in chunk.deltas:
            self.text[d.index] += d.text
            if self.body.logprobs:
                self.lp[d.index].extend(self._lp(d.token_ids, d.logprobs))
            if d.finish_reason is not None:
                self.finish[d.index] = d.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
            self.virtual = chunk.virtual_tokens

    def usage_block(self) -> dict:
        p, c = self.usage or (0, 0)
        return usage_dict(p, c, self.virtual)

    def response(self) -> dict:
        choices = []
        for i in range(self.n):
            calls = self._calls(i) if self.tool_mode else None
            message = ({"role": "assistant", "content": None, "tool_calls": calls} if calls is not None
                       else {"role": "assistant", "content": self.text[i]})
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": self.lp[i]} if self.body.logprobs else None,
                            "finish_reason": self._finish(self.finish[i], calls is not None)})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model.name,
                "choices": choices, "usage": self.usage_block(), "system_fingerprint": None}

    def event(self, choices: list[dict]) -> dict:
        ev = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model.name,
              "choices": choices}
        if self.body.include_usage:
            ev["usage"] = None
        return ev

    def _tool_delta(self, i: int, text: str, first: bool, done: bool) -> tuple[dict, bool]:
        """(delta fields, whether they are calls) of one streamed piece of choice i's tool output."""
        if self.tool_mode != "required":  # a named function: its arguments stream as they come
            fn = {"name": self.tool_mode, "arguments": text} if first else {"arguments": text}
            call = {"index": 0, "id": self.call_ids[i], "type": "function", "function": fn} if first else (
                {"index": 0, "function": fn})
            return ({"tool_calls": [call]} if first or text else {}), True
        if not done:
            return {}, True
        calls = self._calls(i)
        if calls is None:
            return {"content": self.text[i]}, False
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, True

    def delta_choices(self, chunk: GenerateChunk) -> list[dict]:
        choices = []
        for d in chunk.deltas:
            delta: dict[str, Any] = {}
            first = d.index not in self.started
            if first:
                self.started.add(d.index)
                delta["role"] = "assistant"
            calls = False
            if self.tool_mode:
                self.text[d.index] += d.text
                more, calls = self._tool_delta(d.index, d.text, first, d.finish_reason is not None)
                delta.update(more)
            elif d.text or "role" in delta:
                delta["content"] = d.text
            lp = {"content": self._lp(d.token_ids, d.logprobs)} if self.body.logprobs else None
            choices.append({"index": d.index, "delta": delta, "logprobs": lp,
                            "finish_reason": self._finish(d.finish_reason, calls)})
        return choices
