"""Serving overhead: concurrent streaming requests through gateway + Ray Serve vs the same requests
through the AsyncLLMEngine in this process, in the same run (rounds alternate, so both see the
same machine load).

Targets (issue 4): serving keeps >= 85% of the in-process output tokens/s and adds <= 20 ms to the
median time to first token. Two shapes of "64 concurrent streaming requests": a burst (all 64 sent
at once, so TTFT includes admitting all of them) and sustained load (256 requests, 64 in flight,
closed loop, as `--max-concurrency` in vLLM's benchmark_serving).

    .venv/bin/python benchmarks/bench_serving.py [--model DIR] [--concurrency 64] [--max-tokens 128]

Without --model it uses models/default, or builds the tiny test checkpoint (needs transformers).
Both paths use the same torch thread count (the replica's num_cpus) and the same prompts, and
every request generates exactly max_tokens tokens (ignore_eos).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
           "the slings and arrows of outrageous fortune,", "or to take arms against a sea of troubles"]


def model_dir(arg: str | None) -> str:
    if arg:
        return arg
    default = ROOT / "models" / "default"
    if (default / "config.json").is_file():
        return str(default)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_checkpoint

    out = Path(tempfile.mkdtemp(prefix="bench-serving-")) / "gpt2"
    print(f"models/default is missing: using the tiny test checkpoint at {out}")
    return str(make_checkpoint(out, "gpt2"))


def summarize(name: str, tokens: int, seconds: float, ttfts: list[float]) -> dict:
    return {"path": name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ttft_median_ms": 1000 * statistics.median(ttfts), "ttft_p90_ms": 1000 * sorted(ttfts)[int(0.9 * len(ttfts))]}


async def _drive(one, conc: int, total: int) -> tuple[list, float]:
    """Run `total` requests with at most `conc` in flight (total == conc: one burst)."""
    sem = asyncio.Semaphore(conc)

    async def limited(i: int):
        async with sem:
            return await one(i)

    t0 = time.perf_counter()
    res = await asyncio.gather(*[limited(i) for i in range(total)])
    return res, time.perf_counter() - t0


async def run_inprocess(engine, conc: int, total: int, max_tokens: int, tag: str) -> dict:
    from engines import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=None)

    async def one(i: int):
        t0 = time.perf_counter()
        ttft, n = None, 0
        async for out in engine.generate(f"{tag}-{i}", PROMPTS[i % len(PROMPTS)], params):
            d = out.outputs[0].token_ids_delta
            if d and ttft is None:
                ttft = time.perf_counter() - t0
            n += len(d)
        return ttft, n

    res, dt = await _drive(one, conc, total)
    return summarize("in-process", sum(n for _, n in res), dt, [t for t, _ in res])


async def run_serving(session, url: str, model: str, conc: int, total: int, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "stream": True,
            "stream_options": {"include_usage": True}}

    async def one(i: int):
        t0 = time.perf_counter()
        ttft, usage, last = None, 0, b""
        async with session.post(f"{url}/v1/completions", json={**body, "prompt": PROMPTS[i % len(PROMPTS)]}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
            async for part in r.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = (last + part)[-2048:]
        # the usage event is the last before [DONE]: parse only that one
        for line in reversed(last.split(b"\n")):
            if line.startswith(b"data: {") and b'"usage": {' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
                break
        return ttft, usage

    res, dt = await _drive(one, conc, total)
    return summarize("serving", sum(n for _, n in res), dt, [t for t, _ in res])


async def run_rounds(engine, url: str, conc: int, max_tokens: int, rounds: int, modes: list[str],
                     local_url: str | None = None) -> dict[str, list[tuple[dict, ...]]]:
    import aiohttp  # a light client: its CPU is part of the serving path's measurement

    results: dict[str, list[tuple[dict, ...]]] = {m: [] for m in modes}
    connector = aiohttp.TCPConnector(limit=conc + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        # warm-up at full concurrency: code paths, and one pooled connection per stream
        await run_inprocess(engine, conc, conc, 8, "warm")
        await run_serving(client, url, "bench", conc, conc, 8)
        if local_url:
            await run_serving(client, local_url, "bench", conc, conc, 8)
        for r in range(rounds):
            for mode in modes:
                # burst: all requests at once; sustained: 4x as many, `conc` in flight (closed loop)
                total = conc if mode == "burst" else 4 * conc
                a = await run_inprocess(engine, conc, total, max_tokens, f"{mode}{r}")
                b = await run_serving(client, url, "bench", conc, total, max_tokens)
                c = await run_serving(client, local_url, "bench", conc, total, max_tokens) if local_url else None
                results[mode].append((a, b) if c is None else (a, b, c))
                print(f"round {r} {mode:9s}: in-process {a['tok_s']:7.0f} tok/s TTFT p50 {a['ttft_median_ms']:7.1f} ms"
                      f" | serving {b['tok_s']:7.0f} tok/s TTFT p50 {b['ttft_median_ms']:7.1f} ms"
                      + (f" | HTTP without Ray {c['tok_s']:7.0f} tok/s TTFT p50 {c['ttft_median_ms']:7.1f} ms"
                         if c else ""), flush=True)
    return results


def serve_local(config_json: str) -> None:
    """The --http-floor server: the gateway app with the engine in this process, under uvicorn."""
    import torch
    import uvicorn

    from deploy import validate_config
    from serving.app import create_local_app

    raw = json.loads(Path(config_json).read_text())
    torch.set_num_threads(raw.pop("threads"))
    cfg = validate_config(raw)
    uvicorn.run(create_local_app(cfg), host="127.0.0.1", port=cfg.server.port, log_level="warning")


def start_local(cfg, threads: int):
    """Start the --http-floor server on a free port; (process, url) once it answers."""
    import subprocess
    import urllib.request

    from training.distributed import free_port

    port = free_port()
    raw = cfg.model_dump(mode="json")
    raw["server"]["port"], raw["threads"] = port, threads
    spec = Path(tempfile.mkdtemp(prefix="bench-serving-")) / "local.json"
    spec.write_text(json.dumps(raw))
    proc = subprocess.Popen([sys.executable, __file__, "--serve-local", str(spec)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the --http-floor server did not become ready in 120 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: models/default or a tiny test model)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="the replica's Ray CPUs = torch threads of both paths")
    ap.add_argument("--stream-interval-ms", type=float, default=0.0, help="0 adapts it to load")
    ap.add_argument("--ingress", choices=["direct", "ray-proxy"], default="direct",
                    help="server.ingress: the gateway replica serves HTTP itself, or behind Ray Serve's proxy")
    ap.add_argument("--mode", choices=["burst", "sustained", "both"], default="both",
                    help="burst: `concurrency` requests at once; sustained: 4x as many with `concurrency` in flight")
    ap.add_argument("--http-floor", action="store_true",
                    help="also run a third path: the same gateway app and engine in one uvicorn process, no Ray "
                         "(what HTTP and the gateway cost on their own)")
    ap.add_argument("--serve-local", metavar="CONFIG_JSON", help=argparse.SUPPRESS)  # the --http-floor server
    args = ap.parse_args()
    if args.serve_local:
        return serve_local(args.serve_local)

    import torch

    from deploy import validate_config
    from engines import AsyncLLMEngine, EngineConfig
    from serving import launcher
    from training.distributed import free_port

    path = model_dir(args.model)
    threads = max(1, int(args.num_cpus))
    torch.set_num_threads(threads)
    cfg = validate_config({
        "models": [{"name": "bench", "path": path, "replicas": 1, "num_cpus": args.num_cpus,
                    "stream_interval_ms": args.stream_interval_ms, "max_waiting": max(64, args.concurrency)}],
        "server": {"port": free_port(), "log_requests": False, "ingress": args.ingress}})
    engine = AsyncLLMEngine.from_model_dir(path, EngineConfig(**cfg.models[0].engine.engine_kwargs()))
    local = start_local(cfg, threads) if args.http_floor else None
    running = launcher.start(cfg, [])
    print(f"model {path}; serving at {running.url} (ingress {args.ingress}, ready in {running.started_in_s:.1f} s); "
          f"{args.concurrency} concurrent streams x {args.max_tokens} tokens, torch threads {threads}")
    modes = ["burst", "sustained"] if args.mode == "both" else [args.mode]
    try:
        results = asyncio.run(run_rounds(engine, running.url, args.concurrency, args.max_tokens, args.rounds, modes,
                                         local[1] if local else None))
    finally:
        launcher.stop(running)
        engine.shutdown()
        if local:
            local[0].terminate()
            local[0].wait(30)
    for mode, rows in results.items():
        a_tok = statistics.median(row[0]["tok_s"] for row in rows)
        b_tok = statistics.median(row[1]["tok_s"] for row in rows)
        a_ttft = statistics.median(row[0]["ttft_median_ms"] for row in rows)
        b_ttft = statistics.median(row[1]["ttft_median_ms"] for row in rows)
        ratio, added = b_tok / a_tok, b_ttft - a_ttft
        print(f"\n{mode} ({args.concurrency} concurrent{', closed loop' if mode == 'sustained' else ''}), "
              f"median of {len(rows)} rounds:")
        print(f"  output tokens/s: in-process {a_tok:.0f}, serving {b_tok:.0f} -> ratio {ratio:.3f} "
              f"(target >= 0.85: {'PASS' if ratio >= 0.85 else 'MISS'})")
        print(f"  median TTFT: in-process {a_ttft:.1f} ms, serving {b_ttft:.1f} ms -> added {added:+.1f} ms "
              f"(target <= 20 ms: {'PASS' if added <= 20 else 'MISS'})")
        if local:
            c_tok = statistics.median(row[2]["tok_s"] for row in rows)
            c_ttft = statistics.median(row[2]["ttft_median_ms"] for row in rows)
            print(f"  HTTP + gateway without Ray: {c_tok:.0f} tok/s -> ratio {c_tok / a_tok:.3f}; median TTFT "
                  f"{c_ttft:.1f} ms -> added {c_ttft - a_ttft:+.1f} ms")


if __name__ == "__main__":
    main()
