"""Automatic prefix caching: the same bursts with caching on and off, in one run, on one machine.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_prefix_cache.py [--quick] [--repeats N]

Model: the GPT-2-124M shape with random weights and 2,048 positions, prompts as token ids, the
engine's default dtype (auto) and options; the async engine in-process (the ModelServer's path
without HTTP). Both configurations get the same explicit KV budget, large enough for the whole
uncached burst, so only the work differs, not the concurrency.

(a) chat: 64 requests at t=0 sharing a 1,000-token system prompt, each with its own 40-token
    question, 64 output tokens (ignore_eos). Targets (issue 37): TTFT p50 >= 4x better and
    output tok/s >= 2x with caching on than off.
(b) no shared prefix: 64 requests at t=0 with distinct 512-token prompts, 64 output tokens.
    Target: caching on within 3 % of off (the hashing and bookkeeping cost nothing that shows).
Each repeat uses a fresh system prompt (no request of a repeat finds the previous repeat's
blocks); the configurations alternate (off, on, off, on, ...) so that a noisy neighbour hits
both alike; the best repeat of each is reported. Prints a markdown table with the ratios; the raw
figures go to runs/bench_prefix_cache.json.

--lockstep runs workload (b) differently: both configurations as two engines in one process, fed
the same requests and stepped alternately (one step of each, which goes first swapped every step),
so a load that drifts hits both alike; each repeat is one more burst on the same two engines (from
the second on, the caching engine's free blocks are mostly cached ones: a server whose cache has
filled, still with no hit). It reports, per burst, each engine's output tok/s over its own step
time and the median of the per-step on/off time ratios (the two engines take the same steps), and
the on/off ratio of the CPU time the stepping thread used: with --threads 1 that is the whole step's
work, and it does not count the time the thread waited for a core (on a loaded host, most of it).

--model smollm2 runs the real default model (models/smollm2, `shardserve fetch-default`), whose
2,048+ positions fit the chat prompts as they are. --vllm also runs workload (a) on vLLM's CPU
build (.vllm-venv, made by bench_peer_vllm.py) with its prefix caching on, `VLLM_CPU_OMP_THREADS_BIND`
over every core, the same dtype, KV bytes and token ids (benchmarks/peer_prefix_vllm.py), one burst in
each repeat after ours (the best of as many bursts on both sides), and prints ours/vLLM output tok/s
and both TTFT p90 (issue 37: >= 1.2x, TTFT p90 <= vLLM's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import CACHE
from benchmarks.peer_prefix_vllm import chat_prompts as _chat_prompts
from benchmarks.peer_prefix_vllm import distinct_prompts as _distinct_prompts
from engines import EngineConfig, SamplingParams
from engines.core.async_engine import AsyncLLMEngine
from engines.core.config import ModelConfig, kv_bytes_per_block

VOCAB = 50000  # ids below GPT-2's EOS (50256)


def gpt2_124m_2k_dir() -> Path:
    """GPT-2-124M shape, random weights, with 2,048 positions (1,040-token prompts + 64 outputs do
    not fit GPT-2's 1,024); written once, reused."""
    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT

    d = CACHE / "gpt2-124m-2k-random"
    if (d / "config.json").is_file():
        return d
    cfg = ModelConfig(model_type="gpt2", vocab_size=50257, n_layer=12, n_head=12, n_embd=768,
                      max_position_embeddings=2048, bos_token_id=50256, eos_token_id=(50256,))
    save_checkpoint(GPT(cfg).init_weights(seed=0), cfg, d)
    return d


def chat_prompts(seed: int, n: int, system: int, question: int, vocab: int = VOCAB) -> list[list[int]]:
    return _chat_prompts(seed, n, system, question, vocab)


def distinct_prompts(seed: int, n: int, length: int, vocab: int = VOCAB) -> list[list[int]]:
    return _distinct_prompts(seed, n, length, vocab)


def run_vllm(model_dir: Path, dtype: str, kv_bytes: int, n: int, vocab: int, repeat: int) -> dict:
    """Workload (a) on vLLM's CPU build with its prefix caching on (its own venv and process), every core."""
    py = ROOT / ".vllm-venv" / "bin" / "python"
    if not py.exists():
        return {"error": f"{py} missing: `make bench-peer` (benchmarks/bench_peer_vllm.py) installs vLLM there"}
    cores = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}"
    cmd = [str(py), str(ROOT / "benchmarks" / "peer_prefix_vllm.py"), "--model", str(model_dir), "--dtype", dtype,
           "--kv-bytes", str(kv_bytes), "--n", str(n), "--vocab", str(vocab), "--repeat", str(repeat),
           "--workloads", "chat"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 3600 s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return {"error": f"rc {r.returncode}: {r.stderr[-1500:]}"}
    return json.loads(lines[-1][len("RESULT "):])


async def burst(engine: AsyncLLMEngine, tag: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt at once; TTFT from submission to the first output token, tok/s over the burst."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    n = len(prompts)
    ttft: list[float] = [0.0] * n
    tokens: list[int] = [0] * n
    before = engine.stats()
    t0 = time.perf_counter()

    async def one(i: int) -> float:
        first = None
        async for out in engine.generate(f"{tag}-{i}", prompts[i], params):
            if first is None and out.outputs[0].token_ids:
                first = ttft[i] = time.perf_counter() - t0
            if out.finished:
                tokens[i] = len(out.outputs[0].token_ids)
        return time.perf_counter() - t0

    ends = await asyncio.gather(*(one(i) for i in range(n)))
    wall = max(ends)
    after = engine.stats()
    q = statistics.quantiles(ttft, n=10)
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return {"ttft_p50_s": statistics.median(ttft), "ttft_p90_s": q[8], "wall_s": wall,
            "output_tok_s": sum(tokens) / wall, "output_tokens": sum(tokens),
            "hit_rate": hits / queries if queries else 0.0, "preemptions": after["num_preemptions"]
            - before["num_preemptions"]}


def run_config(model_dir: Path, cfg: EngineConfig, workloads: dict, repeat: int, results: dict,
               vocab: int = VOCAB) -> str:
    """One engine, every workload once (prompts of this repeat); returns the resolved dtype."""
    caching = cfg.enable_prefix_caching
    engine = AsyncLLMEngine.from_model_dir(model_dir, cfg)
    try:
        async def go():
            await burst(engine, "warm", distinct_prompts(999, 4, 64, vocab), 8)  # load-time work out of the way
            for name, (make, max_tokens) in workloads.items():
                res = await burst(engine, f"{name}-{repeat}", make(repeat), max_tokens)
                results.setdefault(name, {}).setdefault(caching, []).append(res)
                print(f"  {name} caching={'on' if caching else 'off'} repeat {repeat}: "
                      + ", ".join(f"{k}={v:.3f}" for k, v in res.items()), flush=True)
        asyncio.run(go())
        return engine.engine.config.dtype
    finally:
        engine.shutdown()


def lockstep(model_dir: Path, cfg: EngineConfig, prompts_of, max_tokens: int, bursts: int, vocab: int) -> list[dict]:
    """Workload (b) on a caching-off and a caching-on engine stepped alternately in one process (--lockstep)."""
    from engines.core.llm_engine import LLMEngine

    engines = {c: LLMEngine(model_dir, cfg.replace(enable_prefix_caching=c)) for c in (False, True)}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out, k = [], 0
    for b in range(-1, bursts):  # burst -1: the warm-up (load-time work out of the way)
        prompts = distinct_prompts(999, 4, 64, vocab) if b < 0 else prompts_of(b)
        for c, e in engines.items():
            for i, p in enumerate(prompts):
                e.add_request(f"d{b}-{i}", p, params if b >= 0 else params.replace(max_tokens=8))
        steps: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, float] = {False: 0.0, True: 0.0}  # this thread's CPU seconds: all of a step at --threads 1
        load0 = os.getloadavg()[0]
        while any(e.has_unfinished_requests() for e in engines.values()):
            for c in ((False, True) if k % 2 == 0 else (True, False)):
                if engines[c].has_unfinished_requests():
                    t, tc = time.perf_counter(), time.thread_time()
                    engines[c].step()
                    steps[c].append(time.perf_counter() - t)
                    cpu[c] += time.thread_time() - tc
            k += 1
        if b < 0:
            continue
        tokens = len(prompts) * max_tokens
        pair = [on / off for off, on in zip(steps[False], steps[True])]
        q = statistics.quantiles(pair, n=4)
        res = {"burst": b, "steps_off": len(steps[False]), "steps_on": len(steps[True]),
               "off_tok_s": tokens / sum(steps[False]), "on_tok_s": tokens / sum(steps[True]),
               "step_ratio_median": statistics.median(pair), "step_ratio_q1": q[0], "step_ratio_q3": q[2],
               "cpu_on_off": cpu[True] / cpu[False], "load": (load0, os.getloadavg()[0]),
               "hit_tokens": engines[True].scheduler.blocks.hit_tokens}
        res["on_off"] = res["on_tok_s"] / res["off_tok_s"]
        print("  lockstep " + ", ".join(f"{k_}={v}" if not isinstance(v, float) else f"{k_}={v:.3f}"
                                        for k_, v in res.items()), flush=True)
        out.append(res)
    for e in engines.values():
        e.shutdown()
    return out


def best(runs: list[dict]) -> dict:
    return {"ttft_p50_s": min(r["ttft_p50_s"] for r in runs), "ttft_p90_s": min(r["ttft_p90_s"] for r in runs),
            "output_tok_s": max(r["output_tok_s"] for r in runs), "hit_rate": runs[-1].get("hit_rate", math.nan)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 requests per burst (a smoke run, not the targets)")
    ap.add_argument("--repeats", type=int, default=1, help="bursts per workload and configuration")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default="gpt2", help="gpt2 (the GPT-2-124M shape, 2,048 positions), smollm2, or a dir")
    ap.add_argument("--workloads", default="chat,distinct", help="comma list of chat (a), distinct (b)")
    ap.add_argument("--vllm", action="store_true", help="also run workload (a) on vLLM with its prefix caching on")
    ap.add_argument("--lockstep", action="store_true",
                    help="workload (b) only, off and on stepped alternately in one process, a burst per repeat")
    ap.add_argument("--threads", type=int, default=0, help="EngineConfig.worker_threads (0: the engine's adaptive choice)")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens of workload (b)")
    args = ap.parse_args()
    n = 16 if args.quick else 64
    model_dir = {"gpt2": gpt2_124m_2k_dir, "smollm2": lambda: ROOT / "models" / "smollm2"}.get(
        args.model, lambda: Path(args.model))()
    if not (model_dir / "config.json").is_file():
        ap.error(f"--model: {model_dir} has no config.json (smollm2: run `shardserve fetch-default` first)")
    model = ModelConfig.from_dir(model_dir)
    vocab = min(VOCAB, model.vocab_size)
    workloads = {
        "chat": (lambda r: chat_prompts(r, n, 1000, 40, vocab), 64),
        "distinct": (lambda r: distinct_prompts(1000 + r, n, 512, vocab), args.max_tokens),
    }
    chosen = args.workloads.split(",")
    if not chosen or any(w not in workloads for w in chosen):
        ap.error(f"--workloads: a comma list of chat, distinct; got {args.workloads!r}")
    workloads = {w: workloads[w] for w in chosen}
    # KV for every uncached token of the larger burst, so both configurations run all at once
    base = EngineConfig(dtype=args.dtype, max_num_seqs=64, worker_threads=args.threads)
    per_block = kv_bytes_per_block(model, base)
    blocks = n * -(-(1040 + 64) // base.block_size) + 64
    if args.lockstep:
        host = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores"
        runs = lockstep(model_dir, base.replace(kv_cache_bytes=blocks * per_block), workloads["distinct"][0],
                        args.max_tokens, args.repeats, vocab)
        print(f"\n{model_dir.name}, {host}, threads {args.threads or 'adaptive'}; {n} distinct 512-token prompts, "
              f"{args.max_tokens} out, lockstep\n\n| burst | off tok/s | on tok/s | on/off | per-step on/off median (IQR) "
              "| CPU time on/off | load (1 min) |\n|---|---|---|---|---|---|---|")
        for r in runs:
            print(f"| {r['burst']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f} | {r['on_off']:.3f}x | "
                  f"{r['step_ratio_median']:.3f} ({r['step_ratio_q1']:.3f}-{r['step_ratio_q3']:.3f}) | "
                  f"{r['cpu_on_off']:.3f}x | "
                  f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |")
        (ROOT / "runs").mkdir(exist_ok=True)
        (ROOT / "runs" / "bench_prefix_lockstep.json").write_text(json.dumps(runs, indent=1))
        return
    results: dict = {}
    dtype = base.dtype
    vllm_runs: list[dict] = []
    for r in range(args.repeats):
        for caching in (False, True):
            cfg = base.replace(kv_cache_bytes=blocks * per_block, enable_prefix_caching=caching)
            dtype = run_config(model_dir, cfg, workloads, r, results, vocab)
        if args.vllm and "chat" in workloads:  # vLLM takes its turn in every repeat: best of as many bursts as ours
            vllm_runs.append(run_vllm(model_dir, dtype, blocks * per_block, n, vocab, r))
            v = vllm_runs[-1]
            print(f"  chat vLLM repeat {r}: " + (v["error"] if "error" in v else
                  ", ".join(f"{k}={x:.3f}" for k, x in v["chat"].items())), flush=True)
    rows = []
    chat_on = dist_on = {"hit_rate": float("nan")}
    if "chat" in results:
        chat_off, chat_on = best(results["chat"][False]), best(results["chat"][True])
        rows += [
            (f"(a) {n} chats, shared 1,000-token system prompt + 40-token question, 64 out: TTFT p50",
             f"{chat_off['ttft_p50_s'] * 1e3:.0f} ms", f"{chat_on['ttft_p50_s'] * 1e3:.0f} ms",
             chat_off["ttft_p50_s"] / chat_on["ttft_p50_s"], ">= 4x"),
            ("(a) same: output tok/s", f"{chat_off['output_tok_s']:.1f}", f"{chat_on['output_tok_s']:.1f}",
             chat_on["output_tok_s"] / chat_off["output_tok_s"], ">= 2x"),
        ]
    if "distinct" in results:
        dist_off, dist_on = best(results["distinct"][False]), best(results["distinct"][True])
        rows += [
            (f"(b) {n} distinct 512-token prompts, 64 out: output tok/s", f"{dist_off['output_tok_s']:.1f}",
             f"{dist_on['output_tok_s']:.1f}", dist_on["output_tok_s"] / dist_off["output_tok_s"], ">= 0.97x"),
            ("(b) same: TTFT p50", f"{dist_off['ttft_p50_s'] * 1e3:.0f} ms", f"{dist_on['ttft_p50_s'] * 1e3:.0f} ms",
             dist_off["ttft_p50_s"] / dist_on["ttft_p50_s"], "(off/on)"),
        ]
    vllm: dict = {}
    if vllm_runs and "chat" in results:
        done = [x["chat"] for x in vllm_runs if "error" not in x]
        vllm = {"chat": best(done), "runs": done} if done else vllm_runs[-1]
        if "error" in vllm:
            print(f"vLLM not run: {vllm['error']}")
        else:
            v = vllm["chat"]
            rows += [
                ("(a) against vLLM (its prefix caching on, every core): output tok/s",
                 f"vLLM {v['output_tok_s']:.1f}", f"ours {chat_on['output_tok_s']:.1f}",
                 chat_on["output_tok_s"] / v["output_tok_s"], ">= 1.2x (ours/vLLM)"),
                ("(a) against vLLM: TTFT p90", f"vLLM {v['ttft_p90_s'] * 1e3:.0f} ms",
                 f"ours {chat_on['ttft_p90_s'] * 1e3:.0f} ms", v["ttft_p90_s"] / chat_on["ttft_p90_s"],
                 "ours <= vLLM's (vLLM/ours >= 1x)"),
                ("(a) against vLLM: TTFT p50", f"vLLM {v['ttft_p50_s'] * 1e3:.0f} ms",
                 f"ours {chat_on['ttft_p50_s'] * 1e3:.0f} ms", v["ttft_p50_s"] / chat_on["ttft_p50_s"], "(vLLM/ours)"),
            ]
    from engines.core.hardware import cpu_name, read_cpu_flags

    isa = sorted((read_cpu_flags() or frozenset()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    host = (f"{cpu_name()} ({platform.machine()}, {'+'.join(isa) or 'no AVX2'}), {len(os.sched_getaffinity(0))} cores, "
            f"load {os.getloadavg()[0]:.1f}")
    title = "GPT-2-124M shape, random weights" if args.model == "gpt2" else f"{model_dir.name} ({model.model_type})"
    print(f"\n{title}, dtype {dtype}, {host}; {n} requests per burst, all at t=0; "
          f"best of {args.repeats} alternating repeat(s); prefix-cache hit rate (a) {chat_on['hit_rate']:.1%}, "
          f"(b) {dist_on['hit_rate']:.1%}\n")
    print("| workload | caching off | caching on | on vs off | target |\n|---|---|---|---|---|")
    for name, off, on, ratio, target in rows:
        print(f"| {name} | {off} | {on} | {ratio:.2f}x | {target} |")
    out = ROOT / "runs"
    out.mkdir(exist_ok=True)
    (out / "bench_prefix_cache.json").write_text(json.dumps(
        {"model": str(model_dir), "dtype": dtype, "requests": n, "vllm": vllm, "results": {k: {str(c): v for c, v in d.items()} for k, d in results.items()}},
        indent=1))


if __name__ == "__main__":
    main()
