"""Serving overhead: concurrent streaming requests through gateway + Ray Serve vs the same requests
through the AsyncLLMEngine in this process, in the same run (rounds alternate, so both see the
same machine load).

Targets (issue 4): serving keeps >= 85% of the in-process output tokens/s and adds <= 20 ms to the
median time to first token. Two shapes of "64 concurrent streaming requests": a burst (all 64 sent
at once, so TTFT includes admitting all of them) and sustained load (256 requests, 64 in flight,
closed loop, as `--max-concurrency` in vLLM's benchmark_serving).

    .venv/bin/python benchmarks/bench_serving.py [--model DIR] [--concurrency 64] [--max-tokens 128] [--floors]

--floors adds two reference paths measured in the same rounds, each in its own process: the same
gateway app with the engine and no Ray (what Ray Serve's hop costs is the difference), and a bare
FastAPI SSE endpoint with no model (what HTTP, FastAPI and this client cost with nothing behind
them: a floor under the added TTFT on this machine).

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


async def engine_busy_seconds(client, url: str) -> float | None:
    """The engines' busy time (shardserve_engine_busy_seconds_total summed over replicas) from the
    server's /metrics; None where there is no engine (the bare floor)."""
    async with client.get(f"{url}/metrics") as r:
        if r.status != 200:
            return None
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("shardserve_engine_busy_seconds_total"))


async def run_rounds(engine, url: str, conc: int, max_tokens: int, rounds: int, modes: list[str],
                     floors: dict[str, str] | None = None, publish_s: float = 0.2
                     ) -> dict[str, list[dict[str, dict]]]:
    """Each round and mode: the in-process engine, then the serving path, then each floor server.
    Each arm also records its engine's busy seconds (None for the bare floor)."""
    import aiohttp  # a light client: its CPU is part of the serving path's measurement

    floors = floors or {}
    results: dict[str, list[dict[str, dict]]] = {m: [] for m in modes}
    connector = aiohttp.TCPConnector(limit=conc + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as client:
        async def busy(name: str, u: str | None) -> float | None:
            if u is None:
                return engine.stats()["busy_seconds"]
            if name == "serving":  # replicas publish their metrics every publish_s
                await asyncio.sleep(3 * publish_s)
            return await engine_busy_seconds(client, u)

        async def arm(name: str, u: str | None, total: int, tag: str) -> dict:
            before = await busy(name, u)
            if u is None:
                x = await run_inprocess(engine, conc, total, max_tokens, tag)
            else:
                x = await run_serving(client, u, "bench", conc, total, max_tokens)
            after = await busy(name, u)
            x["engine_s"] = None if before is None or after is None else after - before
            return x

        # warm-up at full concurrency: code paths, and one pooled connection per stream
        await run_inprocess(engine, conc, conc, 8, "warm")
        for u in (url, *floors.values()):
            await run_serving(client, u, "bench", conc, conc, 8)
        for r in range(rounds):
            for mode in modes:
                # burst: all requests at once; sustained: 4x as many, `conc` in flight (closed loop)
                total = conc if mode == "burst" else 4 * conc
                row = {name: await arm(name, u, total, f"{mode}{r}")
                       for name, u in (("in-process", None), ("serving", url), *floors.items())}
                results[mode].append(row)
                print(f"round {r} {mode:9s}: " + " | ".join(
                    f"{name} {x['tok_s']:6.0f} tok/s TTFT p50 {x['ttft_median_ms']:6.1f} ms"
                    + (f", engine busy {100 * x['engine_s'] / x['seconds']:3.0f}%" if x["engine_s"] is not None else "")
                    for name, x in row.items()), flush=True)
    return results


def bare_app():
    """A FastAPI SSE endpoint with no model: the OpenAI chunk shape, `max_tokens` one-token chunks,
    the usage event and [DONE]. What HTTP, FastAPI and the client cost with nothing behind them."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    async def ready(request):
        return JSONResponse({})

    async def completions(request):
        body = await request.json()
        n = int(body["max_tokens"])

        async def events():
            for i in range(n):
                chunk = {"id": "cmpl-bare", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": " tok", "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0)
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": n + 8}
            yield f"data: {json.dumps({'id': 'cmpl-bare', 'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # plain Starlette routes: the handlers take the request as it is, with no FastAPI parameter parsing
    app.router.add_route("/v2/health/ready", ready, methods=["GET"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    return app


def serve_floor(config_json: str) -> None:
    """A --floors server: the gateway app with the engine in this process (no Ray), or the bare app."""
    import torch
    import uvicorn

    from deploy import validate_config
    from serving.app import create_local_app

    raw = json.loads(Path(config_json).read_text())
    torch.set_num_threads(raw.pop("threads"))
    bare = raw.pop("bare")
    cfg = validate_config(raw)
    app = bare_app() if bare else create_local_app(cfg)
    uvicorn.run(app, host="127.0.0.1", port=cfg.server.port, log_level="warning")


def start_floor(cfg, threads: int, bare: bool):
    """Start a --floors server in its own process on a free port; (process, url) once it answers."""
    import subprocess
    import urllib.request

    from training.distributed import free_port

    port = free_port()
    raw = cfg.model_dump(mode="json")
    raw["server"]["port"], raw["threads"], raw["bare"] = port, threads, bare
    spec = Path(tempfile.mkdtemp(prefix="bench-serving-")) / "floor.json"
    spec.write_text(json.dumps(raw))
    proc = subprocess.Popen([sys.executable, __file__, "--serve-floor", str(spec)])
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
    raise RuntimeError("a --floors server did not become ready in 120 s")


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
    ap.add_argument("--floors", action="store_true",
                    help="also run two floor paths, each in its own process: the gateway app with the engine and no "
                         "Ray ('no-ray'), and a bare FastAPI SSE endpoint with no model ('bare-http')")
    ap.add_argument("--serve-floor", metavar="CONFIG_JSON", help=argparse.SUPPRESS)  # a --floors server
    args = ap.parse_args()
    if args.serve_floor:
        return serve_floor(args.serve_floor)

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
        "server": {"port": free_port(), "log_requests": False, "ingress": args.ingress,
                   "metrics_push_interval_s": 0.2}})
    engine = AsyncLLMEngine.from_model_dir(path, EngineConfig(**cfg.models[0].engine.engine_kwargs()))
    floor_procs = {name: start_floor(cfg, threads, bare) for name, bare in (("no-ray", False), ("bare-http", True))
                   } if args.floors else {}
    running = launcher.start(cfg, [])
    print(f"model {path}; serving at {running.url} (ingress {args.ingress}, ready in {running.started_in_s:.1f} s); "
          f"{args.concurrency} concurrent streams x {args.max_tokens} tokens, torch threads {threads}")
    modes = ["burst", "sustained"] if args.mode == "both" else [args.mode]
    try:
        results = asyncio.run(run_rounds(engine, running.url, args.concurrency, args.max_tokens, args.rounds, modes,
                                         {name: u for name, (_, u) in floor_procs.items()}))
    finally:
        launcher.stop(running)
        engine.shutdown()
        for proc, _ in floor_procs.values():
            proc.terminate()
            proc.wait(30)
    for mode, rows in results.items():
        tok = {name: statistics.median(row[name]["tok_s"] for row in rows) for name in rows[0]}
        ttft = {name: statistics.median(row[name]["ttft_median_ms"] for row in rows) for name in rows[0]}
        a_tok, b_tok, a_ttft, b_ttft = tok["in-process"], tok["serving"], ttft["in-process"], ttft["serving"]
        ratio, added = b_tok / a_tok, b_ttft - a_ttft
        print(f"\n{mode} ({args.concurrency} concurrent{', closed loop' if mode == 'sustained' else ''}), "
              f"median of {len(rows)} rounds:")
        print(f"  output tokens/s: in-process {a_tok:.0f}, serving {b_tok:.0f} -> ratio {ratio:.3f} "
              f"(target >= 0.85: {'PASS' if ratio >= 0.85 else 'MISS'})")
        print(f"  median TTFT: in-process {a_ttft:.1f} ms, serving {b_ttft:.1f} ms -> added {added:+.1f} ms "
              f"(target <= 20 ms: {'PASS' if added <= 20 else 'MISS'})")
        per_tok = {name: statistics.median(1000 * row[name]["engine_s"] / row[name]["tokens"] for row in rows)
                   for name in rows[0] if all(row[name]["engine_s"] is not None for row in rows)}
        busy = {name: statistics.median(row[name]["engine_s"] / row[name]["seconds"] for row in rows) for name in per_tok}
        if "serving" in per_tok:
            print(f"  engine step time per output token: in-process {per_tok['in-process']:.3f} ms, serving "
                  f"{per_tok['serving']:.3f} ms ({per_tok['serving'] / per_tok['in-process']:.2f}x); engine busy "
                  f"{100 * busy['in-process']:.0f}% / {100 * busy['serving']:.0f}% of the run")
        if "no-ray" in tok:
            print(f"  floor, gateway + engine without Ray: ratio {tok['no-ray'] / a_tok:.3f}, added TTFT "
                  f"{ttft['no-ray'] - a_ttft:+.1f} ms")
        if "bare-http" in ttft:
            print(f"  floor, bare FastAPI SSE endpoint with no model: median TTFT {ttft['bare-http']:.1f} ms "
                  "(HTTP, FastAPI and this client alone; the added TTFT cannot go below about this)")


if __name__ == "__main__":
    main()
