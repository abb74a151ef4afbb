"""The prefix-caching workloads' prompts, and vLLM's side of them (its own process and venv).

    .vllm-venv/bin/python benchmarks/peer_prefix_vllm.py --model DIR --dtype float32 --kv-bytes N ...

The prompt makers are shared with benchmarks/bench_prefix_cache.py, so both engines get the same
token ids. vLLM runs in-process through its async engine (AsyncLLM, streaming), as ours runs
through AsyncLLMEngine, with its automatic prefix caching on, every burst at t=0; TTFT is from
submission to the first output token. Prints one line `RESULT {json}`. Imports nothing of ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time


def chat_prompts(seed: int, n: int, system: int, question: int, vocab: int) -> list[list[int]]:
    """n prompts: one shared `system`-token prefix (per seed), then each its own `question` tokens."""
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(vocab) for _ in range(system)]
    return [sys_prompt + [rng.randrange(vocab) for _ in range(question)] for _ in range(n)]


def distinct_prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def summarize(ttft: list[float], tokens: list[int], wall: float) -> dict:
    q = statistics.quantiles(ttft, n=10)
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p90_s": q[8], "wall_s": wall,
            "output_tok_s": sum(tokens) / wall, "output_tokens": sum(tokens)}


async def vllm_burst(engine, tag: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    n = len(prompts)
    ttft, tokens = [0.0] * n, [0] * n
    t0 = time.perf_counter()

    async def one(i: int) -> float:
        first = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompts[i]), params, f"{tag}-{i}"):
            if first is None and out.outputs[0].token_ids:
                first = ttft[i] = time.perf_counter() - t0
            if out.finished:
                tokens[i] = len(out.outputs[0].token_ids)
        return time.perf_counter() - t0

    ends = await asyncio.gather(*(one(i) for i in range(n)))
    return summarize(ttft, tokens, max(ends))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--repeat", type=int, default=0, help="which repeat's prompts (seeds) to run")
    ap.add_argument("--workloads", default="chat,distinct", help="comma list of chat, distinct")
    args = ap.parse_args()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes, max_model_len=2048, seed=0,
        enable_prefix_caching=True, max_num_seqs=max(64, args.n)))
    out: dict = {}

    async def go():
        await vllm_burst(engine, "warm", distinct_prompts(999, 4, 64, args.vocab), 8)
        make = {"chat": lambda r: chat_prompts(r, args.n, 1000, 40, args.vocab),
                "distinct": lambda r: distinct_prompts(1000 + r, args.n, 512, args.vocab)}
        for name in args.workloads.split(","):
            out[name] = await vllm_burst(engine, f"{name}-{args.repeat}", make[name](args.repeat), 64)

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
