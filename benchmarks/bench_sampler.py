"""Sampling cost per decode step: the engine's sampler against torch.multinomial.

    .venv/bin/python benchmarks/bench_sampler.py [--rows 64] [--threads 1]

64 rows of random logits at temperature 1 (the OpenAI API's default), the vocabularies of the
default model (8,192) and of GPT-2 (50,257). Ours: `Sampler.sample` (penalties off, inverse
transform, one float64 cumsum per row). Reference: softmax + `torch.multinomial(probs, 1)`,
what a plain torch sampler does. Best of 7 each, interleaved.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import best_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engines import SamplingParams
    from engines.core.plan import SeqInit
    from engines.runner.sampler import Sampler

    print(f"sampling {args.rows} rows at temperature 1, {args.threads} thread(s)")
    for vocab in (8192, 50257):
        logits = torch.randn(args.rows, vocab)
        sampler = Sampler(vocab, seed=0, device=torch.device("cpu"))
        for i in range(args.rows):
            sampler.add(SeqInit(i, 0, SamplingParams(temperature=1.0), [0], ()))
        ids = list(range(args.rows))
        gen = torch.Generator().manual_seed(0)
        def run_ours(sampler=sampler, ids=ids, logits=logits):
            sampler.sample(ids, logits)

        def run_ref(logits=logits, gen=gen):
            torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).tolist()

        ours = ref = float("inf")
        for _ in range(3):
            ours, ref = min(ours, 1000 * best_seconds(run_ours, 7)), min(ref, 1000 * best_seconds(run_ref, 7))
        print(f"  vocab {vocab:6d}: ours {ours:6.2f} ms | torch.multinomial {ref:6.2f} ms | {ref / ours:5.1f}x faster")


if __name__ == "__main__":
    main()
