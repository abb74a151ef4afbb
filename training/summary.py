"""How a model was trained, written beside it, and the check `make model` / `make serve` run on it.

`training_summary.json` (in the run folder and the exported model folder) records the precision
chosen and why (with both measured rates), the hardware, the steps and tokens the budget bought,
the wall time, the load average, and the final validation loss.

A recipe's recorded results (`<recipe>.results.json` beside the recipe) hold the validation loss
the recipe reached within its budget on each kind of CPU it was measured on: "bf16" (AMX or
AVX512-BF16) and "no-bf16" (e.g. AVX2 only). `check_model` reports a model's summary against the
entry for the kind of machine it was trained on, and warns when it is much worse (a build on a
busy machine buys fewer steps).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engines.core.hardware import Choice, detect
from training.recipe import Recipe
from training.state import TrainState

SUMMARY = "training_summary.json"
FORMAT = "shardserve-training-summary/1"
WORSE_BY = 0.5
"""Nats per token above the recipe's recorded validation loss that count as much worse."""


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def training_summary(recipe: Recipe, state: TrainState, val_loss: float | None, choice: Choice,
                     device: torch.device, world_size: int, run_tokens: int, run_seconds: float,
                     load_start: list[float] | None) -> dict[str, Any]:
    """What a finished run reports; run_tokens / run_seconds: this invocation's (not the resumed part)."""
    hw = detect(device)
    rates = choice.rates
    return {
        "format": FORMAT,
        "val_loss": None if val_loss is None else round(val_loss, 6),
        "steps": state.step,
        "max_steps": recipe.train.max_steps,
        "tokens": state.tokens,
        "elapsed_s": round(state.elapsed_s, 3),
        "time_budget_s": recipe.train.time_budget_s,
        "tokens_per_s": round(run_tokens / run_seconds, 1) if run_seconds > 0 else None,
        "precision": {"requested": recipe.train.precision, "chosen": choice.precision, "reason": choice.reason,
                      "bf16_tokens_per_s": round(rates.bf16, 1) if rates else None,
                      "fp32_tokens_per_s": round(rates.fp32, 1) if rates else None,
                      "probe_s": round(rates.seconds, 3) if rates else None, "warning": choice.warning},
        "hardware": {**asdict(hw), "kind": hardware_kind(hw.bf16), "threads": torch.get_num_threads(),
                     "ranks": world_size},
        "load_average": {"start": load_start, "end": load_average()},
        "torch": torch.__version__,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "recipe": recipe.to_dict(),
    }


def hardware_kind(bf16: bool) -> str:
    return "bf16" if bf16 else "no-bf16"


def write_summary(summary: dict[str, Any], *dirs: str | Path | None) -> None:
    for d in dirs:
        if d is not None:
            path = Path(d) / SUMMARY
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2) + "\n")
            path.chmod(0o644)


def read_summary(model_dir: str | Path) -> dict[str, Any] | None:
    path = Path(model_dir) / SUMMARY
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) and d.get("format") == FORMAT else None


def results_path(recipe_path: str | Path) -> Path:
    p = Path(recipe_path)
    return p.with_name(p.stem + ".results.json")


def read_results(recipe_path: str | Path) -> dict[str, Any]:
    path = results_path(recipe_path)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def describe(summary: dict[str, Any]) -> str:
    """One paragraph: the validation loss and how the model was trained."""
    p, hw = summary["precision"], summary["hardware"]
    rates = ""
    if p.get("bf16_tokens_per_s") is not None:
        rates = f" (measured: bf16 {p['bf16_tokens_per_s']:,.0f}, fp32 {p['fp32_tokens_per_s']:,.0f} tokens/s)"
    load = (summary.get("load_average") or {}).get("start")
    budget = f" of a {summary['time_budget_s']:g} s budget" if summary.get("time_budget_s") else ""
    val = summary["val_loss"]
    return (f"validation loss {val:.3f} nats/token" if val is not None else "no validation loss") + (
        f" after {summary['steps']} steps ({summary['tokens']:,} tokens, {summary['elapsed_s']:.0f} s{budget}); "
        f"trained in {p['chosen']}, {p['requested']} requested{rates}, on {hw['name']} "
        f"({hw['feature']}; {hw['threads']} threads x {hw['ranks']} rank(s))"
        + (f", load average {load[0]:.1f} at the start" if load else ""))


def check_model(model_dir: str | Path, recipe_path: str | Path | None = None,
                worse_by: float = WORSE_BY) -> tuple[str, str | None]:
    """(report, warning or None) for the model in `model_dir` against the recipe's recorded result."""
    summary = read_summary(model_dir)
    if summary is None:
        return (f"{model_dir}: no {SUMMARY}, so how it was trained is unknown",
                (f"{model_dir} was not trained by this version of `shardserve train` (or its summary is "
                 f"missing): its quality is unchecked; remove the folder and run `make model` to rebuild it"))
    report = f"{model_dir}: {describe(summary)}"
    if recipe_path is None:
        return report, None
    results = read_results(recipe_path)
    kind = summary["hardware"].get("kind", hardware_kind(summary["hardware"].get("bf16", False)))
    ref = results.get(kind)
    if ref is None:
        return report + f"\n  no recorded result of {recipe_path} for a {kind} CPU to compare with", None
    report += (f"\n  {recipe_path} recorded {ref['val_loss']:.3f} on {ref['cpu']} ({kind}: {ref['steps']} steps "
               f"in {ref['precision']}, load average {ref['load_average']})")
    val = summary["val_loss"]
    if val is None or val > ref["val_loss"] + worse_by:
        got = "no validation loss" if val is None else f"validation loss {val:.3f}"
        return report, (f"{model_dir} is much worse than its recipe's recorded result ({got} against "
                        f"{ref['val_loss']:.3f}; {summary['steps']} steps against {ref['steps']}): the machine was "
                        f"probably busy while it trained. Rebuild it on a quieter machine: "
                        f"rm -r {model_dir} && make model")
    return report, None
