"""Hardware profiles: datasheet constants plus fitted efficiency factors, read from YAML.

Profiles are data. Built-in ones live in tuner/profiles/<name>.yaml; a user passes a built-in
name or the path of a YAML file of the same shape.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).parent / "profiles"


class ProfileError(ValueError):
    """A hardware profile is unknown or malformed; the message names the field."""


def builtin_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and its interconnect; all rates are per device."""

    name: str
    memory_gib: float
    """Device memory (GiB) for weights, KV cache and workspace."""
    hbm_bandwidth_gb_s: float
    """Datasheet memory read bandwidth (GB/s, 1e9 bytes)."""
    flops_tflops: dict[str, float]
    """Dense matmul rate (1e12 FLOP/s) per compute dtype: bfloat16, float16, float32, fp8."""
    intra_node_bandwidth_gb_s: float
    """Device-to-device bandwidth inside a node, one direction (GB/s)."""
    inter_node_bandwidth_gb_s: float
    """Per-device bandwidth between nodes (GB/s)."""
    devices_per_node: int = 8
    kind: str = "analytic"
    """analytic (datasheet + fitted factors) or measured (`shardserve tune profile`)."""
    bw_efficiency: float = 0.8
    """Share of hbm_bandwidth_gb_s a weight or KV read reaches (fitted)."""
    flops_efficiency: float = 0.6
    """Share of flops_tflops a matmul reaches (fitted)."""
    layer_overhead_us: float = 0.0
    """Fixed cost of one transformer layer on one device per step (kernel launches; fitted)."""
    step_overhead_ms: float = 0.0
    """Fixed cost of one engine step (scheduling, sampling, host work; fitted)."""
    collective_latency_us: float = 10.0
    """Start-up cost of one all-reduce or one pipeline send (fitted)."""
    reserved_memory_gib: float = 2.0
    """Device memory kept for activations, workspace and the runtime."""
    cores: int = 0
    """CPU profiles: host cores that the shards of one model copy share (a TP x PP layout gives
    each shard cores // (tp * pp) threads, as the engine does); 0 for devices with their own compute."""
    serving_cores: int = 0
    """CPU profiles: cores a copy of one shard leaves to the serving side beside its engine (the
    replica's event loop, Ray, the gateway, the streams): its engine runs a fixed cores -
    serving_cores threads (threads(1); tuner.emit sets worker_threads to it), as vLLM's CPU backend
    does with VLLM_CPU_NUM_OF_RESERVED_CPU. 0: the engine picks each step's count
    itself (engines.cpu.cpu_threads.AdaptiveThreads): the faster deployment on a 2-core host, but its
    choices depend on what the host ran before, which a profile does not see (BENCHMARKS.md, SLO
    tuner on this machine, session 33)."""
    matmul_tflops: dict[int, dict[str, dict[int, float]]] = field(default_factory=dict)
    """Measured dense matmul rate (1e12 FLOP/s) by threads -> dtype -> rows of the activation;
    interpolated in log(rows). Empty: flops_tflops x flops_efficiency with the bandwidth roofline."""
    seq_overhead_us: float = 0.0
    """Fixed cost per sequence in a step (sampling, bookkeeping, streaming its token; fitted)."""
    seq_layer_overhead_us: float = 0.0
    """Fixed cost per sequence per layer (per-sequence attention calls on CPU; fitted)."""
    prefill_layer_overhead_us: float = 0.0
    """Fixed cost per layer of a step that holds a prefill chunk, on top of layer_overhead_us: an
    engine whose decode steps replay CUDA graphs but whose prefill runs eagerly (shardserve on a GPU)
    launches its kernels one by one only there (fitted; 0 for the published engines' profiles)."""
    attention_kv_gb_s: float = 0.0
    """Rate at which decode attention reads its KV context (GB/s); 0 uses the memory bandwidth."""
    attention_prefill_tflops: float = 0.0
    """Rate of prefill attention FLOPs (query x key, both matmuls); 0 uses the matmul peak."""
    send_latency_us: float = 0.0
    """Start-up cost of one pipeline send; 0 uses collective_latency_us."""
    request_overhead_ms: float = 0.0
    """Gateway + Ray cost per request, outside the engine (adds to TTFT and E2E; fitted)."""
    request_overhead_per_seq_ms: float = 0.0
    """What request_overhead_ms grows by for every sequence the engine holds when a request
    arrives (the serving side's work per stream in flight delays a new request's way in). A
    layout's own value (layouts) wins. `tune profile` leaves it at 0 and records the value that
    would fit its probes' open-loop TTFTs as layouts' served_overhead_per_seq_ms (a diagnostic:
    BENCHMARKS.md, tuner passes 15-17)."""
    matmul_width_factor: dict[int, dict[int, float]] = field(default_factory=dict)
    """Measured rate of a Linear of model width W (W -> 4W, as an MLP's first projection) against
    the rate table's own shape, by W -> rows (one thread, the engine's dtype); interpolated in
    log(W) and log(rows), clamped at the measured ends. Narrow layers run below the table's rate
    on CPUs. Empty: every width runs at the table's rate."""
    layouts: dict[str, dict[str, float]] = field(default_factory=dict)
    """CPU profiles: per TP x PP layout ("TPxPP", e.g. "2x1"), constants fitted on the engine's own
    steps through that layout's real executor (shard processes over gloo, cores // (tp * pp)
    threads each): LAYOUT_KEYS. They replace the global constants of the same names for that
    layout; matmul_scale and comm_scale multiply the matmul and communication times the profile's
    tables give. Empty: global constants."""
    cache_mib: float = 0.0
    """CPU profiles: the last-level cache the shards of one model copy share (MiB). A copy whose
    weights outgrow it reads them from memory at every step, which the cache-resident rate table
    does not see (CostModel.weight_stream_bytes); 0: not modelled (devices, built-in profiles)."""
    host_reference: dict[str, float] = field(default_factory=dict)
    """Measured profiles: how fast the host ran while the probes were served (tuner.hostref:
    decode_us, read_gb_s, steal_pct). Empty: no recalibration is possible."""
    host_scale: dict[str, float] = field(default_factory=dict)
    """Recalibration of a measured profile to the host's state now (tuner.hostref.recalibrated):
    "cpu" multiplies the CPU-bound step terms and the request overhead, "memory" the weight-streaming
    term. Empty: 1.0 (the host as profiled)."""
    fit_notes: str = ""
    """What the efficiency factors were fitted on."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("memory_gib", "hbm_bandwidth_gb_s", "intra_node_bandwidth_gb_s", "inter_node_bandwidth_gb_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ProfileError(f"{name}: must be a positive number, got {v!r}")
        if not isinstance(self.flops_tflops, dict) or not self.flops_tflops:
            raise ProfileError("flops_tflops: must map a dtype (bfloat16, float16, float32, fp8) to TFLOP/s")
        for k, v in self.flops_tflops.items():
            if not (isinstance(v, (int, float)) and v > 0):
                raise ProfileError(f"flops_tflops.{k}: must be a positive number, got {v!r}")
        # measured profiles carry refitted correction factors, which may exceed 1
        top = 1.0 if self.kind == "analytic" else 4.0
        for name in ("bw_efficiency", "flops_efficiency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= top):
                raise ProfileError(f"{name}: must be in (0, {top:g}], got {v!r}")
        for name in ("layer_overhead_us", "step_overhead_ms", "collective_latency_us", "reserved_memory_gib",
                     "seq_overhead_us", "seq_layer_overhead_us", "prefill_layer_overhead_us", "attention_kv_gb_s",
                     "attention_prefill_tflops",
                     "send_latency_us", "request_overhead_ms", "request_overhead_per_seq_ms", "cache_mib"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ProfileError(f"{name}: must be a number >= 0, got {v!r}")
        if not isinstance(self.cores, int) or self.cores < 0:
            raise ProfileError(f"cores: must be an integer >= 0, got {self.cores!r}")
        if not isinstance(self.serving_cores, int) or not 0 <= self.serving_cores < max(self.cores, 1):
            raise ProfileError(f"serving_cores: must be an integer >= 0 and below cores ({self.cores}), "
                               f"got {self.serving_cores!r}")
        if self.kind not in ("analytic", "measured"):
            raise ProfileError(f"kind: must be analytic or measured, got {self.kind!r}")
        _check_rate_table(self.matmul_tflops)
        _check_layouts(self.layouts)
        for name in ("host_reference", "host_scale"):
            table = getattr(self, name)
            if not (isinstance(table, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in table.values())):
                raise ProfileError(f"{name}: must map names to numbers >= 0, got {table!r}")
        unknown = sorted(set(self.host_scale) - {"cpu", "memory"})
        if unknown or not all(v > 0 for v in self.host_scale.values()):
            raise ProfileError(f"host_scale: keys cpu and memory with factors > 0, got {self.host_scale!r}")
        for w, by_rows in self.matmul_width_factor.items():
            if not (isinstance(w, int) and w >= 1 and isinstance(by_rows, dict) and by_rows
                    and all(isinstance(r, int) and r >= 1 and isinstance(v, (int, float)) and v > 0
                            for r, v in by_rows.items())):
                raise ProfileError(f"matmul_width_factor: must map width -> rows -> factor > 0, got {w!r}: {by_rows!r}")

    def layout(self, tp: int, pp: int) -> dict[str, float] | None:
        """The measured constants of layout tp x pp, or None (use the global ones)."""
        return self.layouts.get(layout_key(tp, pp))

    def request_overheads_s(self, tp: int, pp: int) -> tuple[float, float]:
        """(seconds per request, more seconds per sequence the engine holds at its arrival) outside
        the engine for layout tp x pp (tuner.simulate.simulate's request_overhead, overhead_per_seq)."""
        lay = self.layout(tp, pp) or {}
        per_seq = lay.get("request_overhead_per_seq_ms", self.request_overhead_per_seq_ms)
        cpu = self.scale("cpu")
        return self.request_overhead_ms * 1e-3 * cpu, per_seq * 1e-3 * cpu

    def scale(self, kind: str) -> float:
        """host_scale's factor for `kind` ("cpu" or "memory"), 1.0 when not recalibrated."""
        return float(self.host_scale.get(kind, 1.0))

    def threads(self, shards: int) -> int:
        """Threads of one shard when `shards` processes share the host (CPU profiles): one shard
        leaves serving_cores to the serving side."""
        if not self.cores:
            return 1
        return max(1, self.cores - self.serving_cores) if shards <= 1 else max(1, self.cores // shards)

    def matmul_rate(self, dtype: str, rows: float, shards: int = 1, width: int = 0,
                    threads: int = 0) -> float | None:
        """Measured matmul FLOP/s for `rows` activation rows, interpolated in log(rows) between
        the measured row counts, at the measured thread count nearest to a shard's (or to
        `threads`), for a layer of model width `width` (0: the table's own shape); None without
        a table."""
        if not self.matmul_tflops:
            return None
        want = threads or self.threads(shards)
        th = min(self.matmul_tflops, key=lambda t: (abs(int(t) - want), -int(t)))
        table = self.matmul_tflops[th]
        key = dtype if dtype in table else ("float32" if "float32" in table else next(iter(table)))
        rate = _interp(table[key], rows) * 1e12
        if width and self.matmul_width_factor:
            widths = sorted((int(w), _interp(by_rows, rows)) for w, by_rows in self.matmul_width_factor.items())
            rate *= _interp(dict(widths), width)
        return rate

    def flops(self, dtype: str) -> float:
        """Dense matmul FLOP/s for `dtype` before efficiency; fp8 falls back to the 16-bit rate
        on hardware without fp8 tensor cores (the weights are upcast)."""
        table = self.flops_tflops
        key = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "fp8": "fp8"}.get(dtype, dtype)
        if key in table:
            return table[key] * 1e12
        for fallback in ("bfloat16", "float16", "float32"):
            if fallback in table:
                return table[fallback] * 1e12
        raise ProfileError(f"flops_tflops: no rate for {dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}

    def replace(self, **changes: Any) -> HardwareProfile:
        import dataclasses

        return dataclasses.replace(self, **changes)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _interp(table: dict, x: float) -> float:
    """table[x] interpolated linearly in log(x) between its keys, clamped at the ends."""
    pts = sorted((int(k), float(v)) for k, v in table.items())
    x = max(1.0, float(x))
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, v0), (x1, v1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return v0 + f * (v1 - v0)
    return pts[-1][1]  # unreachable: the keys are sorted


LAYOUT_KEYS = ("step_overhead_ms", "layer_overhead_us", "seq_overhead_us", "seq_layer_overhead_us",
               "matmul_scale", "comm_scale", "attention_prefill_tflops", "attention_kv_gb_s")
"""Fitted constants of one layout (see HardwareProfile.layouts): matmul_scale multiplies the
one-thread rate table's matmul time, comm_scale the gloo-measured collective and send time; the
attention rates are per shard."""
LAYOUT_OPTIONAL = ("vocab_seq_ns", "matmul_mt_scale", "token_layer_width_ns", "dram_weight_gb_s", "head_ns",
                   "request_overhead_per_seq_ms", "prefill_step_ms", "served_decode_scale", "served_step_ms",
                   "decode_batch_layer_us")
"""Fitted constants a layout may leave out (0): ns per sampled sequence per vocabulary entry of the
shard (the LM head's per-sequence work beyond its matmul: log-softmax, argmax, copies); and, for a
shard of several threads, a factor on the rate table's time at those threads (added to
matmul_scale's one-thread time: a big prefill's matmuls split over the threads, a decode step's
small ones hardly do); and ns per token per layer per channel of the shard's width (the layers'
elementwise work beside their matmuls: norms, activations, residual adds, copies; a prefill has many
tokens per sequence, so it is not the per-sequence cost); and the rate (GB/s) at which a step reads the
weights that do not fit the last-level cache (HardwareProfile.cache_mib), beyond the rate table's
time (0: no such term); and ns per entry of the shard's LM-head weight (vocabulary x width) in a
step that samples, whatever its batch (the head's fixed work beyond the rate table's matmul); and
the layout's request_overhead_per_seq_ms (HardwareProfile's field of that name); and ms of a step
that holds a prefill chunk, beyond what its tokens and layers cost (the prefill path's own fixed
work: the module path's dispatch of its ops, each prefill's attention call and causal mask, the
chunk's block-table and slot bookkeeping); and, for constants fitted on the engine's own steps in one
process (LAYOUT_DECODE), the factor a served decode step takes against them (0: none; every part
of the step moves by it) and the ms a served step adds to that; and us per layer of a decode-only
step of two sequences or more (the fused decode step's batch kernels against its batch-1 path) (the serving loop and the processes beside the engine, per step)."""
LAYOUT_DECODE = "decode"
"""A layout may hold, under this key, a mapping of the same constants that its decode-only steps use
instead (tuner.measure_engine.fit_on_engine: fitted on the engine's decode batches of 1-16 in one
process, with served_decode_scale and served_step_ms placing them at the served steps' level); its
steps that hold a prefill chunk keep the layout's own (fitted on the served steps)."""
LAYOUT_NOTES = ("probe_steps", "probe_median_error_pct", "engine_median_error_pct", "probe_max_error_pct", "probe_mean_ratio", "retried_from_median_error_pct",
                "served_scale", "served_attention_scale", "served_fit_error_pct", "served_gap_ms",
                "served_ttft_log_error", "served_overhead_per_seq_ms")
"""Diagnostics stored beside them: steps fitted on, the fit's own relative error on them and, for a
layout measured twice (tuner.measure_engine.RETRY_ABOVE_PCT), the error of the pass not kept; and
served_gap_ms, the median time the serving loop spent between two steps (already in the constants,
which are fitted on served step cycles: tuner.measure_served); served_scale, served_attention_scale
and served_fit_error_pct are kept for profiles of the earlier TPOT-scaled fit."""


def layout_key(tp: int, pp: int) -> str:
    return f"{tp}x{pp}"


def _check_layouts(layouts: Any) -> None:
    if not isinstance(layouts, dict):
        raise ProfileError("layouts: must map 'TPxPP' to a mapping of fitted constants")
    for key, consts in layouts.items():
        if isinstance(consts, dict) and LAYOUT_DECODE in consts:
            _check_layouts({key: consts[LAYOUT_DECODE]})
            consts = {k: v for k, v in consts.items() if k != LAYOUT_DECODE}
        parts = str(key).split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ProfileError(f"layouts: keys must be 'TPxPP' with TP, PP >= 1 (e.g. '2x1'), got {key!r}")
        if not isinstance(consts, dict):
            raise ProfileError(f"layouts.{key}: must map {', '.join(LAYOUT_KEYS)} to numbers")
        missing = [k for k in LAYOUT_KEYS if k not in consts]
        unknown = sorted(set(consts) - set(LAYOUT_KEYS) - set(LAYOUT_OPTIONAL) - set(LAYOUT_NOTES))
        if missing or unknown:
            raise ProfileError(f"layouts.{key}: missing {', '.join(missing) or 'nothing'}, unknown "
                               f"{', '.join(unknown) or 'nothing'}; fields are {', '.join(LAYOUT_KEYS)}")
        for k, v in consts.items():
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ProfileError(f"layouts.{key}.{k}: must be a number >= 0, got {v!r}")
        for k in ("matmul_scale", "attention_prefill_tflops", "attention_kv_gb_s"):
            if not consts[k] > 0:
                raise ProfileError(f"layouts.{key}.{k}: must be > 0, got {consts[k]!r}")


def _check_rate_table(table: Any) -> None:
    where = "matmul_tflops"
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: must map threads -> dtype -> rows -> TFLOP/s")
    for th, by_dtype in table.items():
        if not isinstance(th, int) or th < 1 or not isinstance(by_dtype, dict) or not by_dtype:
            raise ProfileError(f"{where}: keys must be thread counts >= 1 mapping to dtypes, got {th!r}")
        for dt, by_rows in by_dtype.items():
            if not isinstance(by_rows, dict) or not by_rows:
                raise ProfileError(f"{where}.{th}.{dt}: must map rows -> TFLOP/s")
            for r, v in by_rows.items():
                if not (isinstance(r, int) and r >= 1 and isinstance(v, (int, float)) and v > 0):
                    raise ProfileError(f"{where}.{th}.{dt}: rows must be integers >= 1 and rates > 0, got {r!r}: {v!r}")


def profile_from_dict(data: Any, source: str) -> HardwareProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile must be a YAML mapping")
    known = {f.name for f in fields(HardwareProfile)} - {"extra"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(f"{source}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    missing = [n for n in ("name", "memory_gib", "hbm_bandwidth_gb_s", "flops_tflops",
                           "intra_node_bandwidth_gb_s", "inter_node_bandwidth_gb_s") if n not in data]
    if missing:
        raise ProfileError(f"{source}: missing field(s) {', '.join(missing)}")
    try:
        return HardwareProfile(**data)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def load_profile(name_or_path: str) -> HardwareProfile:
    """A built-in profile by name (case-insensitive) or a YAML file by path."""
    key = name_or_path.strip().lower()
    builtin = PROFILE_DIR / f"{key}.yaml"
    path = builtin if builtin.is_file() else Path(name_or_path)
    if not path.is_file():
        raise ProfileError(f"hardware: unknown profile {name_or_path!r}; use a built-in name "
                           f"({', '.join(builtin_names())}) or the path of a profile YAML")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ProfileError(f"hardware: {path} is not valid YAML ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"hardware: {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ProfileError(f"hardware: {path}: cannot read it ({exc.strerror or exc})") from None
    return profile_from_dict(data, str(path))
