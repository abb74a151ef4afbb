"""Decode attention on CPU: the paged kernel's read rate against a streaming read measured in the same run.

    .venv/bin/python benchmarks/bench_decode_attention.py [--rows 64] [--context 145-290] [--dtypes float32,bfloat16]
        [--tables scattered,sequential,cached] [--heads 9/3/64]

A batched decode step's attention reads every running sequence's keys and values once per layer: at 64 rows of
SmolLM2's shape (3 kv heads of 64, 9 query heads) and ~220 positions that is 28 MB a layer in fp32, and none of it is
in the caches (every Linear's weights stream through them between two layers). So the kernel is bound by memory, and
its ceiling is the host's streaming read. Here `paged_decode` (engines/cpu/csrc/paged_kernel.cpp, the kernel the fused
decode step calls) runs over 30 layers' worth of block tables in a cache of huge pages as the engine allocates it
(blocks scattered as a long-running server leaves them), and each repetition's 30 calls are timed against an fp32 sum
over 1 GiB in the same process, alternating; the figure is the median ratio of achieved bytes/s to that read.

--tables: how the blocks lie. `scattered` (the default): a random permutation of the cache, as a long-running server
leaves it; `sequential`: each sequence's blocks one after another, as a fresh engine hands them out (the offline mix's
decode steps read such tables); `cached`: the first 16 rows' sequential tables for every layer, a working set of a few
MB read again and again, which stays in the last-level cache as far as the host lets it: the kernel's rate with
memory mostly out of the way, its compute ceiling. Each row also gives ns a row's position per thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import cpu_line

LAYOUTS = ("scattered", "sequential", "cached")
"""--tables' choices (layout_tables)."""
CHOICES = f"{', '.join(LAYOUTS[:-1])} or {LAYOUTS[-1]}"
CACHED_ROWS = 16
"""Rows of the `cached` layout: SmolLM2's fp32 keys and values of 16 rows at ~220 positions are ~5.5 MB."""


def layout_tables(layout: str, rows: int, per_seq: int, layers: int, blocks: int, g: torch.Generator) -> list:
    """One block table (rows, per_seq) int64 a layer, its blocks below `blocks`, laid out as --tables names them."""
    if layout == "scattered":
        return [torch.randperm(blocks, generator=g)[: rows * per_seq].view(rows, per_seq).contiguous()
                for _ in range(layers)]
    if layout == "sequential":
        return [(torch.arange(rows * per_seq) + i * rows * per_seq).view(rows, per_seq) for i in range(layers)]
    if layout == "cached":
        n = min(CACHED_ROWS, rows)
        return [torch.arange(n * per_seq).view(n, per_seq)] * layers
    raise ValueError(f"tables: {CHOICES}, got {layout!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="sequences in the decode step")
    ap.add_argument("--context", default="145-290", help="positions per sequence, uniform in LO-HI")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--layers", type=int, default=30, help="distinct block tables (one a layer)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tables", default="scattered", help=f"comma list of: {', '.join(LAYOUTS)} (see above)")
    ap.add_argument("--heads", default="9/3/64", help="query heads / kv heads / head dim (SmolLM2's; GPT-2: 12/12/64)")
    args = ap.parse_args()
    try:
        nh, nkv, hd = (int(v) for v in args.heads.split("/"))
        assert nh >= 1 and nkv >= 1 and nh % nkv == 0 and hd in (32, 64, 128)
    except (ValueError, AssertionError):
        ap.error(f"--heads: NH/NKV/HD with NKV dividing NH and HD 32, 64 or 128, got {args.heads!r}")
    try:
        lo, hi = (int(v) for v in args.context.split("-"))
        assert 1 <= lo <= hi
    except (ValueError, AssertionError):
        ap.error(f"--context: LO-HI with 1 <= LO <= HI, got {args.context!r}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            ap.error(f"--dtypes: each must be float32 or bfloat16, got {d!r}")

    layouts = [t.strip() for t in args.tables.split(",") if t.strip()]
    for t in layouts:
        if t not in LAYOUTS:
            ap.error(f"--tables: each must be {CHOICES}, got {t!r}")
    if not layouts:
        ap.error(f"--tables: name at least one of {', '.join(LAYOUTS)}")

    from engines.cpu import kernels
    from engines.cpu.host_memory import huge_page_zeros

    mod, why = kernels.load()
    if mod is None:
        sys.exit(f"the CPU kernels are unavailable here: {why}")
    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    bs = 16
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (args.rows,), generator=g, dtype=torch.long)
    per_seq = (hi + bs - 1) // bs
    blocks = args.rows * per_seq * args.layers + 16
    stream = torch.ones((1 << 30) // 4)
    stream.sum()
    print(f"{args.rows} rows x {lo}-{hi} positions (mean {lens.float().mean():.0f}), {nh} query / {nkv} kv heads of "
          f"{hd}, block size {bs}, {args.layers} layers' tables over {blocks} blocks; median of {args.repeats}")
    print("| dtype | tables | attention ms a layer | read GB/s | streaming read GB/s | fraction | ns a row's position a thread |")
    print("|---|---|---|---|---|---|---|")
    threads = torch.get_num_threads()
    for name in dtypes:
        dt = getattr(torch, name)
        es = torch.tensor([], dtype=dt).element_size()

        def cache(dt: torch.dtype = dt, es: int = es) -> torch.Tensor:
            raw = huge_page_zeros(blocks * bs * nkv * hd * es)
            t = (raw.view(dt) if raw is not None else torch.empty(blocks * bs * nkv * hd, dtype=dt))
            t = t.view(blocks * bs, nkv, hd)
            t.copy_(torch.randn(blocks * bs, nkv, hd, generator=g))
            return t

        kc, vc = cache(), cache()
        q = torch.randn(args.rows, nh, hd, generator=g).to(dt)
        for layout in layouts:
            tables = layout_tables(layout, args.rows, per_seq, args.layers, blocks, g)
            rows = tables[0].size(0)
            ln, qq = lens[:rows], q[:rows]
            nbytes = int(ln.sum()) * nkv * hd * 2 * es  # keys and values, once
            for t in tables[:3]:
                mod.paged_decode(qq, kc, vc, t, ln, bs)
            attn, read = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for t in tables:
                    mod.paged_decode(qq, kc, vc, t, ln, bs)
                attn.append((time.perf_counter() - t0) / len(tables))
                t0 = time.perf_counter()
                stream.sum()
                read.append(stream.numel() * 4 / (time.perf_counter() - t0))
            a, r = statistics.median(attn), statistics.median(read)
            ratio = statistics.median(nbytes / x / y for x, y in zip(attn, read))
            per_pos = a * threads / int(ln.sum()) * 1e9
            label = f"{layout} ({rows} rows)" if rows != args.rows else layout
            print(f"| {name} | {label} | {a * 1e3:.3f} | {nbytes / a / 1e9:.1f} | {r / 1e9:.1f} | **{ratio:.0%}** | "
                  f"{per_pos:.0f} |", flush=True)
        del kc, vc


if __name__ == "__main__":
    main()
