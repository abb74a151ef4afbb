"""One `shardserve serve`, three models: a fine-tuned export and two p-tuned tasks on it (issue 39).

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python benchmarks/bench_serve_tasks.py --model DIR [--base BASE_DIR] \
        [--steps 6] [--n 4] [--max-tokens 16]

DIR: the fine-tuned export (`benchmarks/bench_train_init.py --finetune` writes one to
runs/bench_train_init/finetune/model). The script
  1. makes a model folder of its own that links DIR's files (the tasks land in its ptuning/, DIR is
     left as it is) and starts `shardserve serve` on it (a subprocess, a local Ray, no API keys);
  2. trains the tasks *play* and *next_speaker* (training/ptune_tasks.py's train split, validation
     records marked) over the REST job API, one after the other (--steps steps each: enough to
     make them tasks of their own, not to make them accurate: bench_ptune_real.py measures accuracy),
     and waits until the server has hot-loaded both;
  3. sends --n prompts (the tasks' test split, SmolLM2's chat turn) for each of the three models --
     the export without a task, the export with task play, with task next_speaker -- all at once
     (3 x n concurrent requests, greedy, --max-tokens, token logprobs on), then each again alone,
     one request at a time, and compares the greedy tokens;
  4. scores the same requests offline with engines.LLM on the same folder, one prompt at a time.

"Answers as when served alone": every concurrent answer's tokens equal its alone answer's and the
offline engine's. The engine's step records (/v1/admin/steps) show whether the three models shared
steps: with n requests per model, a step holding more than n sequences held at least two of them.
--base BASE_DIR trains and serves the tasks on BASE_DIR instead and serves DIR beside it as a second
model (the other reading: tasks on the original base, the fine-tune as its own model).
Raw output: runs/bench_serve_tasks/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.bench_ptune_real import CHATML, INSTRUCTIONS, stride

TASKS = ("play", "next_speaker")


def linked_model(src: Path, dst: Path) -> Path:
    """dst: a model folder whose files are links to src's (its own ptuning/ stays empty)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).symlink_to(f.resolve())
    return dst


def start_server(cfg: dict, work: Path, port: int) -> tuple[subprocess.Popen, str]:
    path = work / "serve.json"
    path.write_text(json.dumps(cfg, indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDSERVE_API_KEYS", "SHARDSERVE_ADMIN_KEYS")}
    log = open(work / "serve.log", "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen([sys.executable, "-m", "shardserve", "serve", "--config", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"shardserve serve exited ({proc.returncode}); see {work / 'serve.log'}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit("the server was not ready within 600 s")


def train_task(url: str, model: str, task: str, rows: list[dict], val: list[dict], steps: int) -> dict:
    """One p-tuning job over REST; returns the finished job."""
    data = "".join(json.dumps(r) + "\n" for r in rows + [{**r, "split": "val"} for r in val])
    recipe = {"num_virtual_tokens": 32, "max_steps": steps, "eval_every": steps, "batch_size": 8, "lr": 0.03,
              "template": CHATML, "init_text": INSTRUCTIONS[task], "precision": "fp32", "patience": 0}
    r = httpx.post(f"{url}/v1/ptuning/jobs", json={"model": model, "task": task, "data": data, "recipe": recipe},
                   timeout=60)
    r.raise_for_status()
    job_id = r.json()["id"]
    last = None
    while True:
        job = httpx.get(f"{url}/v1/ptuning/jobs/{job_id}", timeout=30).json()
        if job["state"] in ("succeeded", "failed", "cancelled"):
            break
        p = job.get("progress") or {}
        if p.get("step") and p != last:
            last = p
            print(f"  [{task}] step {p['step']}/{p['total']}, loss {p.get('loss')}", flush=True)
        time.sleep(2)
    if job["state"] != "succeeded":
        raise SystemExit(f"job {task}: {json.dumps(job)[:2000]}")
    return job


async def complete(client: httpx.AsyncClient, url: str, model: str, task: str | None, prompt: str,
                   max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    r = await client.post(f"{url}/v1/completions", json=body if task is None else {**body, "task": task}, timeout=600)
    r.raise_for_status()
    c = r.json()["choices"][0]
    return {"text": c["text"], "tokens": c["logprobs"]["tokens"], "finish": c["finish_reason"]}


async def ask_all(url: str, asks: list[tuple], max_tokens: int, together: bool) -> list[dict]:
    async with httpx.AsyncClient() as client:
        if together:
            return await asyncio.gather(*(complete(client, url, *a, max_tokens) for a in asks))
        return [await complete(client, url, *a, max_tokens) for a in asks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the fine-tuned export")
    ap.add_argument("--base", default=None, help="train and serve the tasks on this model instead (see above)")
    ap.add_argument("--steps", type=int, default=6, help="p-tuning steps per task (batch 8, N = 32)")
    ap.add_argument("--n", type=int, default=4, help="prompts per model")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", default="runs/bench_serve_tasks")
    a = ap.parse_args()
    from benchmarks.common import cpu_line
    from training.ptune_tasks import build_tasks
    from training.shakespeare import shakespeare_files

    work = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    tuned = linked_model(Path(a.model), work / "tuned")
    host = linked_model(Path(a.base), work / "base") if a.base else tuned  # the model the tasks live on
    models = [{"name": "tuned", "path": str(tuned.resolve())}]
    if a.base:
        models.append({"name": "base", "path": str(host.resolve())})
    host_name = "base" if a.base else "tuned"
    engine = {"max_num_seqs": 16, "cpu_linear_autotune": False}
    cfg = {"models": [{**m, "engine": engine} for m in models],
           "server": {"port": a.port, "log_requests": False}}
    splits = build_tasks(shakespeare_files())
    t0 = time.perf_counter()
    proc, url = start_server(cfg, work, a.port)
    print(f"server ready at {url} in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        jobs = {}
        for task in TASKS:
            jobs[task] = train_task(url, host_name, task, splits[task]["train"], stride(splits[task]["val"], 24),
                                    a.steps)
        deadline = time.monotonic() + 60
        while sorted(t["name"] for t in httpx.get(f"{url}/v1/ptuning/tasks?model={host_name}", timeout=30)
                     .json()["data"]) != sorted(TASKS):
            if time.monotonic() > deadline:
                raise SystemExit("the server did not load both tasks within 60 s of their jobs' end")
            time.sleep(1)
        prompts = {t: [CHATML.replace("{input}", r["input"]) for r in stride(splits[t]["test"], a.n)] for t in TASKS}
        # the three models of one server: the export alone (play's prompts), and its two tasks
        asks = [("tuned", None, p) for p in prompts["play"]]
        if a.base:
            asks += [("base", None, p) for p in prompts["play"]]
        asks += [(host_name, t, p) for t in TASKS for p in prompts[t]]
        t1 = time.perf_counter()
        together = asyncio.run(ask_all(url, asks, a.max_tokens, together=True))
        together_s = time.perf_counter() - t1
        # the steps of that phase, before the alone phase's steps push them out of the engine's window
        time.sleep(3)  # replicas publish their step windows with their metrics, every second
        steps = httpx.get(f"{url}/v1/admin/steps", params={"model": host_name}, timeout=30).json()
        alone = asyncio.run(ask_all(url, asks, a.max_tokens, together=False))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    from engines import LLM, SamplingParams

    offline = {}
    for name, d in [("tuned", tuned)] + ([("base", host)] if a.base else []):
        llm = LLM(str(d))
        llm.engine.tasks.load_dir()
        for m, t, p in asks:
            if m == name:  # one prompt at a time
                o = llm.generate([p], SamplingParams(temperature=0, max_tokens=a.max_tokens), task=t)[0].outputs[0]
                offline[m, t, p] = o
        del llm
    rows = [s for replica in steps["data"] for s in replica["steps"]]  # the latest steps of each replica
    most = max((s["decode_seqs"] + s["prefill_seqs"] for s in rows), default=0)
    variants = sorted({(m, t) for m, t, _ in asks}, key=str)
    trained = ", ".join(f"{t} {jobs[t]['metrics']['train_seconds']:.0f} s" for t in TASKS)
    lines = [f"CPU: {cpu_line()}; load average {os.getloadavg()[0]:.1f} at the end",
             (f"one `shardserve serve`: models {[m['name'] for m in models]}; tasks {list(TASKS)} on {host_name!r}, "
              f"trained over REST ({a.steps} steps each: {trained})"),
             (f"{len(asks)} requests ({a.n} per model), greedy, {a.max_tokens} tokens; together in {together_s:.1f} s; "
              f"most sequences in one step of {host_name!r}: {most} (> {a.n}: models shared steps)"), "",
             "| model | task | together = alone (tokens) | = offline engine (text) | sample |", "|---|---|---|---|---|"]
    ok_all = True
    for m, t in variants:
        idx = [i for i, x in enumerate(asks) if x[:2] == (m, t)]
        same = sum(together[i]["tokens"] == alone[i]["tokens"] for i in idx)
        off = sum(together[i]["text"] == offline[asks[i]].text for i in idx)
        ok_all &= same == off == len(idx)
        lines.append(f"| {m} | {t or '-'} | {same}/{len(idx)} | {off}/{len(idx)} | {together[idx[0]]['text'][:40]!r} |")
    lines.append(f"\neach answers as when served alone: {'met' if ok_all else 'MISSED'}")
    text = "\n".join(lines)
    print("\n" + text)
    (work / "table.md").write_text(text + "\n")
    (work / "results.json").write_text(json.dumps({"args": vars(a), "asks": asks, "together": together,
                                                   "alone": alone, "jobs": jobs, "steps": rows}, indent=1,
                                                  default=str))
    print(f"raw output: {work}")


if __name__ == "__main__":
    main()
