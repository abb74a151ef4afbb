"""B3: how many sequences the paged KV cache holds at once, against one max-length slot each.

    .venv/bin/python benchmarks/bench_kv_memory.py [--requests 64] [--slots 8]

The same mix as B2 (prompt and output lengths uniform in 16-256). A static cache that gives every
sequence one slot of the longest possible length (256 + 256 = 512 tokens) holds `--slots`
sequences in B bytes. The paged engine runs the mix with exactly B bytes of KV cache (block
size 16) and we record how many sequences are running at each step. The model is a small
GPT-2-shaped one: the ratio depends on the lengths, not on the model's width (bytes per token
cancel out), and a small model keeps the run short.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_throughput import workload

TARGET = 2.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    import torch

    from engines import EngineConfig, SamplingParams
    from engines.core.config import ModelConfig, kv_bytes_per_block
    from engines.core.llm_engine import LLMEngine
    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT

    torch.set_num_threads(2)
    cfg = ModelConfig(model_type="gpt2", vocab_size=50257, n_layer=2, n_head=4, n_embd=128,
                      max_position_embeddings=1024)
    tmp = Path(tempfile.mkdtemp())
    save_checkpoint(GPT(cfg).init_weights(seed=0), cfg, tmp / "m")
    max_len = 512
    ecfg = EngineConfig(block_size=args.block_size, max_num_seqs=args.requests, max_num_batched_tokens=4096)
    bytes_per_token = kv_bytes_per_block(cfg, ecfg) // args.block_size
    budget = args.slots * max_len * bytes_per_token
    blocks = budget // kv_bytes_per_block(cfg, ecfg)
    engine = LLMEngine(tmp / "m", ecfg.replace(num_kv_blocks=blocks))
    for i, (prompt, out) in enumerate(workload(args.requests)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
    running, busy = [], []
    while engine.has_unfinished_requests():
        engine.step()
        running.append(len(engine.scheduler.running))
        if engine.scheduler.waiting:  # requests queue: memory, not demand, limits concurrency
            busy.append(running[-1])
    print(f"B3 KV memory: {budget / 2**20:.1f} MiB of KV = {args.slots} static slots of {max_len} tokens "
          f"= {blocks} paged blocks of {args.block_size}")
    print(f"  paged: peak {max(running)} concurrent sequences, median {statistics.median(busy):.0f} while "
          f"requests were queued, preemptions {engine.scheduler.num_preemptions}")
    ratio = statistics.median(busy) / args.slots
    print(f"  static slots: {args.slots}; ratio (median while queued) {ratio:.2f}x, peak "
          f"{max(running) / args.slots:.2f}x (target >= {TARGET}x) [{'MET' if ratio >= TARGET else 'MISSED'}]")
    ctx_slots = budget / (cfg.max_position_embeddings * bytes_per_token)
    print(f"  against slots of the model's whole context ({cfg.max_position_embeddings} tokens, {ctx_slots:.0f} "
          f"fit): median {statistics.median(busy) / ctx_slots:.2f}x, peak {max(running) / ctx_slots:.2f}x")


if __name__ == "__main__":
    main()
