"""The full training state on disk: one safetensors file, written atomically by rank 0.

    model.<name>            parameters (our names, fp32; tied weights stored once)
    optim.<index>.<key>     AdamW state per parameter (exp_avg, exp_avg_sq, step)
    rng.<rank>.cpu          torch CPU generator state of every rank (dropout)
    rng.<rank>.cuda         the CUDA generator state, on GPU runs

The safetensors header metadata holds one JSON document: counters (step, samples consumed = the
data position, tokens, elapsed seconds), the optimizer's parameter groups, the world size and the
recipe. Loading never unpickles anything. The file is written to a temporary name beside its
final one, flushed and renamed over it, so a crash or a kill leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from training.recipe import Recipe, fingerprint

CHECKPOINT = "checkpoint.safetensors"
VERSION = 1


class ResumeError(ValueError):
    """A checkpoint cannot be resumed: missing, unreadable, or written by a different recipe or data."""


@dataclass
class TrainState:
    """The loop's counters; with the tensors they are everything a resume needs."""

    step: int = 0
    """Optimizer steps done."""
    samples: int = 0
    """Global training windows consumed: the data position (training/data.py TrainOrder)."""
    tokens: int = 0
    elapsed_s: float = 0.0
    """Training time so far, summed over resumes (drives a time-budget schedule)."""
    best_val_loss: float | None = None
    precision: str | None = None
    """The precision trained in (bf16 / fp32): a resumed precision=auto run keeps it."""


@dataclass
class TrainResult:
    """What a training run returns, on either loop (training/trainer.py, training/parallel/loop.py):
    it lives here, beside TrainState, so neither loop imports the other for it."""

    state: TrainState
    val_loss: float | None
    """Validation loss at the end (None if interrupted before an evaluation)."""
    interrupted: bool
    checkpoint: Path | None
    export_dir: Path | None
    run_dir: Path


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, each storage once (tied weights share one)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach()
    return out


def save_state(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
               recipe: Recipe, data_fingerprint: str, rng_states: list[dict[str, torch.Tensor]]) -> Path:
    """Write the training state atomically; `rng_states[r]` are rank r's generator states."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {f"model.{k}": v.cpu().contiguous() for k, v in model_tensors(model).items()}
    opt = optimizer.state_dict()
    for index, st in opt["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().cpu().contiguous()
    for rank, states in enumerate(rng_states):
        for kind, t in states.items():
            tensors[f"rng.{rank}.{kind}"] = t.cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in opt["param_groups"]]
    meta = {
        "version": VERSION,
        "state": asdict(state),
        "param_groups": groups,
        "world_size": len(rng_states),
        "recipe": recipe.to_dict(),
        "fingerprint": fingerprint(recipe),
        "data_fingerprint": data_fingerprint,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, tmp, metadata={"shardserve": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        tmp.chmod(0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ResumeError(f"no checkpoint at {str(path)!r} to resume from")
    try:
        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {})["shardserve"])
    except Exception as exc:  # safetensors raises its own error types
        raise ResumeError(f"{path}: not a shardserve training checkpoint ({exc})") from exc
    if meta.get("version") != VERSION:
        raise ResumeError(f"{path}: checkpoint version {meta.get('version')!r}, this code reads {VERSION}")
    return meta


def check_compatible(path: str | Path, meta: dict[str, Any], recipe: Recipe, data_fingerprint: str) -> None:
    """Refuse to resume across recipes (beyond cadence and paths) or onto other token files."""
    ours, theirs = fingerprint(recipe), meta["fingerprint"]
    diffs = [f"{k}: checkpoint {theirs.get(k)!r}, recipe {ours.get(k)!r}"
             for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise ResumeError(f"{path} was written by a different recipe ({shown}); resume with the recipe that "
                          "wrote it, or start a fresh run in another out.dir")
    if meta["data_fingerprint"] != data_fingerprint:
        raise ResumeError(f"{path} was trained on other token files than {recipe.data.dir!r}; "
                          "resume on the same prepared data")


def load_state(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, recipe: Recipe,
               data_fingerprint: str, rank: int = 0, world_size: int = 1) -> tuple[TrainState, bool]:
    """Restore model, optimizer and this rank's RNG; returns (counters, RNG restored exactly).

    The RNG is restored exactly when the world size matches the one that saved; otherwise each
    rank's generator is reseeded from (seed, rank, step) and the run continues, not bitwise.
    """
    meta = read_meta(path)
    check_compatible(path, meta, recipe, data_fingerprint)
    device = next(model.parameters()).device
    with safe_open(path, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    ours = model_tensors(model)
    missing = [k for k in ours if f"model.{k}" not in tensors]
    if missing:
        raise ResumeError(f"{path}: checkpoint lacks model tensors {', '.join(missing[:5])}")
    with torch.no_grad():
        for k, t in ours.items():
            src = tensors[f"model.{k}"]
            if src.shape != t.shape:
                raise ResumeError(f"{path}: tensor {k} has shape {tuple(src.shape)}, the recipe's model "
                                  f"has {tuple(t.shape)}")
            t.copy_(src)
    if optimizer is not None:
        groups = meta["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        state: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                _, index, key = k.split(".", 2)
                state.setdefault(int(index), {})[key] = v.to(device) if key != "step" else v
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    exact = meta["world_size"] == world_size
    if exact:
        torch.set_rng_state(tensors[f"rng.{rank}.cpu"])
        if f"rng.{rank}.cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors[f"rng.{rank}.cuda"])
    else:
        torch.manual_seed(hash((recipe.train.seed, rank, meta["state"]["step"])) % 2**63)
    return TrainState(**meta["state"]), exact


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states
