"""Scheduler-side state of one sequence (pure Python: the tuner simulates with it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engines.core.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int
    """Position among the request's n completions."""
    token_ids: list[int]
    """Prompt followed by the generated tokens."""
    prompt_len: int
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    """Tokens whose keys and values are in the cache."""
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    overtaken: int = 0
    """Requests that arrived after this one and were admitted while it waited (engines/core/scheduler.py)."""
    worker_has_state: bool = False
    prompt_logprobs_done: int = 0
    """Prompt positions whose logprobs were already returned (they are not returned twice after a
    preemption recomputes them)."""
    cache_key: bytes = b""
    """Prefix caching: what besides the token ids changes this sequence's keys and values (a
    p-tuning task's name and table digest, engines.core.block_manager.cache_key); the parent hash of its
    first block. b"" for the base model."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of the first len() full blocks of token_ids (computed once, as needed)."""
    num_cached_blocks: int = 0
    """Leading entries of block_ids that are in the prefix cache (hits, or blocks registered once
    their keys and values were computed)."""
    num_cached_tokens: int = -1
    """Tokens served from the prefix cache when the sequence was first admitted; -1 before that."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
