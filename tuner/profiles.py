"""Hardware profiles: datasheet constants plus fitted efficiency factors, read from YAML.

Profiles are data. Built-in ones live in tuner/profiles/<name>.yaml; a user passes a built-in
name or the path of a YAML file of the same shape.
"""

from __future__ import annotations

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
        for name in ("bw_efficiency", "flops_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ProfileError(f"{name}: must be in (0, 1], got {v!r}")
        for name in ("layer_overhead_us", "step_overhead_ms", "collective_latency_us", "reserved_memory_gib"):
            if getattr(self, name) < 0:
                raise ProfileError(f"{name}: must be >= 0, got {getattr(self, name)!r}")

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
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"hardware: {path} is not valid YAML ({exc})") from None
    return profile_from_dict(data, str(path))
