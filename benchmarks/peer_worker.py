"""One engine's side of the peer benchmark, run in that engine's own process and venv.

    <python> benchmarks/peer_worker.py --engine ours|vllm --tasks b1,mix,prefill --dtype float32 --model DIR ...

Loads the engine once, warms it, then runs each task `--repeats` times and prints one line
`RESULT {json}` with the output tok/s of every repetition (prefill: the mix's prompts with one output
token each, prompt tok/s: the engines' prefill alone, which the HTTP mix's first tokens wait for).
Each repetition starts with an empty prefix cache (both engines' reset_prefix_cache; both cache
prefixes by default): the same prompts again would otherwise skip most of their prefill from the second
repetition on, and the three would not be the same workload. Imports nothing of ours at module level:
vLLM's process must not see our packages (benchmarks/common.py is loaded by path where needed), and
ours must not import torch before the engine (it sets libgomp's spin count before torch loads it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def b1_request(vocab: int) -> list[tuple[list[int], int]]:
    """Batch 1: an 8-token prompt, 96 greedy new tokens (ids below the vocab and below 50,001,
    so the GPT-2 shape keeps the prompt of earlier runs)."""
    m = min(50000, vocab - 2)
    return [([(7 * i + 3) % m + 1 for i in range(8)], 96)]


def mix_requests(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: lengths uniform in 16-256, ids uniform in the vocab."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = rng.randint(16, 256), rng.randint(16, 256)
        out.append(([rng.randrange(1, min(vocab, 50257)) for _ in range(p)], o))
    return out


def prefill_requests(n: int, vocab: int) -> list[tuple[list[int], int]]:
    """The mix's prompts (mix_requests), one output token each: a run is the prefill of all of them."""
    return [(ids, 1) for ids, _ in mix_requests(n, vocab)]


def adjacent_ceiling(threads: int) -> float:
    """The streaming-read ceiling (bytes/s) measured in this process on `threads` threads, right
    beside a timed batch-1 run: this host's ceiling moves from minute to minute (other tenants)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("_bench_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return common.read_bandwidth()
    finally:
        torch.set_num_threads(before)


def progress(line: str) -> None:
    """One repetition's figure as soon as it is known (runs/peer-progress.log): a run cut short by
    a time limit still leaves what it measured."""
    (ROOT / "runs").mkdir(exist_ok=True)
    with open(ROOT / "runs" / "peer-progress.log", "a") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def huge_pages() -> str:
    """This process's anonymous memory on 2 MB pages (the streamed weights are put there where the host allows:
    engines/cpu/host_memory.py; a process that got fewer reads them slower)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return "unknown"
    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in text.splitlines()[1:] if ":" in line)}
    return f"{kb.get('AnonHugePages', 0) >> 10} of {kb.get('Anonymous', 0) >> 10} MB"


def load_engine(args):
    """(generate(list of (ids, max_tokens)) -> output token count, extra facts about the load)."""
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes, max_model_len=1024,
                  seed=0)

        def gen(reqs):
            llm.reset_prefix_cache()
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs],
                                [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs],
                                use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        return gen, {"bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "default (auto)")}
    from engines import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_bytes=args.kv_bytes, compile_decode=args.compile_decode)
    facts = {"load_s": time.perf_counter() - t0, "compile_s": llm.engine.executor.runner.compile_s}

    def gen(reqs):
        llm.reset_prefix_cache()
        outs = llm.generate([ids for ids, _ in reqs],
                            [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs])
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def after() -> dict:
        from engines.cpu import fast_linear

        adaptive = llm.engine.executor.adaptive  # the thread count each kind of step settled on
        return {"kernels": {f"{o}x{i}@{t}t": "/".join(k) for (o, i, _, t), k in fast_linear._CHOSEN.items()},
                "threads": adaptive.summary() if adaptive is not None else llm.engine.executor.threads,
                "huge_pages": huge_pages()}

    facts["after"] = after
    return gen, facts


def worker(args) -> dict:
    threads = len(os.sched_getaffinity(0))  # every core this process may use, as both engines do
    gen, facts = load_engine(args)
    gen([(b1_request(args.vocab)[0][0], 4)])  # warm-up: first-call work out of the timed runs
    result: dict = {"runs": {}, "bw": {}}
    for task in args.tasks.split(","):
        make = {"b1": lambda: b1_request(args.vocab), "mix": lambda: mix_requests(args.num_requests, args.vocab),
                "prefill": lambda: prefill_requests(args.num_requests, args.vocab)}
        reqs = make[task]()
        if task != "b1":
            gen(reqs[:4])  # warm the batched shapes once
        rates = []
        bws = []
        for _ in range(args.repeats):
            if task == "b1":
                bws.append(adjacent_ceiling(threads))
            t = time.perf_counter()
            tokens = sum(gen(reqs) for _ in range(args.b1_gens if task == "b1" else 1))
            if task == "prefill":  # the rate of prompt tokens
                tokens = sum(len(ids) for ids, _ in reqs)
            rates.append(tokens / (time.perf_counter() - t))
            progress(f"{args.engine} {args.dtype} {task} rep {len(rates)}: {rates[-1]:.1f} tok/s "
                     f"(bind {os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '-')}, load {os.getloadavg()[0]:.1f})")
        if task == "b1":
            bws.append(adjacent_ceiling(threads))
            result["bw"][task] = bws
        result["runs"][task] = rates
    after = facts.pop("after", None)
    if after is not None:
        facts.update(after())
    result.update(facts)
    result["threads_available"] = threads
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["ours", "vllm"], required=True)
    ap.add_argument("--tasks", default="b1,mix", help="comma list of b1, mix, prefill")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile-decode", default="auto")
    ap.add_argument("--b1-gens", type=int, required=True, help="batch-1 generations a repetition, back to back (its "
                    "rate is their tokens over their time; bench_peer_vllm's B1_GENS)")
    args = ap.parse_args()
    if args.b1_gens < 1:
        ap.error(f"--b1-gens: at least 1, got {args.b1_gens}")
    for t in args.tasks.split(","):
        if t not in ("b1", "mix", "prefill"):
            ap.error(f"--tasks: each must be b1, mix or prefill, got {t!r}")
    print("RESULT " + json.dumps(worker(args)), flush=True)


if __name__ == "__main__":
    main()
