"""Engine threads A/B: batch-1 decode and an offline mix at worker_threads 1 and 2, interleaved
(BENCHMARKS.md, peer section). GPT-2-124M shape, random weights, fp32.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_threads.py
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import gpt2_124m_dir

from engines import LLM, SamplingParams
from engines.hardware import detect


def main() -> None:
    hw = detect()
    print(f"CPU: {hw.name} ({hw.feature}), torch {torch.__version__}", flush=True)
    d = gpt2_124m_dir()
    rng = random.Random(0)
    mix = [([rng.randrange(1, 50000) for _ in range(rng.randint(16, 256))], rng.randint(16, 128)) for _ in range(24)]
    prompt, one = [[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    for rnd in range(2):
        for threads in (1, 2):
            llm = LLM(d, dtype="float32", worker_threads=threads, num_kv_blocks=2048)
            llm.generate(prompt, one)  # warm-up
            t = time.perf_counter()
            llm.generate(prompt, one)
            b1 = 96 / (time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate([p for p, _ in mix], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in mix])
            mx = sum(m for _, m in mix) / (time.perf_counter() - t)
            print(f"round {rnd} threads {threads}: batch-1 {b1:.1f} tok/s, mix(24) {mx:.1f} tok/s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            del llm


if __name__ == "__main__":
    main()
