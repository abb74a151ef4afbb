"""Which floating-point precision is fast on this machine: bf16 hardware detection and a timed probe.

One helper for both callers, so training and serving never guess differently:

- training's `precision: auto` times a forward + backward of the recipe's own shapes in bf16
  autocast and in fp32 (`time_precisions`) and trains in the faster (`choose_precision`);
- the engine's `dtype="auto"` (`engine_dtype`) picks bf16 only where there is bf16 hardware (AMX or
  AVX512-BF16 on x86, BF16 on Arm, a bf16-capable CUDA GPU) and, on such a CPU, confirms it with a
  forward probe of the model's own matmul shapes; fp32 everywhere else.

Without bf16 hardware, torch runs bf16 matmuls through a slow emulation: on a 2-core AVX2 EPYC a
forward + backward of the default recipe ran at ~64 tokens/s in bf16 against ~2,200 in fp32.

The CPU flags come from /proc/cpuinfo (or torch's own CPU capability checks where that file is not
there); every function takes them as an argument so tests can pose as any CPU. Probe results are
cached per process, keyed by what was timed.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "bf16": "Arm BF16"}
"""/proc/cpuinfo flags (x86 `flags`, aarch64 `Features`) that mean native bf16 matmuls, and their names."""
TIE_MARGIN = 1.05
"""bf16 must measure at least this much faster than fp32 to be chosen: fp32 is the more exact of
the two, so a near-tie (inside timing noise) goes to it."""
SLOW_WARN_RATIO = 1.5
"""An explicit precision that measures this many times slower than the other draws a warning."""


def read_cpu_flags(cpuinfo: str | Path = CPUINFO) -> frozenset[str] | None:
    """The first processor's flags (x86) or features (aarch64); None where the file is unreadable."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return None


def cpu_name(cpuinfo: str | Path = CPUINFO) -> str:
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip().lower() in ("model name", "cpu model", "hardware"):
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _torch_cpu_flags() -> frozenset[str]:
    """bf16 features as torch's CPU capability checks see them (x86 only), for hosts without /proc."""
    checks = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
    found = set()
    for flag, fn in checks.items():
        check = getattr(torch.cpu, fn, None)
        if check is not None and check():
            found.add(flag)
    return frozenset(found)


@dataclass(frozen=True)
class Hardware:
    """What one device offers for bf16."""

    device_type: str
    """cpu, cuda (anything else is treated as having no bf16 support)."""
    name: str
    """CPU model or GPU name."""
    bf16: bool
    """Native bf16 matmuls (not an emulation)."""
    feature: str
    """What provides them (AMX, AVX512-BF16, a CUDA capability), or why there are none."""


def detect(device: str | torch.device = "cpu", cpu_flags: Iterable[str] | None = None,
           cuda_bf16: bool | None = None) -> Hardware:
    """bf16 support of `device`; `cpu_flags` / `cuda_bf16` replace what the machine reports."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
        name = torch.cuda.get_device_name(dev) if torch.cuda.is_available() else "CUDA device"
        cap = "".join(map(str, torch.cuda.get_device_capability(dev))) if torch.cuda.is_available() else "?"
        return Hardware("cuda", name, bool(cuda_bf16),
                        f"CUDA sm{cap} bf16" if cuda_bf16 else f"CUDA sm{cap} without bf16")
    if dev.type != "cpu":
        return Hardware(dev.type, dev.type, False, f"{dev.type}: bf16 support not known")
    flags = frozenset(cpu_flags) if cpu_flags is not None else (read_cpu_flags() or _torch_cpu_flags())
    found = [label for flag, label in BF16_CPU_FLAGS.items() if flag in flags]
    if found:
        return Hardware("cpu", cpu_name(), True, " + ".join(found))
    best = next((f.upper() for f in ("avx512f", "avx2", "avx", "asimd", "neon") if f in flags), "no SIMD flags seen")
    return Hardware("cpu", cpu_name(), False, f"{best} only: no AMX or AVX512-BF16, bf16 is emulated")


@dataclass(frozen=True)
class Rates:
    """Tokens per second of the same work in each precision, timed back to back."""

    bf16: float
    fp32: float
    seconds: float
    """Wall time the probe took, warm-up included."""

    @property
    def ratio(self) -> float:
        """bf16 over fp32 (> 1: bf16 is faster)."""
        return self.bf16 / max(self.fp32, 1e-12)

    def describe(self) -> str:
        return (f"bf16 {self.bf16:,.0f} tokens/s, fp32 {self.fp32:,.0f} tokens/s "
                f"(bf16/fp32 {self.ratio:.2f}x, probe {self.seconds:.1f}s)")


RunFn = Callable[[str, int, int], None]
"""run(precision, batch, seq_len): one forward (+ backward) of a (batch, seq_len) token batch in
"bf16" or "fp32"; the caller's own model and loss."""

_CACHE: dict[object, Rates] = {}


def time_precisions(run: RunFn, batch: int, seq_len: int, budget_s: float = 4.0, key: object = None,
                    warmup_tokens: int = 64) -> Rates:
    """Time `run` in bf16 and fp32 on (batch, seq_len) and return both rates (cached under `key`).

    Each precision first runs a warm-up of (1, min(seq_len, warmup_tokens)) tokens. If bf16's
    warm-up shows the full batch would not fit in its half of `budget_s`, it runs that small call
    up to 3 times more (the first pays one-time set-up, and other jobs on the cores can stall any
    one call), and if the best is still that slow (an emulated bf16: ~4 s per 256 tokens on an
    AVX2 core pair) it is rated by that best small call. fp32, native on every CPU, is always
    timed on the full batch (small calls suffer most from contention). The full batch runs up to
    3 times, the precisions alternating so both see the same machine, and the best time counts
    (the least disturbed by other load).
    """
    if key is not None and key in _CACHE:
        return _CACHE[key]
    start = time.perf_counter()
    tokens = batch * seq_len
    warm_len = min(seq_len, warmup_tokens)
    best: dict[str, float] = {}
    timed: list[str] = []
    for prec in ("fp32", "bf16"):
        t0 = time.perf_counter()
        t = _timed(run, prec, 1, warm_len)  # the first call pays one-time set-up: only a hint
        small: list[float] = []
        # too slow for the full batch? time the small call again (best of up to 3: other jobs on
        # the cores can stall a call many times over), within this precision's half of the budget
        while (prec == "bf16" and t * tokens / warm_len > budget_s / 2 and len(small) < 3
               and time.perf_counter() - t0 < budget_s / 2):
            small.append(_timed(run, prec, 1, warm_len))
            t = min(small)
        if prec == "bf16" and t * tokens / warm_len > budget_s / 2:
            best[prec] = warm_len / t  # still too slow to time in full: rated by its best small call
        else:
            timed.append(prec)
    full: dict[str, list[float]] = {p: [] for p in timed}
    for _ in range(3):
        for prec in timed:
            full[prec].append(_timed(run, prec, batch, seq_len))
        if time.perf_counter() - start > budget_s:
            break
    best.update({p: tokens / min(ts) for p, ts in full.items()})
    rates = Rates(bf16=best["bf16"], fp32=best["fp32"], seconds=time.perf_counter() - start)
    if key is not None:
        _CACHE[key] = rates
    return rates


def _timed(run: RunFn, precision: str, batch: int, seq_len: int) -> float:
    t0 = time.perf_counter()
    run(precision, batch, seq_len)
    return max(time.perf_counter() - t0, 1e-9)


@dataclass(frozen=True)
class Choice:
    precision: str
    """bf16 or fp32."""
    reason: str
    rates: Rates | None = None
    warning: str | None = None
    """Set when an explicit precision measured much slower than the other."""


def choose_precision(requested: str, hardware: Hardware, rates: Rates | None = None) -> Choice:
    """The precision to run in: `requested` is auto, bf16 or fp32.

    auto: on CUDA, bf16 where the GPU has it; elsewhere the faster of the measured `rates` (a
    near-tie goes to fp32, see TIE_MARGIN), or, with no rates, bf16 only on bf16 hardware.
    An explicit choice is kept; if `rates` show it much slower than the other, `warning` says so.
    """
    if requested not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision: must be auto, bf16 or fp32, got {requested!r}")
    hw = f"{hardware.name} ({hardware.feature})"
    if requested != "auto":
        warning = None
        if rates is not None:
            mine, other = (rates.bf16, rates.fp32) if requested == "bf16" else (rates.fp32, rates.bf16)
            if other > SLOW_WARN_RATIO * mine:
                alt = "fp32" if requested == "bf16" else "bf16"
                warning = (f"precision {requested} was requested, but on {hw} it measures {mine:,.0f} tokens/s "
                           f"against {other:,.0f} tokens/s in {alt} ({other / mine:.1f}x faster); "
                           f"set precision: auto or {alt} to train faster")
        return Choice(requested, f"{requested} as configured", rates, warning)
    if hardware.device_type == "cuda" or rates is None:
        prec = "bf16" if hardware.bf16 else "fp32"
        return Choice(prec, f"auto: {prec} on {hw}", rates)
    prec = "bf16" if rates.bf16 > TIE_MARGIN * rates.fp32 else "fp32"
    return Choice(prec, f"auto: {prec} measured faster on {hw}: {rates.describe()}", rates)


# the engine's dtype="auto"

def forward_probe(n_embd: int, ffn_dim: int, device: str | torch.device = "cpu") -> RunFn:
    """A forward of the model's MLP matmul pair (n_embd -> ffn_dim -> n_embd) on random weights,
    the bulk of an inference step's FLOPs, in the given precision."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(precision: str, batch: int, seq_len: int) -> None:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        if precision not in weights:
            gen = torch.Generator().manual_seed(0)
            weights[precision] = (torch.randn(ffn_dim, n_embd, generator=gen).to(device, dtype),
                                  torch.randn(n_embd, ffn_dim, generator=gen).to(device, dtype))
        up, down = weights[precision]
        x = torch.randn(batch * seq_len, n_embd, device=device).to(dtype)
        with torch.inference_mode():
            torch.nn.functional.linear(torch.nn.functional.linear(x, up).relu_(), down)

    return run


def engine_dtype(device: str | torch.device = "cpu", n_embd: int = 0, ffn_dim: int = 0,
                 cpu_flags: Iterable[str] | None = None, cuda_bf16: bool | None = None,
                 rates: Rates | None = None) -> Choice:
    """The engine's `dtype="auto"`: "bfloat16" or "float32" with the reason (a Choice whose
    precision is the engine dtype name).

    bf16 only on bf16 hardware. On such a CPU, with the model's widths given (n_embd, ffn_dim), a
    forward probe of its matmul shapes (256 tokens; or `rates` given) confirms it: if bf16 does not
    measure faster than fp32 there (a torch build without native bf16 kernels), fp32.
    """
    hardware = detect(device, cpu_flags, cuda_bf16)
    if hardware.device_type == "cpu" and hardware.bf16 and rates is None and n_embd and ffn_dim:
        rates = time_precisions(forward_probe(n_embd, ffn_dim, device), 1, 256, budget_s=1.0,
                                key=("forward", str(device), n_embd, ffn_dim))
    choice = choose_precision("auto", hardware, rates if hardware.bf16 else None)
    name = "bfloat16" if choice.precision == "bf16" else "float32"
    why = choice.reason.removeprefix(f"auto: {choice.precision} ")
    return Choice(name, f"dtype auto -> {name}: {why}", choice.rates)
