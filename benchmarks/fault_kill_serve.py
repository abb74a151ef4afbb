"""Fault figure for RELIABILITY.md: kill -9 `shardserve serve` mid-load, restart it, check it serves.

Before the kill a p-tuning task is trained over REST (a finished job) and a second job is left
training; after the restart the task is listed and served with the same greedy tokens, the finished
job is still `succeeded`, and the job that was queued or training when the server died (Ray reaps
its process with the replica) is started again by the new replica and finishes: no state lost.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fault_kill_serve.py [MODEL_DIR]

Without MODEL_DIR a tiny random checkpoint is written (tests/conftest.py). Ray's files go to a
private RAY_TMPDIR under /tmp, so no other Ray session is joined; prints what in-flight requests got,
how long the restart took, and how many processes were left behind.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)
from training.distributed import free_port

PORT = free_port()
TMP = tempfile.mkdtemp(prefix="ss-kill-", dir="/tmp")
if len(sys.argv) > 1:
    MODEL = sys.argv[1]
else:
    sys.path.insert(0, f"{ROOT}/tests")
    from conftest import make_checkpoint
    MODEL = str(make_checkpoint(Path(TMP) / "model", "gpt2", n_positions=2048))
URL = f"http://127.0.0.1:{PORT}"
env = {**os.environ, "PYTHONPATH": ROOT, "RAY_TMPDIR": f"{TMP}/ray", "SHARDSERVE_API_KEYS": "usr",
       "SHARDSERVE_ADMIN_KEYS": "adm"}
USER, ADMIN = {"Authorization": "Bearer usr"}, {"Authorization": "Bearer adm"}
JOB = {"model": "m", "data": "".join(json.dumps({"input": w, "output": " yes"}) + "\n" for w in ["king", "love", "war"] * 8),
       "recipe": {"num_virtual_tokens": 4, "max_steps": 12, "eval_every": 4, "lr": 0.05, "batch_size": 8}}


def start():
    return subprocess.Popen([f"{ROOT}/.venv/bin/shardserve", "serve", "--model", MODEL, "--name", "m",
                             "--port", str(PORT)], env=env, stdout=open(f"{TMP}/serve.log", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True)
def ready(timeout=180):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(f"{URL}/v2/health/ready", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit("not ready")
def job(body, timeout=240):
    r = httpx.post(f"{URL}/v1/ptuning/jobs", json=body, headers=ADMIN, timeout=30)
    assert r.status_code == 202, r.text
    return r.json()["id"]
def job_info(job_id):
    return httpx.get(f"{URL}/v1/ptuning/jobs/{job_id}", headers=ADMIN, timeout=30).json()
def job_state(job_id):
    return job_info(job_id)["state"]
def task_tokens():
    r = httpx.post(f"{URL}/v1/completions", headers=USER, timeout=60,
                   json={"model": "m", "prompt": "love", "max_tokens": 8, "task": "t1", "temperature": 0,
                         "ignore_eos": True, "logprobs": 1})
    return r.status_code, (r.json().get("choices") or [{}])[0].get("logprobs", {}).get("tokens")
p = start(); print("first start ready in", round(ready(), 1), "s")
done_id = job({**JOB, "task": "t1"})
t0 = time.monotonic()
while job_state(done_id) not in ("succeeded", "failed", "cancelled") and time.monotonic() - t0 < 240:
    time.sleep(1)
print("job 1:", job_state(done_id), "in", round(time.monotonic() - t0, 1), "s")
before = task_tokens()
print("task t1 served before the kill:", before)
running_id = job({**JOB, "task": "t2", "recipe": {**JOB["recipe"], "max_steps": 400}})
print("job 2 state at the kill:", job_state(running_id))
res = []
def load(i):
    try:
        r = httpx.post(f"{URL}/v1/completions", headers=USER, timeout=60,
                       json={"model": "m", "prompt": "hi", "max_tokens": 1900, "ignore_eos": True})
        res.append(r.status_code)
    except httpx.HTTPError as e:
        res.append(type(e).__name__)
ts = [threading.Thread(target=load, args=(i,)) for i in range(12)]
[t.start() for t in ts]; time.sleep(1.5)
os.kill(p.pid, signal.SIGKILL); p.wait(); t_kill = time.monotonic()
[t.join(90) for t in ts]
print("in-flight results after kill -9:", {k: res.count(k) for k in set(res)}, "in", round(time.monotonic() - t_kill, 1), "s")
time.sleep(1)
try:
    print("after kill, health:", httpx.get(f"{URL}/health", timeout=3).status_code)
except httpx.HTTPError as e:
    print("after kill, health:", type(e).__name__)
p2 = start(); print("restart ready in", round(ready(), 1), "s")
r = httpx.post(f"{URL}/v1/completions", headers=USER, json={"model": "m", "prompt": "hi", "max_tokens": 8}, timeout=60)
print("after restart:", r.status_code, r.json()["usage"] if r.status_code == 200 else r.text[:200])
tasks = httpx.get(f"{URL}/v1/ptuning/tasks", headers=ADMIN, timeout=30).json()
print("tasks after restart:", sorted(t["name"] for t in tasks["data"]))
after = task_tokens()
print("task t1 served after the restart:", after, "same as before" if after == before else "DIFFERENT")
print("job 1 after restart:", job_state(done_id))
t0 = time.monotonic()
while job_state(running_id) not in ("succeeded", "failed", "cancelled") and time.monotonic() - t0 < 300:
    time.sleep(1)
print("job 2 (training when the server was killed):", job_state(running_id), (job_info(running_id)["error"] or "")[:120],
      "; tasks now:",
      sorted(t["name"] for t in httpx.get(f"{URL}/v1/ptuning/tasks", headers=ADMIN, timeout=30).json()["data"]))
os.killpg(p2.pid, signal.SIGINT); p2.wait(60)
time.sleep(5)
left = subprocess.run(["pgrep", "-f", TMP], capture_output=True, text=True).stdout.split()
print("processes left after the restarted server stopped:", len(left))
