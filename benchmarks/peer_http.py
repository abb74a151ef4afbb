"""The HTTP mix of the peer benchmark: one server at a time, `shardserve loadtest` against it.

The same client, lengths and streams for every server: `shardserve serve`, vLLM's OpenAI server and
llama.cpp's `llama-server` (parallel slots, continuous batching). A server that fails is a result to
report, not a crash of the benchmark.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS_PY = Path(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with rc {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def server_command(server: str, model: Path, dtype: str, port: int, kv_bytes: int, n: int, work: Path,
                   vllm_py: Path | None = None, vllm_env: dict | None = None,
                   llama_cmd=None) -> tuple[list[str], dict]:
    """(argv, env) of one server on `port`; `llama_cmd(port)` gives llama-server's argv."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if server == "vllm":
        return ([str(vllm_py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--served-model-name", "peer", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
                 "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", "1024"], {**clean, **(vllm_env or {})})
    if server == "llama":
        return llama_cmd(port), clean
    cfg = work / "serve.yaml"
    cfg.write_text(json.dumps({
        "models": [{"name": "peer", "path": str(model), "num_cpus": os.cpu_count(), "max_waiting": 4 * n,
                    "engine": {"dtype": dtype, "kv_cache_bytes": kv_bytes}}],
        "server": {"host": "127.0.0.1", "port": port},
        "ray": {"num_cpus": os.cpu_count()}}))
    return [str(OURS_PY), "-m", "shardserve", "serve", "--config", str(cfg)], {**os.environ, "PYTHONPATH": str(ROOT)}


def http_mix(server: str, model: Path, dtype: str, kv_bytes: int, n: int, work: Path, reps=range(3),
             **server_kw) -> dict:
    """A loadtest run for each repetition in `reps` (n streams at once, prompt and output lengths uniform in 16-256,
    ignore_eos) against one server started for them; every run's output tok/s and TTFT p50/p90. The runs share their
    lengths (--seed 0) and differ in their words (--content-seed), so the server's prefix cache serves none of a
    repetition and the spread measures the server, not three workloads (seeds 0-2 differed by ~8 % in prompt tokens).
    Each server first serves a warm-up run of n // 4 streams (other words), not counted, as vLLM's serving benchmark
    sends a test request first: a first run after the start also paid its lazy set-ups (ours: the thread counts'
    first samples; the first repetition was the slowest of three, 133.5 against 148.0-153.3 tok/s)."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = open(work / f"{server}-{dtype}-server.log", "a")  # noqa: SIM115 (closed in finally, after the server)
    proc = None
    try:
        cmd, env = server_command(server, model, dtype, port, kv_bytes, n, work, **server_kw)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        t = time.time()
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900)
        start_s = time.time() - t
        runs = []
        for rep in (-1, *reps):  # -1: a warm-up of n // 4 streams, not counted (every server gets it)
            res = work / f"{server}-{dtype}-loadtest-{rep if rep >= 0 else 'warmup'}"
            r = subprocess.run([str(OURS_PY), "-m", "shardserve", "loadtest", "--url", f"http://127.0.0.1:{port}",
                                "--model", "peer", "--num-prompts", str(n if rep >= 0 else max(1, n // 4)),
                                "--request-rate", "inf",
                                "--input-dist", "uniform:16:256", "--output-dist", "uniform:16:256",
                                "--tokenizer", str(model / "tokenizer.json"), "--ignore-eos", "--result-dir",
                                str(res), "--no-plots", "--no-progress", "--timeout", "1800", "--seed", "0",
                                "--content-seed", str(rep if rep >= 0 else 99)],  # other words: no cache hits
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if r.returncode != 0:
                return {"error": f"loadtest rc {r.returncode}: {r.stderr[-1500:]}"}
            if rep < 0:
                continue
            s = json.loads((res / "summary.json").read_text())
            s = s.get("summary", s)
            runs.append({"tok_s": s["output_throughput"], "ttft_p50_s": s["ttft_ms"]["p50"] / 1e3,
                         "ttft_p90_s": s["ttft_ms"]["p90"] / 1e3, "itl_max_s": s["itl_ms"]["max"] / 1e3,
                         "failed": s["failed"]})
        return {"runs": runs, "start_s": start_s, "load": os.getloadavg()[0]}
    except (RuntimeError, OSError, KeyError, ValueError, TypeError, subprocess.SubprocessError) as exc:
        return {"error": f"{type(exc).__name__}: {exc} (log: {log.name})"}
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
