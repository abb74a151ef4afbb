"""What the engine returns for a request: cumulative results plus this step's deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.core.plan import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """"stop" (EOS, stop string or stop token), "length" (max_tokens or context), "abort"."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, if any."""
    # what this step added (for streaming)
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    error: str | None = None
    """Set when the engine failed the request (the serving layer maps it to 503)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """arrival_time, first_scheduled_time, first_token_time, finished_time (time.monotonic())."""
    task: str | None = None
    num_virtual_tokens: int = 0
    """P-tuning: the task's virtual tokens, prepended to prompt_token_ids (which holds only the
    real ones); they occupy context positions and KV blocks and are billed separately."""
    num_cached_tokens: int = 0
    """Prompt tokens (virtual ones included) whose keys and values came from the prefix cache when
    the request was first scheduled (its first completion's; 0 before that)."""
