"""Per-request generation options; names and defaults follow the OpenAI API and vLLM."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.model.model_config import ConfigError, read_json_object

MAX_LOGPROBS = 20

GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json keys read as request defaults -> the SamplingParams field each sets (the
keys vLLM's `--generation-config auto` reads, less min_p, which we do not sample with)."""


class RequestError(ValueError):
    """A request is invalid. `param` names the offending field; `code` is a machine-readable reason."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise RequestError(f"{param}: {message}", param=param, code="invalid_value")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction; never changed afterwards."""

    n: int = 1
    """Completions per prompt."""
    max_tokens: int | None = 16
    """Most tokens to generate; None runs to the context limit."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens exist."""
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    seed: int | None = None
    """A seeded request draws the same tokens whatever else is in the batch."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top alternatives (0..20)."""
    prompt_logprobs: int | None = None
    """Return logprobs of the prompt tokens with this many alternatives (for echo)."""
    skip_special_tokens: bool = True
    structured: Any = None
    """An engines.runner.grammar.StructuredOutput: the output must match its grammar (JSON, or JSON of a
    schema); the sequence ends when the grammar is complete (its EOS). None: unconstrained."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        # accept a bare string / list for stop and stop_token_ids, as the OpenAI API does, and None for none
        for name in ("stop", "stop_token_ids"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(_is_int(self.n) and 1 <= self.n <= 128, "n", f"must be an integer in [1, 128], got {self.n!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        # finite: at infinity a row's ruled-out tokens (-inf logits) would turn to NaN and the row fall back to greedy
        _check(_is_num(self.temperature) and 0 <= self.temperature < math.inf, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= 2**31 - 1, "top_k",
               f"must be an integer in [-1, 2**31 - 1] (0 or -1 disables), got {self.top_k!r}")
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**63), "seed",
               f"must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), "stop",
               f"must be a non-empty string or a list of them, got {self.stop!r}")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _check(isinstance(self.stop_token_ids, tuple) and all(_is_int(t) and 0 <= t < 2**31
                                                              for t in self.stop_token_ids), "stop_token_ids",
               f"must be a list of integers in [0, 2**31), got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        _check(_is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
               f"must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), name,
                   f"must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.structured is not None:
            self._check_structured()

    def _check_structured(self) -> None:
        from engines.runner.grammar import check  # imports xgrammar only when a request has a grammar

        param = getattr(self.structured, "param", "structured")
        why = check(self.structured)
        if why is not None:
            raise RequestError(f"{param}: {why}", param=param, code="invalid_value")
        # the grammar ends the output with EOS: a request that may not stop at EOS cannot end it
        _check(not self.ignore_eos, "ignore_eos", "must be false with structured output (the grammar ends at EOS)")
        _check(self.min_tokens == 0, "min_tokens",
               "must be 0 with structured output (the grammar decides where the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def greedy_argmax(self) -> bool:
        """Greedy whose token is the argmax of the logits with at most a few ids ruled out (min_tokens' EOS and stop
        ids): no logprobs, penalties or grammar."""
        return self.greedy and not self.has_penalties and self.logprobs is None and self.structured is None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the full vocabulary row (logprobs, penalties, suppression, a grammar): the
        token is the argmax of the logits alone."""
        return self.greedy_argmax and self.min_tokens == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def generation_defaults(model_dir: str | Path) -> dict[str, Any]:
    """Default sampling values from a checkpoint's generation_config.json, as SamplingParams field
    names (e.g. {"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}); {} when there is no file.

    As vLLM's `--generation-config auto`: these become the defaults of requests that leave the
    fields unset (an explicit request value always wins); `do_sample` is not consulted (vLLM does
    not either: a file that sets a temperature asks for it). Raises ConfigError naming the file and
    the key for a value outside SamplingParams' range, so a bad file fails at load, not per request.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    data = read_json_object(path)
    out = {ours: data[key] for key, ours in GENERATION_DEFAULT_KEYS.items() if data.get(key) is not None}
    for key, ours in GENERATION_DEFAULT_KEYS.items():
        if ours in out:
            try:
                SamplingParams(**{ours: out[ours]})
            except RequestError as exc:
                raise ConfigError(f"generation_config.json: {key}: {str(exc).split(': ', 1)[1]}") from None
    return out
