"""One layer of decode attention over the paged KV cache: the C++ kernel (engines/paged_kernel.py)
against the per-sequence loop, on 1 and 2 threads, fp32 and bf16, 1/16/64 sequences.

    python benchmarks/bench_paged_kernel.py

Prints the CPU model, each case's time, the kernel's read rate and the loop / kernel speedup, and
the largest difference between the two outputs (they must agree to rounding)."""
import random
import time

import torch

from engines.attention import KVCache, PagedAttention
from engines.hardware import cpu_name
from engines.paged_kernel import load
from engines.plan import SeqWork

BLOCK, HEADS, HEAD_DIM = 16, 12, 64  # GPT-2-124M's attention


def case(n_seqs: int, dtype: torch.dtype, threads: int) -> None:
    lens = [random.randint(32, 512) for _ in range(n_seqs)]       # context keys per sequence
    n_blocks = sum(-(-n // BLOCK) + 8 for n in lens) + 1          # gaps of 8 blocks: tables out of order
    cache = KVCache(1, n_blocks, BLOCK, HEADS, HEAD_DIM, dtype)
    cache.data.normal_()
    work, b = [], 0
    for i, n in enumerate(lens):
        nb = -(-n // BLOCK)
        work.append(SeqWork(seq_id=i, token_ids=[1], start_pos=n - 1, sample=True, block_ids=list(range(b, b + nb))))
        b += nb + 8
    q, k, v = (torch.randn(n_seqs, HEADS, HEAD_DIM).to(dtype) for _ in range(3))
    torch.set_num_threads(threads)
    res = {}
    for kernel in (False, True):
        pa = PagedAttention(cache, work, [], torch.device("cpu"), decode_kernel=kernel)
        for _ in range(3):
            out = pa(0, q, k, v)
        reps = 20
        t = time.perf_counter()
        for _ in range(reps):
            pa(0, q, k, v)
        res[kernel] = ((time.perf_counter() - t) / reps * 1e3, out)
    err = (res[True][1].float() - res[False][1].float()).abs().max().item()
    kv_mb = sum(lens) * HEADS * HEAD_DIM * 2 * cache.data.element_size() / 1e6
    loop_ms, kern_ms = res[False][0], res[True][0]
    print(f"seqs={n_seqs:3d} {dtype!s:15s} threads={threads}  loop {loop_ms:6.2f} ms  kernel {kern_ms:6.2f} ms "
          f"({kv_mb / kern_ms:5.1f} GB/s)  loop/kernel {loop_ms / kern_ms:4.2f}x  max diff {err:.1e}", flush=True)


def main() -> None:
    print(f"CPU: {cpu_name()}, torch {torch.__version__}")
    t = time.perf_counter()
    mod, why = load()
    print(f"{why} (load {time.perf_counter() - t:.1f} s)")
    if mod is None:
        raise SystemExit(1)
    random.seed(0)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for n_seqs in (1, 16, 64):
            for threads in (1, 2):
                case(n_seqs, dtype, threads)


if __name__ == "__main__":
    main()
