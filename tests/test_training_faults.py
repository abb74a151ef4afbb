"""Training faults: a run killed with SIGKILL (no handler runs) resumes from its last checkpoint and
its loss curve and weights equal the uninterrupted run's; a disk that fills up while a checkpoint
is written (ENOSPC injected at the writer) leaves the previous checkpoint valid and resumable."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_training_loop import data_dir, losses, make_recipe  # noqa: F401 - data_dir is a fixture

import training.state
from training.state import read_meta
from training.trainer import train

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"train": {"ckpt_every": 2, "max_steps": 8}}
KILL_AT = 5  # after step 5; the last checkpoint is step 4's


def quiet(*args):
    pass


def weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(run / "checkpoint.safetensors").items() if k.startswith(("model.", "optim."))}


@pytest.fixture(scope="module")
def full(data_dir, tmp_path_factory):  # noqa: F811
    """The uninterrupted run both tests compare with."""
    run = tmp_path_factory.mktemp("full") / "run"
    return run, train(make_recipe(data_dir, run, **COMMON), progress=False, log=quiet)


def test_sigkill_then_resume_equals_the_uninterrupted_run(data_dir, tmp_path, full):  # noqa: F811
    full_dir, full = full
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from pathlib import Path
from test_training_loop import make_recipe
from training.trainer import train

def on_step(state, record):
    if state.step == {KILL_AT}:
        os.kill(os.getpid(), signal.SIGKILL)

train(make_recipe(Path({str(data_dir)!r}), Path({str(tmp_path / 'part')!r}), **{COMMON!r}), progress=False,
      log=lambda *a: None, on_step=on_step)
"""
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    assert read_meta(tmp_path / "part" / "checkpoint.safetensors")["state"]["step"] == KILL_AT - 1
    assert not list((tmp_path / "part").glob(".*.tmp"))
    resumed = train(make_recipe(data_dir, tmp_path / "part", **COMMON), resume=True, progress=False, log=quiet)
    assert resumed.state.step == 8
    after = {s: v for s, v in losses(tmp_path / "part").items() if s >= KILL_AT}
    assert after == {s: v for s, v in losses(full_dir).items() if s >= KILL_AT}
    assert losses(tmp_path / "part") == losses(full_dir)
    assert resumed.val_loss == full.val_loss
    a, b = weights(full_dir), weights(tmp_path / "part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_disk_full_while_saving_keeps_the_previous_checkpoint(data_dir, tmp_path, monkeypatch, full):  # noqa: F811
    full_dir, full = full
    real = training.state.save_file
    calls = {"n": 0}

    def save_file_disk_full(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 1:
            return real(tensors, path, metadata=metadata)
        with open(path, "wb") as f:  # a partial file, then the disk is full
            f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(training.state, "save_file", save_file_disk_full)
    run = tmp_path / "run"
    with pytest.raises(OSError) as exc:
        train(make_recipe(data_dir, run, **COMMON), progress=False, log=quiet)
    assert exc.value.errno == errno.ENOSPC and calls["n"] == 2
    assert read_meta(run / "checkpoint.safetensors")["state"]["step"] == 2  # step 4's save failed
    assert load_file(run / "checkpoint.safetensors")  # whole and readable
    assert not list(run.glob(".*.tmp"))  # the partial file is gone
    monkeypatch.setattr(training.state, "save_file", real)  # space again: resume from step 2
    resumed = train(make_recipe(data_dir, run, **COMMON), resume=True, progress=False, log=quiet)
    assert resumed.state.step == 8 and resumed.val_loss == full.val_loss
    assert losses(run) == losses(full_dir)
