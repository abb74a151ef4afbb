"""Shared pieces of the benchmarks: a GPT-2-124M-shaped checkpoint and in-run ceilings."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

CACHE = Path(os.environ.get("SHARDSERVE_BENCH_CACHE", Path.home() / ".cache" / "shardserve" / "bench"))


def gpt2_124m_dir() -> Path:
    """A random-weight GPT-2-124M-shaped checkpoint (written once, reused)."""
    from engines.core.config import ModelConfig
    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT

    d = CACHE / "gpt2-124m-random"
    if (d / "config.json").is_file():
        return d
    cfg = ModelConfig(model_type="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_embd=768,
                      max_position_embeddings=1024, bos_token_id=50256, eos_token_id=(50256,))
    model = GPT(cfg).init_weights(seed=0)
    save_checkpoint(model, cfg, d)
    return d


CPU_FLAGS = ("avx2", "f16c", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
"""The flags that choose a kernel variant here: printed with every figure (the CPU changes between machines)."""


def cpu_line() -> str:
    """'<model name>, <n> cores, flags: <the CPU_FLAGS it has> (no <the others>)'."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return f"{name}, {os.cpu_count()} cores, flags: {' '.join(f for f in CPU_FLAGS if f in flags) or '-'} " \
           f"(no {' '.join(f for f in CPU_FLAGS if f not in flags) or '-'})"


def read_bandwidth(nbytes: int = 1 << 30, device: str = "cpu", repeats: int = 5, x: torch.Tensor | None = None
                   ) -> float:
    """Bytes/s of a streaming read: an fp32 sum over a buffer larger than the caches, best of N; of `x` (fp32,
    already written, no warm-up) where given, else of a fresh buffer of `nbytes`.

    fp32 is used because its reduction kernel is the fastest reader torch has here (the bf16 sum
    is compute-bound on this CPU and would understate the ceiling)."""
    if x is None:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        x.sum()
    nbytes = x.numel() * x.element_size()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn(), after one untimed warm-up call (CPU work)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemv_stream_bandwidth(shapes: list[tuple[int, int]], dtype: torch.dtype, repeats: int = 10) -> float:
    """Bytes/s of torch.addmv / torch.mv streaming matrices of `shapes` (out, in) once each, in
    order, in a bare loop (best of N): what a decode step's matrix-vector products could reach
    with torch's own kernel if nothing else ran between them."""
    mats = [(torch.randn(o, i).to(dtype), torch.randn(o).to(dtype), torch.randn(i).to(dtype)) for o, i in shapes]
    nbytes = sum(w.numel() * w.element_size() for w, _, _ in mats)

    def once():
        for w, b, x in mats:
            torch.addmv(b, w, x)

    return nbytes / best_seconds(once, repeats)


def matmul_peak(dtype=torch.bfloat16, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul in this process (best of N)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_seconds(lambda: a @ b, repeats)


def median(xs):
    return statistics.median(xs)
