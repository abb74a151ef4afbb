"""`make serve` start times: seconds from the command to the first chat answer, cold and warm.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_serve_start.py            # cold, then warm
    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_serve_start.py --warm-only

Issue 35's targets: the first answer within 90 s of `make setup` on a 2-core machine (the first start:
the pinned wheel fetched from the package index, the GGUF imported, every Linear's kernel timed),
within 20 s on the second start. `make setup` builds the C++ kernels (engines/cpu/prebuild.py), so the
run builds them first, as setup does, and times from there; "cold" gives the run a fresh cache home
(XDG_CACHE_HOME: pip's download cache, the fetched wheel, the kernel timings, torch's extension
directory, where that build goes) and a fresh model directory: what a new machine does after `make
setup`. "Warm" starts again on the same directories. Each start runs `make serve` itself and asks the
chat endpoint, through the official `openai` client, the questions below until it answers; then
Ctrl-C (SIGINT) stops it, as a person would. The CPU model and the load average are printed with
the figures (a start is mostly single-threaded work plus Ray's daemons: a busy host slows it).
Raw output: runs/serve_start-<time>.json and each start's log beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import cpu_line

QUESTIONS = [  # (question, a word the right answer contains); a 135M model knows these (it calls Neptune the
    # largest planet, greedy as transformers does: that is the model's knowledge, not the server's)
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("What is the chemical symbol for water?", "h2o"),
    ("How many days are there in a week?", "seven|7"),
]
NAME = "SmolLM2-135M-Instruct"


def ask(port: int, question: str, timeout_s: float) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=timeout_s, max_retries=0)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": question}],
                                       temperature=0, max_tokens=48)
    return r.choices[0].message.content or ""


def one_start(env: dict, model_dir: Path, port: int, log_path: Path, limit_s: float, tree: bool = False) -> dict:
    """Run `make serve` until the first chat answer (or limit_s); return the timings and answers.
    tree: this source tree's code (PYTHONPATH) on a .venv that make must not reinstall."""
    cmd = ["make", "--no-print-directory", *(["-o", ".venv/.installed"] if tree else []), "serve",
           f"SERVE_MODEL={model_dir}", f"PORT={port}"]
    t0, wall0 = time.monotonic(), time.time()
    load0 = os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    first, err = None, ""
    try:
        while time.monotonic() - t0 < limit_s:
            if proc.poll() is not None:
                err = f"make serve exited with {proc.returncode} before answering (see {log_path})"
                break
            try:
                ask(port, QUESTIONS[0][0], timeout_s=30)
                first = time.monotonic() - t0
                break
            except Exception as exc:  # noqa: BLE001 - not up yet: connection refused / 503 while loading
                err = f"{type(exc).__name__}: {exc}"
                time.sleep(0.5)
        answers = []
        if first is not None:
            import re

            for q, want in QUESTIONS:
                a = ask(port, q, timeout_s=60)
                answers.append({"question": q, "answer": a, "right": bool(re.search(want, a.lower()))})
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the server drains and stops
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"first_answer_s": first, "load_at_start": load0, "answers": answers if first is not None else [],
            "error": None if first is not None else err, "phases": phases_of(log_path.read_text(errors="replace"), wall0)}


def phases_of(log: str, wall0: float) -> dict[str, float]:
    """Where a start's time went, from `shardserve serve`'s output: its ready line ("ready in T s (ray a s,
    serve b s, application c s)", timed from Ray's start) and the model replica's model_ready event: when
    its constructor began ("replica init at", seconds after the command, started at unix time wall0),
    its imports and the model's load (and its process's age at init: a worker Ray started ahead idles)."""
    import re

    out: dict[str, float] = {}
    m = re.search(r"ready in ([0-9.]+) s \(([^)]*)\)", log)
    if m:
        out["ready"] = float(m.group(1))
        for part in m.group(2).split(", "):
            name, value, _unit = part.rsplit(" ", 2)
            out[name] = float(value)
    m = re.search(r'\{"event": "model_ready".*?\}', log)
    if m:
        ev = json.loads(m.group(0))
        out["replica init at"] = ev["init_at"] - wall0
        out.update({f"replica {k.removesuffix('_s')}": v for k, v in ev.items() if k.endswith("_s")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--warm-only", action="store_true",
                    help="only warm starts on this user's caches and models/smollm2 (no fresh directories)")
    ap.add_argument("--warm-starts", type=int, default=2, help="starts after the cold one")
    ap.add_argument("--limit-s", type=float, default=900.0, help="give up on a start after this long")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="with --warm-only: the imported model to serve (default models/smollm2)")
    ap.add_argument("--tree", action="store_true",
                    help="run this source tree (PYTHONPATH=its root) on the .venv as it is, never reinstalled "
                         "(a git worktree whose .venv links to another checkout's)")
    args = ap.parse_args()

    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = ROOT / "runs"
    runs.mkdir(exist_ok=True)
    env = dict(os.environ)
    if args.tree:
        env["PYTHONPATH"] = str(ROOT)
    else:
        env.pop("PYTHONPATH", None)  # make serve runs the installed package, as a user's does
    if args.warm_only:
        model_dir = args.model_dir or ROOT / "models" / "smollm2"
    else:
        scratch = Path(tempfile.mkdtemp(prefix="serve-start-"))
        env["XDG_CACHE_HOME"] = str(scratch / "cache")
        model_dir = scratch / "smollm2"
    # what make setup did on that machine (torch's extension directory follows XDG_CACHE_HOME)
    subprocess.run([sys.executable, "-m", "engines.cpu.prebuild"], cwd=ROOT, env=env, check=True)
    print(f"CPU: {cpu_line()}")
    print(f"model directory {model_dir}; cache home {env.get('XDG_CACHE_HOME', '(the user s)')}", flush=True)
    starts = []
    kinds = ([] if args.warm_only else ["cold"]) + ["warm"] * args.warm_starts
    for i, kind in enumerate(kinds):
        res = one_start(env, model_dir, args.port, runs / f"serve_start-{stamp}-{i}.log", args.limit_s, args.tree)
        res["kind"] = kind
        starts.append(res)
        right = sum(a["right"] for a in res["answers"])
        fig = f"{res['first_answer_s']:.1f} s" if res["first_answer_s"] is not None else f"none ({res['error']})"
        print(f"start {i + 1} ({kind}, load {res['load_at_start']:.1f}): first answer {fig}; "
              f"{right}/{len(QUESTIONS)} answers right", flush=True)
        print("    " + ", ".join(f"{k} {v:.1f} s" for k, v in res["phases"].items()))
        for a in res["answers"]:
            print(f"    {a['question']} -> {a['answer']!r}")
    out = runs / f"serve_start-{stamp}.json"
    out.write_text(json.dumps({"cpu": cpu_line(), "starts": starts}, indent=1))
    print("\n| start | first answer | target |\n|---|---|---|")
    for s in starts:
        target = 90 if s["kind"] == "cold" else 20
        v = s["first_answer_s"]
        verdict = "none" if v is None else f"{v:.1f} s ({'met' if v <= target else 'missed'})"
        print(f"| {s['kind']} | {verdict} | <= {target} s |")
    print(f"raw: {out}")


if __name__ == "__main__":
    main()
