"""The narrow, picklable contract between the scheduler (driver) and the workers.

A StepPlan says which tokens of which sequences run this step and where their keys and values
go; a StepResult carries back the sampled tokens. Both are plain data (lists and ints), so a
multiprocess or Ray executor ships them once per step without tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeqWork:
    seq_id: int
    token_ids: list[int]
    """Inputs of this step: one token for decode, a chunk of the prompt for prefill."""
    start_pos: int
    """Absolute position of token_ids[0] (= tokens already in the cache)."""
    block_ids: list[int]
    """The sequence's whole block table after this step's allocation."""
    sample: bool
    """True when the chunk ends at the sequence's last token, so the next token is drawn."""
    prompt_lp_from: int = -1
    """Absolute position of the first hidden row whose prompt logprob is wanted, or -1 for none.
    The row at position i scores prompt token i + 1."""
    prompt_lp_targets: list[int] = field(default_factory=list)
    """The prompt tokens scored by rows prompt_lp_from, prompt_lp_from + 1, ..."""


@dataclass(frozen=True)
class SeqInit:
    """Sent the first time a worker sees a sequence: what its sampler needs to keep."""

    seq_id: int
    index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    prompt_table: object = None
    """P-tuning: the task's (N, hidden) float32 numpy table, whose rows replace the embeddings of
    the sequence's first N (virtual) tokens during prefill (engines/transforms/ptuning.py); None: no task."""
    prompt_every_layer: bool = False
    """The table is (N, layers * 2 * kv_width): every layer's keys/values of the N virtual tokens."""


@dataclass
class StepPlan:
    step: int
    decode: list[SeqWork] = field(default_factory=list)
    prefill: list[SeqWork] = field(default_factory=list)
    new_seqs: list[SeqInit] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    """Sequences that finished or were aborted: workers drop their sampler state."""
    steps: int = 1
    """Decode steps of this plan (several: multi-step decode, engines/core/scheduler.py): each decode row's token_ids
    are its next input, its blocks cover `steps` positions from start_pos, and the worker feeds each drawn token to
    the next step itself (every row plain greedy; none prefills)."""

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(len(w.token_ids) for w in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The most likely alternatives, (token_id, logprob), most likely first."""


@dataclass
class SeqResult:
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    """Logprobs of the prompt_lp_targets given their prefixes."""
    more: list[int] = field(default_factory=list)
    """A plan of several steps: the tokens drawn after token_id, in order (fewer than steps - 1 where a stop token
    ended the row's run)."""

    def token_at(self, j: int) -> int:
        """The token drawn at step j of the plan (0: token_id)."""
        return self.token_id if j == 0 else self.more[j - 1]


@dataclass
class StepResult:
    step: int
    seqs: dict[int, SeqResult] = field(default_factory=dict)
