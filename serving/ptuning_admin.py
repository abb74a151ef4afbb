"""The replica side of p-tuning administration: tasks on disk, training jobs, hot-loading.

The model's `ptuning/` folder is the source of truth, so every replica of a model (and a
restarted server) converges on the same tasks: each replica re-scans it (`sync`) every
`WATCH_INTERVAL_S` and after each admin call, loading new or changed tasks into its engine and
unloading removed ones; running requests keep the table they started with.

Jobs train in their own process (`python -m training.ptune_job DIR`, see training/ptune_job.py),
never in a serving replica's event loop or engine thread. A job's folder under
`ptuning/.jobs/<id>/` holds its request, dataset and state.json, which any replica can read;
cancelling writes a `cancel` file the job polls every step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import typing
import uuid
from pathlib import Path
from typing import Any

from engines.core.config import ConfigError
from engines.transforms.ptuning import (
    TASK_NAME_RE,
    DatasetError,
    TaskError,
    TaskRegistry,
    check_task_name,
    read_dataset,
)
from serving.ptuning_ops import (
    AddTask,
    CancelJob,
    DeleteTask,
    GetJob,
    ListJobs,
    ListTasks,
    PtuningOp,
    StartJob,
)
from serving.wire import ErrorInfo
from training.ptune_recipe import PtuneRecipe, ptune_recipe_from_dict

log = logging.getLogger("shardserve.ptuning")

WATCH_INTERVAL_S = 1.0
JOB_ID_PREFIX = "ptj-"
MAX_RESTARTS = 3
"""A job whose process dies without a word (server killed, OOM) is started again this many times."""
LAUNCH_GRACE_S = 60.0
"""A launched job that has not written its pid within this is taken as lost."""
HOST = socket.gethostname()
RECIPE_KEYS = tuple(f.name for f in dataclasses.fields(PtuneRecipe))
"""The keys a job's `recipe` may set: training.ptune_recipe.PtuneRecipe's fields (the recipe type is
the one source; serving imports training's recipe types only, as the tuner does)."""


class AdminError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.info = ErrorInfo(status, "invalid_request_error", message, param, code)


def _task_error(exc: TaskError) -> AdminError:
    status = 404 if exc.code in ("task_not_found", "task_path_not_found") else 400
    return AdminError(status, str(exc), exc.param, exc.code)


def _signature(d: Path) -> tuple:
    return tuple(((d / f).stat().st_mtime_ns, (d / f).stat().st_size) if (d / f).is_file() else None
                 for f in ("adapter_model.safetensors", "adapter_config.json", "task.json"))


class PtuningAdmin:
    def __init__(self, model_name: str, model_dir: str | Path, registry: TaskRegistry):
        self.model_name = model_name
        self.root = Path(model_dir) / "ptuning"
        self.jobs_dir = self.root / ".jobs"
        self.registry = registry
        self._seen: dict[str, tuple] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._watch: asyncio.Task | None = None
        self._lock = threading.Lock()
        self.sync()
        self.list_jobs()  # restarts the jobs a killed server left half-done (see get_job)

    # tasks
    def sync(self) -> list[str]:
        """Load new or changed task folders, unload removed ones; returns the loaded names."""
        with self._lock:
            return self._sync()

    def _sync(self) -> list[str]:
        present: dict[str, tuple] = {}
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.is_dir() and TASK_NAME_RE.match(d.name) and ".." not in d.name \
                        and (d / "adapter_model.safetensors").is_file():
                    present[d.name] = _signature(d)
        for name, sig in present.items():
            if self._seen.get(name) != sig:
                try:
                    self.registry.load(name, self.root / name)
                except TaskError as exc:  # a bad folder never takes the replica down
                    log.warning("model %s: task %s not loaded: %s", self.model_name, name, exc)
                self._seen[name] = sig
        for name in set(self._seen) - set(present):
            self.registry.unload(name)
            del self._seen[name]
        return self.registry.names()

    def ensure_watch(self) -> None:
        """Start re-scanning in the background (once, from within the replica's event loop)."""
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._run_watch())

    async def _run_watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                await asyncio.to_thread(self.sync)
            except RuntimeError as exc:  # the replica is shutting down: its executor takes no more work
                if "after shutdown" in str(exc):
                    return
                log.exception("model %s: scanning %s failed", self.model_name, self.root)
            except Exception:
                log.exception("model %s: scanning %s failed", self.model_name, self.root)

    def _task_info(self, name: str) -> dict:
        t = self.registry.get(name)
        return {"object": "ptuning.task", "name": name, "model": self.model_name,
                "num_virtual_tokens": t.num_virtual_tokens,
                "prompt_depth": "every_layer" if t.every_layer else "input", "template": t.meta.get("template"),
                "metrics": t.meta.get("metrics")}

    def list_tasks(self) -> list[dict]:
        self.sync()
        return [self._task_info(n) for n in self.registry.names()]

    def add_task(self, name: Any, path: Any) -> dict:
        """Validate the adapter at `path` against this model, copy it into ptuning/<name>, load it."""
        try:
            check_task_name(name)
            if not isinstance(path, str) or not path:
                raise TaskError("path: a directory holding a PEFT prompt adapter is required", param="path",
                                code="missing_required_parameter")
            self.registry.read(path, name)
        except TaskError as exc:
            raise _task_error(exc) from None
        src, dst = Path(path).resolve(), self.root / name
        if src != dst.resolve():
            tmp = self.root / f".{name}.copy"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.bin", "*.pt", "*.pkl"))
            shutil.rmtree(dst, ignore_errors=True)
            tmp.rename(dst)
        self.sync()
        return self._task_info(name)

    def delete_task(self, name: Any) -> dict:
        try:
            check_task_name(name)
        except TaskError as exc:
            raise _task_error(exc) from None
        d = self.root / name
        if not d.is_dir():
            raise AdminError(404, f"task: {name!r} does not exist for model {self.model_name!r}", "task",
                             "task_not_found")
        shutil.rmtree(d)
        self.sync()
        return {"object": "ptuning.task", "name": name, "model": self.model_name, "deleted": True}

    # jobs
    def start_job(self, task: Any, data: Any, dataset_path: Any, recipe: Any) -> dict:
        try:
            check_task_name(task)
        except TaskError as exc:
            raise _task_error(exc) from None
        if recipe is None:
            recipe = {}
        if not isinstance(recipe, dict):
            raise AdminError(400, "recipe: must be an object of p-tuning recipe keys", "recipe", "invalid_type")
        unknown = sorted(set(recipe) - set(RECIPE_KEYS))
        if unknown:
            raise AdminError(400, f"recipe.{unknown[0]}: unknown key; recipe accepts: {', '.join(RECIPE_KEYS)}",
                             f"recipe.{unknown[0]}", "unknown_parameter")
        try:  # the recipe type checks every value now, rather than the job failing later
            max_examples = ptune_recipe_from_dict(recipe).max_examples
        except ConfigError as exc:  # "ptune.KEY: why"
            where, _, why = str(exc).partition(": ")
            param = "recipe." + where.removeprefix("ptune.")
            raise AdminError(400, f"{param}: {why}", param, "invalid_value") from None
        if (data is None) == (dataset_path is None):
            raise AdminError(400, "data: give exactly one of data (inline JSONL) and dataset_path", "data",
                             "missing_required_parameter")
        if data is not None and (not isinstance(data, str) or not data.strip()):
            raise AdminError(400, "data: must be a non-empty string of JSONL lines", "data", "invalid_type")
        if dataset_path is not None and not isinstance(dataset_path, str):
            raise AdminError(400, "dataset_path: must be a string", "dataset_path", "invalid_type")
        try:
            read_dataset(data if data is not None else Path(dataset_path), max_examples)
        except DatasetError as exc:
            raise AdminError(413 if "more than" in str(exc) else 400, str(exc), exc.param, exc.code) from None
        for job in self.list_jobs():
            if job["task"] == task and job["state"] in ("queued", "running"):
                raise AdminError(409, f"task: job {job['id']} is already training {task!r}", "task", "job_conflict")
        job_id = f"{JOB_ID_PREFIX}{uuid.uuid4().hex[:16]}"
        d = self.jobs_dir / job_id
        d.mkdir(parents=True)
        if data is not None:
            (d / "data.jsonl").write_text(data)
        else:
            shutil.copyfile(dataset_path, d / "data.jsonl")
        (d / "request.json").write_text(json.dumps({"model": str(self.root.parent), "task": task, "recipe": recipe}))
        now = time.time()
        state = {"id": job_id, "object": "ptuning.job", "model": self.model_name, "task": task, "state": "queued",
                 "created_at": now, "launched_at": now, "host": HOST, "restarts": 0, "recipe": recipe, "progress": None, "metrics": None, "error": None}
        (d / "state.json").write_text(json.dumps(state))
        self._launch(d)
        return state

    def _launch(self, d: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), *sys.path) if p)}
        with open(d / "log.txt", "ab") as logf:
            self._procs[d.name] = subprocess.Popen([sys.executable, "-m", "training.ptune_job", str(d)], env=env,
                                                   stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)

    def _orphaned(self, state: dict) -> bool:
        """Queued or running on this host, but no process of ours or anyone's is running it."""
        if state["state"] not in ("queued", "running") or state["id"] in self._procs:
            return False
        if state.get("host", HOST) != HOST:
            return False  # another node's replica runs it; its pid means nothing here
        if state.get("pid") is not None and state.get("launched_at", 0) <= state.get("started_at", 0):
            return not _job_alive(state["pid"])  # it started: its process is the truth
        return time.time() - state.get("launched_at", state.get("created_at", 0)) > LAUNCH_GRACE_S

    def _restart(self, d: Path, state: dict) -> dict:
        """Start an orphaned job again from its first step (a p-tuning job is minutes long); once
        per restart count across replicas (the marker file is created exclusively)."""
        n = state.get("restarts", 0) + 1
        try:
            os.close(os.open(d / f"restart.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another replica is restarting it
            return json.loads((d / "state.json").read_text())
        if (d / "cancel").exists():
            state.update(state="cancelled", finished_at=time.time())
        elif n > MAX_RESTARTS:
            state.update(state="failed", error=f"the job's process died {n} times without a word "
                                               f"(server restarts or out of memory); see its log.txt")
        else:
            log.warning("model %s: p-tuning job %s lost its process; starting it again (restart %d)",
                        self.model_name, d.name, n)
            state.update(state="queued", restarts=n, launched_at=time.time(), host=HOST, pid=None,
                         progress=None, error=None)
        tmp = d / "state.json.restart.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(d / "state.json")
        if state["state"] == "queued":
            self._launch(d)
        return state

    def _job_dir(self, job_id: Any) -> Path:
        if not isinstance(job_id, str) or not job_id.startswith(JOB_ID_PREFIX) or not job_id[4:].isalnum():
            raise AdminError(404, f"job {job_id!r} does not exist", "id", "job_not_found")
        d = self.jobs_dir / job_id
        if not (d / "state.json").is_file():
            raise AdminError(404, f"job {job_id!r} does not exist", "id", "job_not_found")
        return d

    def get_job(self, job_id: Any) -> dict:
        d = self._job_dir(job_id)
        state = json.loads((d / "state.json").read_text())
        proc = self._procs.get(job_id)
        if state["state"] in ("queued", "running") and proc is not None and proc.poll() is not None:
            state = json.loads((d / "state.json").read_text())  # it may have finished just now
            if state["state"] in ("queued", "running"):
                tail = (d / "log.txt").read_text(errors="replace")[-2000:] if (d / "log.txt").is_file() else ""
                state.update(state="failed", error=f"the job process exited with status {proc.returncode}: {tail}")
                (d / "state.json").write_text(json.dumps(state))
        if self._orphaned(state):
            state = self._restart(d, state)
        if state["state"] == "succeeded":
            self.sync()  # hot-load now rather than at the next scan
        p = state.get("progress") or {}
        state["progress"] = p or None
        return state

    def list_jobs(self) -> list[dict]:
        if not self.jobs_dir.is_dir():
            return []
        return sorted((self.get_job(d.name) for d in self.jobs_dir.iterdir() if (d / "state.json").is_file()),
                      key=lambda j: j["created_at"])

    def cancel_job(self, job_id: Any) -> dict:
        d = self._job_dir(job_id)
        state = self.get_job(job_id)
        if state["state"] not in ("queued", "running"):
            raise AdminError(409, f"job {job_id} has already {state['state']}", "id", "job_finished")
        (d / "cancel").write_text("")
        proc = self._procs.get(job_id)
        if proc is not None:  # ours: wait a little for it to stop at its next step
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                proc.terminate()
        return self.get_job(job_id)

    def run(self, op: PtuningOp) -> tuple[ErrorInfo | None, Any]:
        """Run an admin operation (serving/ptuning_ops.py); errors come back as data (they cross Ray
        as values)."""
        try:
            match op:
                case ListTasks():
                    return None, self.list_tasks()
                case AddTask(name, path):
                    return None, self.add_task(name, path)
                case DeleteTask(name):
                    return None, self.delete_task(name)
                case StartJob(task, data, dataset_path, recipe):
                    return None, self.start_job(task, data, dataset_path, recipe)
                case GetJob(job_id):
                    return None, self.get_job(job_id)
                case ListJobs():
                    return None, self.list_jobs()
                case CancelJob(job_id):
                    return None, self.cancel_job(job_id)
                case _:
                    typing.assert_never(op)
        except AdminError as exc:
            return exc.info, None


def _job_alive(pid: Any) -> bool:
    """A live process with this pid that is a p-tuning job (not a reused pid)."""
    if not isinstance(pid, int):
        return False
    try:
        return b"training.ptune_job" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        pass
    try:  # no /proc (macOS): liveness only
        os.kill(pid, 0)
    except OSError:
        return False
    return True
