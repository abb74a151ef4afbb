"""How many bytes the paged KV cache may take when the user gave no explicit budget.

Like vLLM's gpu_memory_utilization: the engine as a whole may hold `kv_cache_memory_fraction` of
the device's memory; what the weights (already loaded) and the step's activations need comes off
first, the rest is the KV cache. Measured once, at load, after the weights are in memory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engines.core.config import ConfigError, EngineConfig, ModelConfig, resolved_dtype

log = logging.getLogger(__name__)


def activation_reserve_bytes(model: ModelConfig, engine: EngineConfig) -> int:
    """Peak activations of one step, bytes: the step's tokens through the widest layer (the MLP's
    up projection or the logits of max_num_seqs rows), fp32, with 4x headroom for temporaries."""
    tokens = engine.max_num_batched_tokens
    widest = max(tokens * max(model.ffn_dim, 3 * model.n_embd), engine.max_num_seqs * model.vocab_size)
    return 4 * 4 * widest


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes the cgroup (v2) still lets this process take, if it has a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def host_available_bytes() -> int:
    """Memory the process may still take on the host, bytes (the lower of MemAvailable and the
    cgroup's room)."""
    candidates = [b for b in (_meminfo_available(), _cgroup_room()) if b is not None]
    if not candidates:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(candidates)


def kv_cache_budget(model: ModelConfig, engine: EngineConfig, device: torch.device,
                    free_total: tuple[int, int] | None = None) -> int:
    """Bytes of KV cache for this engine: kv_cache_bytes when set, else the memory fraction.

    `free_total` (free, total bytes of the device) replaces the measurement (tests pass it).
    Raises ConfigError when the fraction leaves no room for a cache at all."""
    if engine.kv_cache_bytes:
        return engine.kv_cache_bytes
    frac = engine.kv_cache_memory_fraction
    if free_total is None:
        if device.type == "cuda":
            # blocks the caching allocator holds but no tensor uses (the bf16 weights FP8 conversion
            # replaced, load-time temporaries) are free memory: return them before measuring
            torch.cuda.empty_cache()
            free_total = torch.cuda.mem_get_info(device)
        else:
            avail = host_available_bytes()
            free_total = (avail, avail)
    free, total = free_total
    # the engine may hold frac * total; what others and the weights already use is (total - free)
    budget = int(frac * total) - (total - free) - activation_reserve_bytes(model, engine)
    if budget <= 0:
        raise ConfigError(
            f"kv_cache_memory_fraction: {frac} of {total / 2**30:.2f} GiB leaves no room for a KV cache "
            f"({free / 2**30:.2f} GiB free); raise the fraction or set kv_cache_bytes or num_kv_blocks")
    log.info("KV cache sized from free memory: %.2f GiB (kv_cache_memory_fraction %.2f, %.2f of %.2f GiB "
             "free on %s)", budget / 2**30, frac, free / 2**30, total / 2**30, device.type)
    return budget


def host_total_bytes() -> int:
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def shard_kv_budget(model: ModelConfig, engine: EngineConfig, device: torch.device) -> int:
    """Per-shard KV budget of a TP x PP engine. Every shard must arrive at the same block count
    without talking to the others, so this uses only stable figures: the device's (or, on CPU, the
    host's, shared by all shards) total memory, less the whole model's weights, split evenly."""
    if engine.kv_cache_bytes:
        return engine.kv_cache_bytes
    itemsize = 4 if resolved_dtype(engine) == "float32" else 2
    weights = model.num_params() * itemsize
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        return kv_cache_budget(model, engine, device, free_total=(total - weights // engine.world_size, total))
    total = host_total_bytes()
    return kv_cache_budget(model, engine, device, free_total=(total - weights, total)) // engine.world_size
