"""Per-request limits (server.limits in deploy/schema.py), applied at the gateway before a request
reaches a model, for every API (OpenAI and KServe v2 alike): a 400 naming the field and the limit.

A max_tokens the client did not set (None) is not refused but resolved to the default within the
limit: None means "up to the context" to the engine, which would pass any cap (a null max_tokens
generated to the end of the context past server.limits.max_tokens)."""

from __future__ import annotations

import dataclasses

from deploy.schema import RequestLimits
from engines.core.sampling_params import RequestError, SamplingParams
from serving import errors
from serving.wire import GenerateRequest


def cap_max_tokens(default: int | None, limits: RequestLimits) -> int | None:
    """A default output length (generation_config.json's max_new_tokens, the API's own default)
    within server.limits.max_tokens: a default the server refuses would refuse every request that
    relies on it, naming a field the client never sent."""
    cap = limits.max_tokens
    if cap is None:
        return default
    return cap if default is None else min(default, cap)


def resolve_max_tokens(req: GenerateRequest, limits: RequestLimits, default: int | None = None) -> GenerateRequest:
    """`req` with the length of a max_tokens it left unset (None): `default` (None: up to the context)
    within the limit, as GenerateRequest.max_tokens_cap, which the model server applies to each prompt.
    A set max_tokens is left as it is (apply_limits refuses one past the limit)."""
    if req.params.max_tokens is not None:
        return req
    return dataclasses.replace(req, max_tokens_cap=cap_max_tokens(default, limits))


def apply_limits(req: GenerateRequest, limits: RequestLimits, default_max_tokens: int | None = None
                 ) -> GenerateRequest:
    """`req` with an unset max_tokens resolved (resolve_max_tokens); raises a 400 for anything past
    server.limits. Both in one call: a check of an unresolved request would let None through."""
    req = resolve_max_tokens(req, limits, default_max_tokens)
    p = req.params
    where = "(server.limits.{} of this server)"
    if p.n > limits.max_n:
        raise errors.invalid(f"n: at most {limits.max_n} {where.format('max_n')}; got {p.n}", "n")
    if len(p.stop) > limits.max_stop:
        raise errors.invalid(f"stop: at most {limits.max_stop} stop sequences {where.format('max_stop')}; "
                             f"got {len(p.stop)}", "stop")
    longest = max((len(s) for s in p.stop), default=0)
    if longest > limits.max_stop_chars:
        raise errors.invalid(f"stop: a stop sequence has at most {limits.max_stop_chars} characters "
                             f"{where.format('max_stop_chars')}; got {longest}", "stop")
    for name, value in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if value is not None and value > limits.max_logprobs:
            raise errors.invalid(f"{name}: at most {limits.max_logprobs} alternatives per token "
                                 f"{where.format('max_logprobs')}; got {value}", "logprobs")
    if limits.max_tokens is not None and p.max_tokens is not None and p.max_tokens > limits.max_tokens:
        raise errors.invalid(f"max_tokens: at most {limits.max_tokens} {where.format('max_tokens')}; "
                             f"got {p.max_tokens}", "max_tokens")
    if limits.max_prompt_tokens is not None:
        for i, ids in enumerate(req.prompts):
            if len(ids) > limits.max_prompt_tokens:
                param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
                raise errors.invalid(f"{param}: {len(ids)} tokens; at most {limits.max_prompt_tokens} "
                                     f"{where.format('max_prompt_tokens')}", param)
    return req


def prompt_params(req: GenerateRequest, max_model_len: int, virtual_tokens: int) -> list[SamplingParams]:
    """req.params for each prompt, req.max_tokens_cap applied where the client set no length: the cap, or up to
    the context where that ends first (the prompt's room less a p-tuned task's `virtual_tokens`, which only the
    model server knows). Raises RequestError for a min_tokens above the cap."""
    cap, p = req.max_tokens_cap, req.params
    if cap is None or p.max_tokens is not None:
        return [p] * len(req.prompts)
    try:
        capped = p.replace(max_tokens=cap)
    except RequestError as exc:  # min_tokens above the server's length: the client's min_tokens is refused
        raise RequestError(f"{exc} (max_tokens not set: {cap}, the server's default)", exc.param, exc.code) from None
    return [capped if max_model_len - virtual_tokens - len(ids) >= cap else p for ids in req.prompts]
