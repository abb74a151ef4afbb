"""Fault figure for RELIABILITY.md: kill -9 `shardserve serve` mid-load, restart it, check it serves.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/fault_kill_serve.py [MODEL_DIR]

Without MODEL_DIR a tiny random checkpoint is written (tests/conftest.py). Ray's files go to a
private RAY_TMPDIR under /tmp, so no other Ray session is joined; prints what in-flight requests got,
how long the restart took, and how many processes were left behind.
"""
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
env = {**os.environ, "PYTHONPATH": ROOT, "RAY_TMPDIR": f"{TMP}/ray"}
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
p = start(); print("first start ready in", round(ready(), 1), "s")
res = []
def load(i):
    try:
        r = httpx.post(f"{URL}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1900, "ignore_eos": True}, timeout=60)
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
r = httpx.post(f"{URL}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 8}, timeout=60)
print("after restart:", r.status_code, r.json()["usage"] if r.status_code == 200 else r.text[:200])
os.killpg(p2.pid, signal.SIGINT); p2.wait(60)
time.sleep(5)
left = subprocess.run(["pgrep", "-f", TMP], capture_output=True, text=True).stdout.split()
print("processes left after the restarted server stopped:", len(left))
