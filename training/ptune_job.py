"""One REST p-tuning job, run as its own process: `python -m training.ptune_job JOB_DIR`.

JOB_DIR (written by the server, serving/ptuning_admin.py) holds request.json (model, task,
recipe overrides) and data.jsonl. This process writes state.json atomically as it goes
(state, progress {step, total, loss, elapsed_s, eta_s}, metrics or error) and stops, writing
nothing into the model's tasks, once a file named `cancel` appears. Any server replica can read
the state or ask for a cancel, and both survive a server restart.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def write_state(job_dir: Path, **fields) -> dict:
    path = job_dir / "state.json"
    state = json.loads(path.read_text()) if path.is_file() else {}
    state.update(fields)
    tmp = job_dir / f"state.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(path)
    return state


def run_job(job_dir: str | Path) -> int:
    from engines.core.config import ConfigError
    from engines.core.sampling_params import RequestError
    from training.ptune import train_task
    from training.ptune_recipe import ptune_recipe_from_dict

    d = Path(job_dir)
    req = json.loads((d / "request.json").read_text())
    write_state(d, state="running", started_at=time.time(), pid=os.getpid())
    last = [0.0]

    def progress(p: dict) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5 or p["step"] == p["total"]:
            last[0] = now
            write_state(d, progress=p)

    try:
        recipe = ptune_recipe_from_dict(req.get("recipe") or {})
        write_state(d, progress={"step": 0, "total": recipe.max_steps, "loss": None, "elapsed_s": 0.0, "eta_s": None})
        metrics = train_task(req["model"], req["task"], d / "data.jsonl", recipe, progress=False,
                             on_progress=progress, should_stop=lambda: (d / "cancel").exists())
    except InterruptedError:
        write_state(d, state="cancelled", finished_at=time.time())
        return 0
    except (ConfigError, RequestError) as exc:
        write_state(d, state="failed", error=str(exc), finished_at=time.time())
        return 2
    except Exception as exc:  # noqa: BLE001 - recorded for the client; the process ends here
        write_state(d, state="failed", error=f"{type(exc).__name__}: {exc}", finished_at=time.time())
        return 1
    write_state(d, state="succeeded", metrics=metrics, finished_at=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1]))
