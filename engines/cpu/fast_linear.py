"""A runtime transformation for CPU inference: each Linear gets the fastest kernel for its shape,
chosen by timing at load, separately for one row, a decode batch and a prefill chunk.

A decode matrix-vector product is memory-bound, and torch's kernels stream memory at very different rates by CPU,
dtype and shape (2-core EPYC, AVX512-BF16: the bf16 GPT-2 head took 12-24 ms a row through `F.linear` / `mm` / `mv`,
5-6 ms through oneDNN on a once-reordered weight, `packed`). Which kernel wins flips between machines (AVX2-only,
AVX-512, AMX) and between row counts, so nothing is fixed per CPU kind: each distinct (out, in, dtype, threads) shape
is timed all ways once per process, on one row, on MANY_ROWS rows (a decode batch), on BULK_ROWS rows (a short prefill
chunk) and on LARGE_ROWS rows (a step budget's chunk), and `FastLinear` dispatches on the row count, on repeated
interleaved rounds: a kernel must beat plain `F.linear` by 10% on its median and on its best round to replace it (a
single lucky or disturbed round decides nothing). Choices persist per machine (~/.cache/shardserve/fast_linear.json, linear_choices.py):
a later start skips the timing.

The weight stays the module's `weight` Parameter (a tied head stays tied, state_dict keys unchanged); transposed and
packed copies are extra non-persistent buffers, built for the kernels chosen. Under torch.compile a FastLinear is
plain `F.linear` (the graph does not depend on timings); only exact nn.Linear modules are swapped.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

from engines.cpu import panel_kernel
from engines.cpu.host_memory import huge_page_copy
from engines.cpu.linear_choices import load_saved, save, shape_key

log = logging.getLogger(__name__)

ONE_ROW = ("linear", "pretransposed", "gemv", "packed", "halves", "panel")
"""Candidates for a single row (batch-1 decode, the LM head of one sequence); "halves" only where the step runs on
two threads or more and oneDNN packing is available; "panel" (engines/cpu/panel_kernel.py) where it builds."""
MULTI_ROW = ("linear", "pretransposed", "packed", "sliced", "panel", "panel_avx2")
"""Candidates for several rows; "sliced" only for wide Linears (WIDE_MIN_OUT outputs and more); "panel_avx2" where
panel_avx2_offered (prefill chunks too)."""
PANEL_KINDS = {"panel": "auto", "panel_avx2": "avx2"}
"""The panel kernel's kinds (one copy of the panels) and the variant each runs (panel_kernel.PANEL_VARIANTS): the
avx2 code's several rows, row-major blocks whose 16 KB panel slices stay in L1 over a chunk of rows, ran 1.03-1.69x the
decode layout's blocks at 2-47 fp32 rows on AVX2 Zen 2 (csrc/panel_kernel.cpp); an AVX-512 or AMX host's auto runs
the decode layout there, so it times both rather than assume either."""
KERNEL_SET = 16
"""Version of the candidates and of the rule that picks among them, part of the saved choices' key (a choice saved
before a kernel or the rule changed times again; git log has what each version changed)."""
MANY_ROWS, BULK_ROWS, BULK_FROM = 32, 128, 65
"""Rows timed for a decode batch (used for 2..BULK_FROM-1 rows) and for a short prefill chunk (up to LARGE_FROM - 1)."""
LARGE_ROWS, LARGE_FROM = 1024, 384
"""Rows timed for a long prefill chunk (from LARGE_FROM rows; a busy server's steps fill 2,048 tokens): on the AVX-512
EPYC the panel kernel led oneDNN's packed one at 128 rows of SmolLM2's fp32 3072 x 576 (cold: 2.28 ms against 2.64)
and trailed it at 2,048 (190 GFLOP/s against 214; 576 x 1536: 75 against 222). The lowest median wins there."""
WIDE_MIN_OUT = 16384
"""Linears with at least this many outputs (vocabulary heads) also time the sliced kernel."""
COLD_BYTES = 96 << 20
"""Weights are timed cold: on enough copies to exceed this (3x a 32 MB L3), see choose_kernels."""
WIDE_CHUNK = 1024  # output features per slice of the sliced kernel: a (rows, 1024) result stays in cache


def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear can run `dtype` in this build on this CPU."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def panel_available(dtype: torch.dtype) -> bool:
    """Whether engines.cpu.panel_kernel builds here (once per machine) and takes `dtype`."""
    return panel_kernel.available(dtype)


def panel_avx2_offered(dtype: torch.dtype) -> bool:
    """Whether "panel_avx2" is a candidate: the CPU runs the panel kernel's avx2 variant and its auto resolves to
    another (on an AVX2 host "panel" runs that code already; tests pin auto, panel_kernel.auto_pinned)."""
    if not panel_available(dtype):
        return False
    try:
        return panel_kernel.panel_variant("avx2") == "avx2" and panel_kernel.panel_variant("auto") != "avx2"
    except ValueError:  # no AVX2 + FMA
        return False


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """The panel kernel's copy of a weight, in 2 MB pages (a decode step streams it whole)."""
    return huge_page_copy(panel_kernel.pack_panels(weight))


def pack_weight(weight: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """weight (out, in) reordered once into oneDNN's layout for `_linear_pointwise` on `rows` rows (fp32, AVX-512 EPYC:
    the one-row layout is plain, repacked every call: a 1,473-row chunk 184-199 GFLOP/s; the BULK_ROWS one 214-220)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


class FastLinear(nn.Module):
    """y = x @ W^T + b with a kernel per row count: `one` for a single row, `many` for up to
    BULK_FROM - 1 rows, `bulk` up to LARGE_FROM - 1, `large` above (`bulk`'s where not given). Kernels: linear (F.linear), pretransposed (addmm on a
    contiguous W^T), gemv (mv, one row only), packed (oneDNN on a prepacked W), sliced (F.linear
    over WIDE_CHUNK output features at a time, for a vocabulary head), panel (engines/cpu/panel_kernel.py
    on a copy of W stored in 16-output panels). `prepare` names more kernels to build copies for
    (the timing probes run every candidate)."""

    def __init__(self, linear: nn.Module, one: str = "linear", many: str = "linear", bulk: str = "linear",
                 chunk: int = WIDE_CHUNK, single: tuple[str, ...] | None = None, prepare: tuple[str, ...] = (),
                 dense: bool = True, large: str | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared: a tied head stays tied
        large = bulk if large is None else large
        self.one, self.many, self.bulk, self.large, self.chunk, self.single = one, many, bulk, large, chunk, single
        """(one, many, bulk, large) timed on one thread, used when a step runs on one thread (the engine's
        adaptive thread count, engines.cpu.cpu_threads); None: the kernels above at any count."""
        kinds = {one, many, bulk, large, *(single or ()), *prepare}
        decode = {one, many, *(single[:2] if single else ()), *prepare}
        w = linear.weight.detach()
        self.packed_rows = 1 if "packed" in decode else BULK_ROWS  # `packed`'s layout: prefill's if only it reads it
        self.register_buffer("weight_t", w.t().contiguous() if "pretransposed" in kinds else None, persistent=False)
        self.register_buffer("packed", pack_weight(w, self.packed_rows) if "packed" in kinds else None, persistent=False)
        self.half = half = (self.out_features + 1) // 2
        self.register_buffer("packed_lo", pack_weight(w[:half].contiguous()) if "halves" in kinds else None,
                             persistent=False)  # output features [0, half)
        self.register_buffer("packed_hi", pack_weight(w[half:].contiguous()) if "halves" in kinds else None,
                             persistent=False)  # [half, out)
        self.register_buffer("panels", _panels(w) if kinds & set(PANEL_KINDS) else None,
                             persistent=False)  # (ceil(out / 16), in, 16)
        if not dense:  # see dense_droppable: the panels (and a packed copy) are the only copy kept
            if not droppable(kinds_of(one, many, bulk, large, single)) or self.panels is None:
                raise ValueError(f"FastLinear: dense=False needs decode kernels among {sorted(DENSE_FREE)} and the "
                                 f"panels; got one={one}, many={many}, bulk={bulk}, large={large}, single={single}")
            self.register_parameter("weight", None)

    def probe_copy(self) -> FastLinear:
        """A copy for a timing's ring of cold copies: layouts copied, not reordered (~2 vs ~17 ms a tiny weight)."""
        other = FastLinear(_Weights(self.weight.detach().clone(), self.bias))  # "linear": builds no layout
        for name in ("weight_t", "packed", "packed_lo", "packed_hi", "panels"):
            t = getattr(self, name)
            setattr(other, name, None if t is None else t.clone() if name != "panels" else huge_page_copy(t.clone()))
        other.packed_rows = self.packed_rows
        return other

    def extra_repr(self) -> str:
        one_thread = f", one thread={'/'.join(self.single)}" if self.single else ""
        dense = "" if self.weight is not None else ", dense weight dropped (panels only)"
        return (f"{self.in_features} -> {self.out_features}, one={self.one}, many={self.many}, bulk={self.bulk}, "
                f"large={self.large}{one_thread}{dense}")

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) weight: the Parameter, or, where it was dropped (dense=False), a copy unpacked from the
        panels for this call (a prefill chunk: compute-bound, the unpacking a few % of its time)."""
        if self.weight is not None:
            return self.weight
        return panel_kernel.unpack_panels(self.panels, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the graph must not depend on this process's timings
            return F.linear(x, self.dense_weight(), self.bias)
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        return self.run(self.kind_for(x2.shape[0]), x2).view(*x.shape[:-1], self.out_features)

    def kind_for(self, m: int) -> str:
        """The kernel chosen for m rows on this thread count."""
        one, many, bulk, large = (self.single if self.single is not None and torch.get_num_threads() == 1
                                  else (self.one, self.many, self.bulk, self.large))
        return one if m == 1 else many if m < BULK_FROM else bulk if m < LARGE_FROM else large

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """The output in fp32 (a vocabulary head's logits): for bf16 rows through the bf16 panels, the kernel's fp32 sums
        unrounded, at any row count; otherwise forward(x).float(). Rounded to bf16, near-equal logits become equal (SmolLM2
        bf16: "The" -1.864 and "L" -1.963 both -1.905, and greedy took "L"); a bf16 head always has panels (apply)."""
        if (self.panels is not None and x.dtype == torch.bfloat16 and self.bias is None and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            x2 = x.reshape(-1, self.in_features).contiguous()
            return panel_kernel.panel_linear_f32(x2, self.panels, self.out_features).view(*x.shape[:-1], -1)
        return self.forward(x).float()

    def run(self, kind: str, x2: torch.Tensor) -> torch.Tensor:
        """x2 (M, in) -> (M, out) through `kind`."""
        b = self.bias
        if kind == "linear":
            return F.linear(x2, self.dense_weight(), b)
        if kind == "pretransposed":
            return torch.mm(x2, self.weight_t) if b is None else torch.addmm(b, x2, self.weight_t)
        if kind == "packed":
            return torch.ops.mkldnn._linear_pointwise(x2, self.packed, b, "none", [], "")
        if kind in PANEL_KINDS:
            return panel_kernel.panel_linear(x2, self.panels, self.out_features, b, PANEL_KINDS[kind])
        if kind == "halves":
            if x2.shape[0] != 1 or torch.get_num_threads() < 2:  # one thread: the whole packed weight
                return self.run("packed", x2) if self.packed is not None else F.linear(x2, self.dense_weight(), b)
            return _two_halves(x2, self.packed_lo, self.packed_hi, b, self.half)
        if kind == "gemv":
            if x2.shape[0] != 1:
                raise ValueError(f"gemv takes one row, got {x2.shape[0]}")
            w = self.dense_weight()
            return (torch.mv(w, x2[0]) if b is None else torch.addmv(b, w, x2[0]))[None]
        if kind == "sliced":
            out, w = x2.new_empty(x2.shape[0], self.out_features), self.dense_weight()  # (M, out)
            for s in range(0, self.out_features, self.chunk):
                e = min(s + self.chunk, self.out_features)
                out[:, s:e] = F.linear(x2, w[s:e], None if b is None else b[s:e])
            return out
        raise ValueError(f"unknown kernel {kind!r}; allowed: {sorted(set(ONE_ROW + MULTI_ROW))}")


DENSE_FREE = ("panel", "panel_avx2", "packed")
"""Decode kernels (one row, a decode batch, on any thread count) that read a copy of their own: a FastLinear
whose decode kernels are all among these keeps no dense weight (dense=False), its prefill chunks ("linear")
unpacking the panels per call. Before, a bf16 SmolLM2-135M engine held 583 MB of weights for 269 MB of
model: each block Linear's Parameter beside its panel copy, the Parameter read by prefill chunks only."""


def kinds_of(one: str, many: str, bulk: str, large: str, single: tuple[str, ...] | None) -> tuple[set[str], set[str]]:
    """(the decode kernels, the prefill kernels) of a FastLinear's choices."""
    decode, prefill = {one, many}, {bulk, large}
    if single is not None:
        decode, prefill = decode | set(single[:2]), prefill | set(single[2:])
    return decode, prefill


def droppable(kinds: tuple[set[str], set[str]]) -> bool:
    """Whether a FastLinear of these kernels can drop its dense weight: decode kernels among DENSE_FREE with
    a panel kind among them (what prefill unpacks, or reads), prefill by "linear", "packed" or a panel kind."""
    decode, prefill = kinds
    return decode <= set(DENSE_FREE) and bool(decode & set(PANEL_KINDS)) and prefill <= {"linear", "packed",
                                                                                        *PANEL_KINDS}


_HELPER: ThreadPoolExecutor | None = None  # one helper thread (one intra-op thread): a "halves" Linear's upper half


def _helper() -> ThreadPoolExecutor:
    global _HELPER
    if _HELPER is None:
        _HELPER = ThreadPoolExecutor(1, thread_name_prefix="fast-linear-half",
                                     initializer=torch.set_num_threads, initargs=(1,))
    return _HELPER


def _two_halves(x2: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor | None, half: int) -> torch.Tensor:
    """One row through a Linear split by output features: [0, half) on this thread, the rest on the helper thread,
    each on one intra-op thread, at the same time (torch releases the GIL in the op). Why: oneDNN's one-row linear
    streams its weight at one core's rate (~15 GB/s on the EPYC of BENCHMARKS.md, issue 12, the same on 1 and 2
    threads) while two cores read ~30 GB/s; a memory-bound product of two halves on two cores nearly halves its time.
    Each output is the same dot product as in the whole-weight kernel (bitwise equal in the tests). Costs a thread
    hand-off (~20-50 us), so it must win its timing to be used."""
    from engines.cpu.cpu_threads import intra_op_threads

    b_lo, b_hi = (None, None) if b is None else (b[:half], b[half:])

    fut = _helper().submit(lambda: torch.ops.mkldnn._linear_pointwise(x2, hi, b_hi, "none", [], ""))
    with intra_op_threads(1):
        low = torch.ops.mkldnn._linear_pointwise(x2, lo, b_lo, "none", [], "")
    return torch.cat([low, fut.result()], dim=1)  # (1, out)


class _Weights(nn.Module):
    """What FastLinear reads of an nn.Linear, around an existing weight (for timing on it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias


MARGIN = 0.9
"""A kernel replaces plain F.linear only when both its median and its best time are under this fraction
of linear's (the two statistics must agree: a lucky round alone, or a disturbed one, decides nothing)."""
TEAM_KERNELS = ("panel", "panel_avx2")
"""Kernels the fused decode step runs inside its one parallel region (engines/cpu/csrc/fused_team.cpp; the one of
lower median where both were timed): timed alone
each call pays a fork and a join that the fused step does not, and a Linear on any other kernel sends the whole step
to the per-op loop, so one is kept unless linear beats it by MARGIN (git log: KERNEL_SET 6, 46 against 57 tok/s)."""
TEAM_MARGIN = 1 / 1.5
"""At one row and at a decode batch on several threads a TEAM_KERNELS kernel is kept unless another's median is
under this fraction of its own (git log: KERNEL_SET 8 and 11; gemv kept for three of SmolLM2's bf16 shapes on the Xeon
ran batch 1 at 69 tok/s against 97 with the team)."""


def _fastest(fns: dict[str, Callable[[], object]], budget_s: float, min_rounds: int, max_rounds: int = 50,
             clock: Callable[[], float] = time.perf_counter, team_first: bool = False, outright: bool = False
             ) -> tuple[str, dict[str, float]]:
    """(the chosen kernel, each kernel's median seconds) over rounds of one call each (after a warm-up call each,
    HOPELESS ones dropped), until `budget_s` is spent (at least `min_rounds`, at most `max_rounds`): call by call
    interleaving, so that a neighbour's burst on a shared host hits all kernels alike and each gets quiet moments.
    The kernel of the lowest median wins if it beats "linear" by MARGIN on its median and on its best round; else a
    TEAM_KERNELS one unless "linear" beats it by MARGIN on its median; "linear" otherwise. team_first (one row or a
    decode batch, several threads): a TEAM_KERNELS kernel first, unless another's median is under TEAM_MARGIN of its
    own. outright (a long prefill chunk: compute-bound GEMMs, no team to keep): the lowest median wins. `clock` is
    injectable (tests)."""
    from engines.cpu.cpu_threads import median

    warm = {}  # each warm-up call's seconds (HOPELESS_WARM_S)
    for k, fn in fns.items():
        t = clock()
        fn()
        warm[k] = clock() - t
    cut = max(HOPELESS_WARM_S, HOPELESS * min(warm.values()))
    timed = {k: f for k, f in fns.items() if k == "linear" or warm[k] <= cut}
    times: dict[str, list[float]] = {k: [] if k in timed else [warm[k]] for k in fns}
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (spent < budget_s and rounds < max_rounds):
        for k, fn in timed.items():
            t = clock()
            fn()
            dt = clock() - t
            times[k].append(dt)
            spent += dt
        if not rounds:  # a kernel HOPELESS times the best one's first round keeps that one round
            timed = {k: f for k, f in timed.items() if times[k][0] <= HOPELESS * min(v[0] for v in times.values())}
        rounds += 1
    med = {k: median(v) for k, v in times.items()}
    winner = min(med, key=med.get)
    if outright:
        return winner, med
    team = sorted((k for k in TEAM_KERNELS if k in med), key=med.get)
    if team_first and team and med[winner] >= TEAM_MARGIN * med[team[0]]:
        return team[0], med
    if med[winner] < MARGIN * med["linear"] and min(times[winner]) < MARGIN * min(times["linear"]):
        return winner, med
    team = [k for k in team if med["linear"] >= MARGIN * med[k]]
    return (team[0] if team else "linear"), med


HOPELESS, HOPELESS_WARM_S = 8.0, 0.5
"""A kernel whose first timed round takes over HOPELESS times the best one's is not timed again (AVX2 EPYC, bf16
`pretransposed` took 5.7 s a call at 32 rows of SmolLM2's head: loading it with no saved choices 76 -> 46 s), nor one
whose warm-up call did and took over HOPELESS_WARM_S (one-time costs of a first call stay under it; that call stands
as its time; "linear" is always timed): 6.2 s there, twice per thread count and try."""
TIMING_TRIES, RETRY_MAX_S = 2, 4.0
"""Timings of a shape on a disturbed host (engines/cpu/cpu_threads.FORK_JOIN_QUIET_S) before its choice is used
unsaved (the next process times again); a timing that took over RETRY_MAX_S is not repeated (SmolLM2's bf16 head on
the AVX2 EPYC under make test's load: 92 s for two tries; a busy host's second try is mostly busy too)."""


_CHOSEN: dict[tuple[int, int, torch.dtype, int], tuple[str, str, str, str]] = {}
"""Choices made in this process: every engine built here uses the same kernels for a shape (the same rounding,
hence the same tokens) and pays for the timing once."""


def machine_key() -> str:
    """The CPU model, a digest of its flags, the torch build and the intra-op thread count: a
    choice timed under one of these is reused only under the same."""
    from engines.core.hardware import cpu_name, read_cpu_flags

    flags = " ".join(sorted(read_cpu_flags() or ()))
    digest = hashlib.sha1(flags.encode()).hexdigest()[:12]
    return (f"{cpu_name()}|flags {digest}|torch {torch.__version__}|threads {torch.get_num_threads()}"
            f"|kernels v{KERNEL_SET}")


def choose_kernels(weight: torch.Tensor, bias: torch.Tensor | None, budget_s: float = 0.4) -> tuple[str, ...]:
    """(one, many, bulk, large) kernels of this Linear's shape, timed on first use on this machine on its own weight
    (transposed and prepacked copies made for the timing only), ~`budget_s` for each row count (prefill's at least a
    few rounds): ~5 s for the GPT-2-124M shapes on 2 cores. A vocabulary head (WIDE_MIN_OUT outputs) takes its `bulk`
    as `large` untimed: a prefill chunk runs it on each prompt's last row only (58 GFLOP a call at LARGE_ROWS)."""
    out_f, in_f = weight.shape
    dtype = weight.dtype
    key = (out_f, in_f, dtype, torch.get_num_threads())
    if key in _CHOSEN:
        return _CHOSEN[key]
    machine, shape = machine_key(), shape_key(out_f, in_f, dtype, bias is not None)
    saved = load_saved().get(machine, {}).get(shape, {}).get("kernels")
    if isinstance(saved, list) and len(saved) == 4 and set(saved) <= set(ONE_ROW + MULTI_ROW) and (
            not {"packed", "halves"} & set(saved) or packing_available(dtype)) and (
            "panel" not in saved or panel_available(dtype)) and ("panel_avx2" not in saved or panel_avx2_offered(dtype)):
        _CHOSEN[key] = (saved[0], saved[1], saved[2], saved[3])
        return _CHOSEN[key]
    packs = packing_available(dtype)
    # in a model every Linear's weight is read after the others evicted it from the caches, so a
    # weight smaller than COLD_BYTES is timed on a ring of copies (each call the next one): timed
    # hot, a 768 x 768 bf16 weight (1.2 MB, in L2/L3) ranked the kernels unlike the model's steps
    copies = max(1, min(256, -(-COLD_BYTES // (weight.numel() * weight.element_size()))))
    halves = packs and torch.get_num_threads() >= 2  # a second core to read the other half
    panels = panel_available(dtype)
    offered = {"packed": packs, "halves": halves, "panel": panels, "panel_avx2": panel_avx2_offered(dtype),
               "sliced": out_f >= WIDE_MIN_OUT}  # the candidates that run here (the others always do)
    first = FastLinear(_Weights(weight, bias), "pretransposed", "packed" if packs else "linear",
                       "halves" if halves else "linear", prepare=("panel",) if panels else ())
    from engines.cpu.cpu_threads import FORK_JOIN_QUIET_S, fork_join_s, intra_op_threads

    # a prefill chunk's "packed" is timed on the layout it would run on (pack_weight for BULK_ROWS rows)
    bulk = FastLinear(_Weights(weight, bias), "linear", "linear", "packed") if packs else first
    with intra_op_threads(1):  # small copies: a parallel one waits a scheduler slice for its partner on a busy host
        probes = [first, *(first.probe_copy() for _ in range(copies - 1))]
        bulk_probes = [bulk, *(bulk.probe_copy() for _ in range(copies - 1))] if packs else probes
    turn = iter(range(1 << 62))
    prefill = [k for k in ("linear", "packed", "panel", "panel_avx2") if offered.get(k, True)]  # compute-bound

    def call(kind: str, x: torch.Tensor) -> torch.Tensor:
        ring = bulk_probes if kind == "packed" and x.shape[0] >= BULK_FROM else probes
        return ring[next(turn) % copies].run(kind, x)

    for attempt in range(TIMING_TRIES):
        quiet, t0 = fork_join_s() < FORK_JOIN_QUIET_S, time.perf_counter()
        runs = []
        with torch.no_grad():
            for rows, kinds, min_rounds in (
                    (1, [k for k in ONE_ROW if offered.get(k, True)], 5),
                    (MANY_ROWS, [k for k in MULTI_ROW if offered.get(k, True)], 3),
                    (BULK_ROWS, prefill, 3),
                    *([(LARGE_ROWS, prefill, 3)] if out_f < WIDE_MIN_OUT else [])):
                x = torch.randn(rows, in_f).to(dtype)
                runs.append(_fastest({k: (lambda k=k, x=x: call(k, x)) for k in kinds}, budget_s, min_rounds,
                                     team_first=rows < BULK_ROWS and torch.get_num_threads() >= 2,
                                     outright=rows == LARGE_ROWS))
        quiet = quiet and fork_join_s() < FORK_JOIN_QUIET_S
        if quiet or time.perf_counter() - t0 > RETRY_MAX_S:
            break
        log.info("fast_linear %s: the host was busy while timing (try %d of %d)", key, attempt + 1, TIMING_TRIES)
    probes.clear(), bulk_probes.clear()  # the copies (up to COLD_BYTES in three layouts, and prefill's) go now
    _CHOSEN[key] = (runs[0][0], runs[1][0], runs[2][0], runs[-1][0])
    if quiet:
        save(machine, shape, _CHOSEN[key], [t for _, t in runs])
    else:  # used by this process only: the next one times again
        log.warning("fast_linear %s: timed on a busy host %d times; %s used unsaved", key, attempt + 1, _CHOSEN[key])
    log.debug("fast_linear %s: %s; ms %s", key, _CHOSEN[key],
              [{k: round(v * 1e3, 3) for k, v in t.items()} for _, t in runs])
    return _CHOSEN[key]


def apply_fast_linear(model: nn.Module, single_thread_too: bool = False, drop_dense: bool = False
                      ) -> dict[tuple[int, int], tuple[str, str, str, str]]:
    """Swap each plain CPU nn.Linear (fp32 / bf16 / fp16) for a FastLinear with its shape's timed
    kernels (one row, decode batch, short and long prefill chunks); returns the choices by (out, in). A shape whose
    four choices are all plain linear keeps its nn.Linear.

    drop_dense: a Linear whose decode kernels all read their own copy (DENSE_FREE) and whose weight no other
    module holds (a tied head's is the embedding's) keeps only that copy: the replica's weight memory is
    then the model's bytes, not twice them. Not for a model that torch.compile traces (its graph reads the
    dense weight) nor one that is trained.

    single_thread_too: when this runs on several threads, also time each shape on one thread and
    use those kernels in steps run on one thread (the engine's adaptive thread count). Timing on
    one thread is also the one that a busy host cannot distort: on 2 cores shared with other
    processes every 2-thread call waited ~4 ms for its partner thread, so the 2-thread times there
    were the scheduler's, not the kernels' (BENCHMARKS.md, issue 12, run 7)."""
    from engines.cpu.cpu_threads import intra_op_threads

    choices: dict[tuple[int, int], tuple[str, str, str, str]] = {}
    holders: dict[int, int] = {}  # id(parameter) -> modules holding it (a tied head's weight: 2)
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            key = (child.out_features, child.in_features)
            choices[key] = choose_kernels(child.weight, child.bias)
            single = None
            if single_thread_too and torch.get_num_threads() > 1:
                with intra_op_threads(1):
                    single = choose_kernels(child.weight, child.bias)
            # a bf16 vocabulary head keeps panels whatever its timings chose: its forward_float (fp32 logits) reads them
            head = (child.out_features >= WIDE_MIN_OUT and child.weight.dtype == torch.bfloat16
                    and child.bias is None and panel_available(torch.bfloat16))
            if choices[key] != ("linear",) * 4 or single not in (None, ("linear",) * 4) or head:
                kernels = choices[key]
                dense = not (drop_dense and holders.get(id(child.weight)) == 1
                             and droppable(kinds_of(*kernels, single)))
                if not dense and child.weight.dtype == torch.bfloat16 and packing_available(torch.bfloat16):
                    # bf16: "linear" was timed beside a dense weight; without one it unpacks the panels every
                    # prefill chunk (SmolLM2's down projection: 0.9 ms a call, 6 % of prefill): oneDNN's packed
                    # copy (timed within a few % of it) costs the dense weight's memory. fp32 keeps its timed
                    # choice (KERNEL_SET 12: "packed" in prefill's layout wins there on its own, 8 % of a prefill)
                    packed = {"linear": "packed"}
                    kernels = (*kernels[:2], *(packed.get(k, k) for k in kernels[2:]))
                    single = None if single is None else (*single[:2], *(packed.get(k, k) for k in single[2:]))
                setattr(parent, name, FastLinear(child, *kernels[:3], large=kernels[3], single=single, dense=dense,
                                                 prepare=("panel",) if head else ()))
    if choices:
        log.info("fast_linear kernels (one row, decode batch, short and long prefill chunks): %s", choices)
    return choices
