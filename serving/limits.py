"""Per-request limits (server.limits in deploy/schema.py), checked at the gateway before a request
reaches a model, for every API (OpenAI and KServe v2 alike): a 400 naming the field and the limit."""

from __future__ import annotations

from deploy.schema import RequestLimits
from serving import errors
from serving.wire import GenerateRequest


def check_limits(req: GenerateRequest, limits: RequestLimits) -> None:
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
