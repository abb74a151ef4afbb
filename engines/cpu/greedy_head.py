"""Greedy tokens of an fp32 vocabulary head at about half its multiply-adds: a bf16 pass, then fp32 for the few near-best.

A greedy row (temperature 0, nothing that needs its whole logit row: SamplingParams.greedy_argmax) wants only the
index of its largest logit (with min_tokens: its largest allowed one, GreedyScreen.tokens' `suppressed`). The screen
computes every logit of the row from bf16 roundings of the hidden state and of the head (the panel kernel's bf16
path: vdpbf16ps on AVX512-BF16, AMX tiles, or widened on AVX2 hosts; products exact, fp32 sums), keeps the
vocabulary entries within a proven error bound of the row's best, and computes those few in fp32 from the head's own
rows; the largest of them (the lowest id on a tie, as torch.argmax) is the token.

The bound. For a hidden row h and a head row w of C entries, let D be their exact dot product. Any fp32 evaluation
L of it (the full head's kernel, whatever its summation order) has |L - D| <= g S, S = sum |h_i w_i|, g = C u / (1 - C
u), u = 2^-24. bf16 rounding (to nearest) moves each entry by at most 2^-9 of itself, so the exact dot of the
roundings is within (2^-8 + 2^-18) S of D, and their fp32 sum A within g (1 + 2^-9)^2 S of that: |L - A| <= c S with
c = 2^-8 + 2^-18 + 2.01 g. By Cauchy-Schwarz S <= |h| |w|, so entry j's error is at most B_j = c |h| |w_j| (c and the
norms rounded up by 1e-5, the norms raised by 1e-30: bf16 subnormals, which vdpbf16ps reads as 0, add at most
2^-126 (sum |h_i| + sum |w_i|), under both). The full head's argmax j* then has A_j* + B_j* >= L_j* >= L_k >= A_k - B_k
for every k: the candidates {j : A_j + B_j >= max_k (A_k - B_k)} hold it (csrc/head_screen.cpp). Their fp32 logits
come from a plain dot product, so where two of them lie within fp32 rounding of each other the token is the argmax
of an fp32 evaluation that may differ from the full head's kernel (as the full head's own kernel choice does between
a batch and one row). On SmolLM2-135M the bound is ~10x the error seen (0.16 against ~1.5 at |h| ~ 50): a row keeps
1 to a few hundred candidates.

Used where it times faster than the full head (`decide`: the head in fp32 and bf16 on this CPU, one row and a
decode batch); on SmolLM2-135M, 2-core EPYC Zen 4, the head with its argmax: 64 rows 19.7 -> 12.1 ms, one row 3.7 ->
2.4 ms, a 64-row decode step 1.06x (benchmarks/bench_greedy_head.py). EngineConfig.greedy_head_screen turns it off.
"""

from __future__ import annotations

import time

import torch

from engines.cpu import panel_kernel

MAX_CANDIDATES_PER_ROW = 256
"""More candidates than this a row on average (flat or broken rows): the full head for the batch instead."""


def screen_constant(in_features: int) -> float:
    """c of the module docstring's bound for a dot product of in_features terms."""
    u = 2.0 ** -24
    g = in_features * u / (1 - in_features * u)
    return 2.0 ** -8 + 2.0 ** -18 + 2.01 * g


class GreedyScreen:
    """The greedy tokens of the fp32 head `weight` (out, C) for hidden rows (S, C) fp32; see the module docstring."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, variant: str = "auto"):
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"GreedyScreen: an fp32 (out, in) head, got {weight.dtype} {tuple(weight.shape)}")
        from engines.cpu.fast_linear import _panels
        from engines.cpu.kernels import load

        self.weight = weight.detach()
        self.variant = variant  # the panel kernel's (panel_kernel.PANEL_VARIANTS; tests force each)
        self.vocab = min(vocab_size, weight.shape[0])
        self.panels = _panels(self.weight.bfloat16())  # (ceil(out / 16), in, 16) bf16
        self.c = screen_constant(weight.shape[1]) * (1 + 1e-5)  # rounded up (the bound's own fp32 arithmetic)
        # each entry's error bound is c |h| |w_j| (+ the subnormal term, below the norms' rounding up)
        self.norms = (self.weight[: self.vocab].norm(dim=1) * (1 + 1e-5) + 1e-30).contiguous()  # (V,) fp32
        self._near = load()[0].near_max_rows
        self.rows_one = self.rows_many = True
        """Whether one row / a batch takes the screen (decide)."""

    def applies(self, rows: int) -> bool:
        return self.rows_one if rows == 1 else self.rows_many

    def tokens(self, h: torch.Tensor, suppressed: tuple[list[int], list[int]] | None = None) -> torch.Tensor | None:
        """(S) int64 greedy tokens of the hidden rows h (S, C) fp32; None where a row is NaN / infinite or too flat (the
        caller takes the full logits). suppressed: (rows, token ids) pairs ruled out (min_tokens' EOS and stop ids):
        their screened logits become -inf, so they are never candidates and each row's token is the argmax of its
        allowed entries (the bound holds for any subset of the columns)."""
        h = h.contiguous()
        a = panel_kernel.panel_linear_f32(h.bfloat16(), self.panels, self.weight.shape[0], self.variant)  # (S, out)
        if a.shape[1] != self.vocab:
            a = a[:, : self.vocab].contiguous()
        if suppressed is not None:
            a[torch.tensor(suppressed[0]), torch.tensor(suppressed[1])] = float("-inf")
        k = (h.norm(dim=1) * self.c).float()  # (S,): entry j's error is at most k |w_j|
        pairs = self._near(a, k, self.norms)  # (N, 2) (row, column), columns ascending a row
        if pairs.shape[0] == 0 or bool((pairs[:, 1] < 0).any()) or pairs.shape[0] > MAX_CANDIDATES_PER_ROW * h.shape[0]:
            return None
        rows, cols = pairs[:, 0], pairs[:, 1]
        exact = (h[rows] * self.weight[cols]).sum(-1)  # (N,) fp32 logits of the candidates
        best = torch.full((h.shape[0],), float("-inf")).scatter_reduce(0, rows, exact, "amax")
        if not bool(torch.isfinite(best).all()):
            return None
        hit = torch.where(exact == best[rows], cols, torch.full_like(cols, self.vocab))
        return torch.full((h.shape[0],), self.vocab, dtype=torch.long).scatter_reduce(0, rows, hit, "amin")

    def decide(self, full, in_features: int, batch: int = 64, rounds: int = 5) -> str:
        """Time the full head (`full`: hidden (S, C) -> logits) against the screen at one row and `batch` rows, on
        random rows, alternating, median of `rounds`; keep the screen where it is faster. -> a line for the log."""
        gen = torch.Generator().manual_seed(0)
        out = []
        for rows in (1, batch):
            h = torch.randn(rows, in_features, generator=gen)
            t_full, t_screen = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                full(h).argmax(dim=-1)
                t_full.append(time.perf_counter() - t)
                t = time.perf_counter()
                self.tokens(h)
                t_screen.append(time.perf_counter() - t)
            f, s = sorted(t_full)[rounds // 2], sorted(t_screen)[rounds // 2]
            if rows == 1:
                self.rows_one = s < f
            else:
                self.rows_many = s < f
            out.append(f"{rows} row{'s' if rows > 1 else ''}: full {f * 1e3:.2f} ms, screen {s * 1e3:.2f} ms")
        return "; ".join(out)


def build_screen(head: torch.nn.Module | None, vocab_size: int) -> tuple[GreedyScreen | None, str]:
    """The screen of an fp32 CPU head with its dense weight and bf16 panels available, timed (decide); else (None, why)."""
    w = getattr(head, "weight", None)
    if w is None or w.dtype != torch.float32 or w.device.type != "cpu":
        return None, "the head is not an fp32 CPU weight"
    if not panel_kernel.available(torch.bfloat16):
        return None, "no bf16 panel kernel on this machine"
    from engines.model.transformer import head_logits

    screen = GreedyScreen(w, vocab_size)
    timing = screen.decide(lambda h: head_logits(head, h), w.shape[1])
    if not (screen.rows_one or screen.rows_many):
        return None, f"slower than the full head here ({timing})"
    return screen, timing
