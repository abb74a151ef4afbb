"""B2: serving throughput with continuous batching against transformers' padded static batches.

    .venv/bin/python benchmarks/bench_throughput.py [--requests 64] [--dtype float32]

64 requests with prompt and output lengths drawn uniformly from 16-256 tokens (seed 0), all
queued at t=0, greedy. Ours: the engine runs them all with continuous batching. Reference:
transformers `generate` on the same requests in padded static batches of 16 (left padding, each
batch runs to its longest output; only each request's own output tokens count). Output tokens/s
of both, measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gpt2_124m_dir

TARGET = 3.0


def workload(n: int, seed: int = 0, lo: int = 16, hi: int = 256) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 50000) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
            for _ in range(n)]


def run_hf(hf, reqs, batch: int, device: str) -> float:
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        longest = max(o for _, o in chunk)
        with torch.inference_mode():
            hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from engines import LLM, SamplingParams

    d = gpt2_124m_dir()
    reqs = workload(args.requests)
    useful = sum(o for _, o in reqs)
    print(f"B2 throughput: {len(reqs)} requests, prompt/output 16-256 tokens, {useful} output tokens, "
          f"dtype={args.dtype}, device={args.device}, threads={args.threads}")

    llm = LLM(d, dtype=args.dtype, device=args.device, max_num_seqs=64, max_num_batched_tokens=2048,
              kv_cache_bytes=2 * 2**30)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    ours_s = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == useful
    ours_tps = useful / ours_s
    print(f"  ours (continuous batching): {ours_s:6.1f} s, {ours_tps:7.1f} output tok/s, "
          f"preemptions {llm.engine.scheduler.num_preemptions}")
    del llm

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    run_hf(hf, reqs[:2], 2, args.device)  # warm-up
    hf_s = run_hf(hf, reqs, args.hf_batch, args.device)
    hf_tps = useful / hf_s
    print(f"  transformers static batches of {args.hf_batch}: {hf_s:6.1f} s, {hf_tps:7.1f} output tok/s")
    ratio = ours_tps / hf_tps
    print(f"  ratio {ratio:.2f}x (target >= {TARGET}x) [{'MET' if ratio >= TARGET else 'MISSED'}]")


if __name__ == "__main__":
    main()
