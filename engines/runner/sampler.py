"""Per-request sampling over a batch of logits.

Order: raw logprobs (reported as the model's, before any processing) -> min_tokens suppression (a
greedy row without penalties or grammar: after its argmax, on its own row, only when that argmax is
suppressed; the same token) -> repetition / presence / frequency penalties -> greedy rows take the argmax; the others are
scaled by temperature, cut by top-k and top-p, and drawn by inverse transform: one uniform u per
row, and the token is the first whose cumulative probability exceeds u times the row's total.
A token of probability zero (cut by top-k / top-p) spans an empty interval and is never drawn.
This costs one cumsum per row; an exponential race (argmax p_i / E_i) or torch.multinomial
needs a random number per vocabulary entry and was about 10x slower on CPU, a fifth of a 64-row
decode step (benchmarks/bench_sampler.py). A seeded sequence draws its u from its own
generator, so its tokens do not depend on what else is in the batch.

Structured output (engines/runner/grammar.py): a sequence with a grammar has a matcher. Filling a row's
token bitmask costs milliseconds (the grammar walks the vocabulary: ~2.4 ms for SmolLM2's 49,152
tokens inside a length-bounded JSON string), testing one token costs microseconds. So a constrained
row whose draw the mask would not reshape (greedy, or temperature alone: no top-k / top-p) is
*checked first*: it takes its own choice, the matcher tests it, and only a refused choice fills that
row's mask and draws again from the masked logits. Greedy, the argmax of the allowed tokens is the
unmasked argmax whenever that one is allowed; sampled, drawing from p and keeping an allowed token,
else drawing from p restricted to the allowed set, is exactly p restricted to the allowed set (the
rejection step of rejection sampling). Rows with top-k / top-p are *masked first*, because those
cuts are taken on the masked distribution: `prepare` starts their bitmask on a host thread before
the forward, so it overlaps the model, and `sample` waits for it and sets their forbidden logits to
-inf before drawing. Either way each matcher then advances by its token. On 2 cores that host
thread is not free (it takes CPU from the forward's threads), which is why checking first is the
default (`check_first`). A batch without a constrained row does none of this.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.core.plan import SeqInit, TokenLogprob

log = logging.getLogger(__name__)


@dataclass
class SeqSamplerState:
    init: SeqInit
    generator: torch.Generator | None
    num_output: int = 0
    counts: torch.Tensor | None = None
    """(vocab,) occurrences of each token among the outputs (for presence/frequency penalties)."""
    prompt_mask: torch.Tensor | None = None
    """(vocab,) bool, tokens of the prompt (for the repetition penalty)."""
    output_ids: list[int] = field(default_factory=list)
    matcher: Any = None
    """xgrammar.GrammarMatcher of a structured request (advanced on each sampled token); else None."""


def min_tokens_ids(init: SeqInit, vocab_size: int) -> list[int]:
    """The ids a sequence with min_tokens may not draw before it has that many outputs: its EOS and stop token ids
    inside the vocabulary (every last-stage rank knows them from the SeqInit, not only the sampling rank)."""
    return [t for t in (*init.eos_token_ids, *init.params.stop_token_ids) if t < vocab_size]


_M64 = 2**64 - 1


def completion_seed(seed: int, index: int) -> int:
    """The generator seed of completion `index` of a request seeded with `seed`: the seed itself
    for the first, a 64-bit mix (splitmix64) of both for the others, so that requests with nearby
    seeds (7 with n=3, 8 with n=2) do not share completions, as `seed + index` made them."""
    if index == 0:
        return seed
    return _splitmix64(seed + index * 0x9E3779B97F4A7C15)


def _splitmix64(x: int) -> int:
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def generator_seed(seed: int, index: int, device: torch.device) -> int:
    """completion_seed as the device's generator takes it. A CPU generator (mt19937) keeps only a seed's low 32 bits,
    so 5 and 2**32 + 5 drew the same tokens: there a seed outside [0, 2**32) is mixed (splitmix64) and folded to 32
    bits, a collision as likely as any two random seeds'. Seeds in [0, 2**32) are kept: their draws do not change."""
    s = completion_seed(seed, index) & _M64
    if device.type != "cpu" or s < 2**32:
        return s
    x = _splitmix64(s)
    return (x ^ (x >> 32)) & 0xFFFFFFFF


class Sampler:
    def __init__(self, vocab_size: int, seed: int, device: torch.device, argmax=None, grammars=None):
        """argmax: a function (S, V) fp32 CPU logits -> (S) int64 that equals torch.argmax(dim=-1)
        (engines/cpu/paged_kernel.py argmax_rows, vectorized); None: torch's. grammars: an
        engines.runner.grammar.Grammars for structured requests (None: they are refused when added)."""
        self.vocab_size = vocab_size
        self.device = device
        self._argmax = argmax
        self.grammars = grammars
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.states: dict[int, SeqSamplerState] = {}
        self._mask_thread: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple[int, ...], Future] | None = None
        """(seq ids, future of the bitmask) started by prepare() for the step now running."""
        self.check_first = True
        """Constrained greedy / temperature-only rows test their own choice before any mask (see the
        module's docstring); False: every constrained row is masked first (the reference behaviour)."""
        self.grammar_checked = 0
        """Constrained rows whose own choice was tested against the grammar, since the start."""
        self.grammar_refused = 0
        """Of those, the rows the grammar refused (each filled its mask and drew again)."""

    def add(self, init: SeqInit) -> None:
        gen = None
        if init.params.seed is not None:
            # one stream per completion of an n > 1 request
            gen = torch.Generator(device=self.device).manual_seed(generator_seed(init.params.seed, init.index, self.device))
        st = SeqSamplerState(init, gen)
        if init.params.has_penalties:
            st.counts = torch.zeros(self.vocab_size, device=self.device)
            st.prompt_mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            ids = torch.tensor([t for t in init.prompt_token_ids if t < self.vocab_size], dtype=torch.long)
            st.prompt_mask[ids.to(self.device)] = True
        if init.params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured output: this runner has no grammar compiler")
            st.matcher = self.grammars.matcher(init.params.structured, init.eos_token_ids)
        self.states[init.seq_id] = st

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    def _masked_first(self, st: SeqSamplerState) -> bool:
        """A constrained row whose mask must come before its draw: top-k / top-p cut the masked
        distribution, so a draw tested afterwards would not follow the same law."""
        if st.matcher is None or st.matcher.is_terminated():
            return False
        p = st.init.params
        return not (self.check_first and (p.greedy or (not p.uses_top_k and p.top_p >= 1.0)))

    def prepare(self, seq_ids: list[int]) -> None:
        """Start the token bitmask of the masked-first rows among seq_ids (the rows sample() will get)
        on the mask thread, to overlap the forward; nothing when no row needs it."""
        self._pending = None
        if not any(self._masked_first(self.states[s]) for s in seq_ids if s in self.states):
            return
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        key = tuple(seq_ids)
        self._pending = (key, self._mask_thread.submit(self._fill_masks, key))

    def _fill_masks(self, seq_ids: tuple[int, ...]) -> tuple[torch.Tensor, list[int]]:
        """((S, ceil(V / 32)) int32 bitmask, masked-first row indices); rows not listed stay all-allowed."""
        rows = [i for i, s in enumerate(seq_ids) if self._masked_first(self.states[s])]
        bitmask = self.grammars.bitmask(len(seq_ids))
        for i in rows:
            self.states[seq_ids[i]].matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask, rows

    def _masks(self, seq_ids: list[int]) -> tuple[torch.Tensor, list[int]] | None:
        pending, self._pending = self._pending, None
        if not any(self._masked_first(self.states[s]) for s in seq_ids):
            if pending is not None:
                pending[1].result()
            return None
        if pending is not None and pending[0] == tuple(seq_ids):
            return pending[1].result()
        if pending is not None:
            pending[1].result()  # never leave a fill running while the matchers advance
        return self._fill_masks(tuple(seq_ids))

    @torch.no_grad()
    def sample(self, seq_ids: list[int], logits: torch.Tensor) -> list[tuple[int, TokenLogprob | None]]:
        """logits (S, V) fp32, one row per sequence in seq_ids -> (token, logprob entry) each."""
        states = [self.states[s] for s in seq_ids]
        params = [st.init.params for st in states]
        want_lp = [p.logprobs is not None for p in params]
        raw_lp = torch.log_softmax(logits, dim=-1) if any(want_lp) else None

        logits = self._suppress_and_penalise(states, logits)
        masks = self._masks(seq_ids)
        if masks is not None:
            from engines.runner.grammar import apply_bitmask

            # a copy: the caller's logits stay as the model gave them (a TP runner returns them too)
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            apply_bitmask(logits, *masks)
        tok_list = self._pick(states, logits).tolist()
        for i, st in enumerate(states):  # greedy rows whose suppression waited for their argmax
            if params[i].min_tokens and self._suppress_after_pick(st):
                banned = self.suppressed_ids(st)
                if banned and tok_list[i] in banned:
                    row = logits[i:i + 1].float().clone()
                    row[0, banned] = float("-inf")
                    tok_list[i] = int(self.argmax(row)[0])
        checked = self._check_first(states, masks[1] if masks is not None else [], tok_list, logits)
        out: list[tuple[int, TokenLogprob | None]] = []
        for i, (st, tok) in enumerate(zip(states, tok_list)):
            st.num_output += 1
            if st.counts is not None:
                st.counts[tok] += 1
            if (st.matcher is not None and i not in checked and not st.matcher.is_terminated()
                    and not st.matcher.accept_token(tok)):
                # cannot happen when the mask was applied; logged, not raised: the engine must go on
                log.error("structured output: token %d refused by the grammar of sequence %d", tok,
                          st.init.seq_id)
            entry = None
            if want_lp[i]:
                entry = self.logprob_entry(raw_lp[i], tok, params[i].logprobs)
            out.append((tok, entry))
        return out

    def _check_first(self, states: list[SeqSamplerState], masked: list[int], tokens: list[int],
                     logits: torch.Tensor) -> set[int]:
        """Test each checked-first row's token against its matcher (advancing it when allowed); a
        refused row fills its own mask and draws again from its masked logits: `tokens` is updated in
        place. -> the rows whose matcher has advanced."""
        rows = [i for i, st in enumerate(states)
                if i not in masked and st.matcher is not None and not st.matcher.is_terminated()]
        refused = [i for i in rows if not states[i].matcher.accept_token(tokens[i])]  # refused: state kept
        self.grammar_checked += len(rows)
        self.grammar_refused += len(refused)
        if refused:
            for i, tok in zip(refused, self._redraw([states[i] for i in refused], logits[refused])):
                tokens[i] = tok
        return set(rows) - set(refused)

    def _redraw(self, states: list[SeqSamplerState], logits: torch.Tensor) -> list[int]:
        """The tokens of refused rows: their masks filled now, on the step's path, and applied to their
        logits (R, V) (a copy, taken by the caller's indexing), then argmax or a fresh draw."""
        from engines.runner.grammar import apply_bitmask

        bitmask = self.grammars.bitmask(len(states))
        for j, st in enumerate(states):
            st.matcher.fill_next_token_bitmask(bitmask, j)
        logits = logits.float()
        apply_bitmask(logits, bitmask, list(range(len(states))))
        return self._pick(states, logits).tolist()

    def _pick(self, states: list[SeqSamplerState], logits: torch.Tensor) -> torch.Tensor:
        """(S) tokens of logits (S, V): the argmax of greedy rows, a draw (_draw) for the others."""
        greedy = [st.init.params.greedy for st in states]
        if all(greedy):
            return self.argmax(logits)
        if not any(greedy):
            return self._draw(states, logits)
        tokens = torch.empty(len(states), dtype=torch.long, device=logits.device)
        g = torch.tensor(greedy, device=logits.device)
        tokens[g] = self.argmax(logits[g])
        rows = [i for i, x in enumerate(greedy) if not x]
        tokens[rows] = self._draw([states[i] for i in rows], logits[rows])
        return tokens

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (S, V) -> (S) greedy tokens: the first index of each row's maximum."""
        if self._argmax is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            return self._argmax(logits)
        return logits.argmax(dim=-1)

    @staticmethod
    def logprob_entry(lp_row: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
        top: tuple[tuple[int, float], ...] = ()
        if top_n:
            vals, ids = lp_row.topk(top_n)
            top = tuple(zip(ids.tolist(), vals.tolist()))
        return TokenLogprob(token, float(lp_row[token]), top)

    def suppressed_ids(self, st: SeqSamplerState) -> list[int]:
        """The token ids a sequence may not draw now: its EOS and stop token ids while it has fewer than min_tokens
        outputs (min_tokens), else none."""
        p = st.init.params
        if not p.min_tokens or st.num_output >= p.min_tokens:
            return []
        return min_tokens_ids(st.init, self.vocab_size)

    @staticmethod
    def _suppress_after_pick(st: SeqSamplerState) -> bool:
        """A greedy row with no penalties and no grammar: its suppression (min_tokens) is applied after the argmax,
        to its own row and only when the argmax is a suppressed id (the argmax of the allowed ids is the row's
        argmax whenever that one is allowed), instead of to a copy of the whole batch's logits first (a 64-row
        SmolLM2 batch: 12.6 MB copied a step)."""
        return st.init.params.greedy and st.counts is None and st.matcher is None

    def _suppress_and_penalise(self, states: list[SeqSamplerState], logits: torch.Tensor) -> torch.Tensor:
        copied = False
        for i, st in enumerate(states):
            banned = [] if self._suppress_after_pick(st) else self.suppressed_ids(st)
            if banned:
                if not copied:
                    logits, copied = logits.clone(), True
                logits[i, banned] = float("-inf")
            if st.counts is not None:
                if not copied:
                    logits, copied = logits.clone(), True
                p, row = st.init.params, logits[i]
                if p.repetition_penalty != 1.0:
                    seen = st.prompt_mask | (st.counts > 0)
                    # as in transformers / vLLM: divide positive logits, multiply negative ones
                    penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                    row = torch.where(seen, penalised, row)
                row = row - p.frequency_penalty * st.counts - p.presence_penalty * (st.counts > 0).float()
                logits[i] = row
        return logits

    def _draw(self, states: list[SeqSamplerState], logits: torch.Tensor) -> torch.Tensor:
        params = [st.init.params for st in states]
        unscaled = logits
        if any(p.temperature != 1.0 for p in params):
            temp = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
            logits = logits / temp
        if any(p.uses_top_k for p in params):
            k = torch.tensor([p.top_k if p.uses_top_k else logits.shape[1] for p in params],
                             device=logits.device).clamp(max=logits.shape[1])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)[:, None]
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
            drop_sorted[:, 0] = False  # also when top_p rounds to 0 in float32
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        f32 = {"dtype": torch.float32, "device": probs.device}
        u = torch.empty(len(states), 1, **f32)
        unseeded = [i for i, st in enumerate(states) if st.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, generator=self.generator, **f32)
        for i, st in enumerate(states):
            if st.generator is not None:
                u[i] = torch.rand(1, generator=st.generator, **f32)
        # float32, as GPU samplers do: float64 doubled the cost; the resolution (~6e-8) only bounds
        # how finely probabilities below that are honoured, and zeros stay exactly excluded
        cdf = probs.cumsum(dim=-1, dtype=torch.float32)
        total = cdf[:, -1:]
        # u < 1 so u * total < total; nextafter keeps the product's rounding from reaching the total
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, target, right=True)[:, 0]
        # a temperature so small that logits / T overflows leaves no finite distribution (NaN after
        # the softmax): such a row takes the limit of sampling as T -> 0, the argmax
        degenerate = ~(torch.isfinite(total[:, 0]) & (total[:, 0] > 0))
        if degenerate.any():
            tokens = torch.where(degenerate, unscaled.argmax(dim=-1), tokens)
        return tokens
