"""The step-wise p-tuning Trainer that benchmarks drive is train_task's own step, on its own clock."""

from __future__ import annotations

import json
import random

import pytest

from engines.core.config import ConfigError
from training.ptune import Trainer, prepare, train_task, val_score
from training.ptune_recipe import ptune_recipe_from_dict

WORDS = ["the", "king", "queen", "lord", "lady", "sword", "love", "war", "night", "day"]


def test_trainer_steps_are_train_tasks_steps_and_its_clock_leaves_out_validation(gpt2_dir, tmp_path):
    rng = random.Random(0)
    rows = [{"input": " ".join(rng.choices(WORDS, k=4)), "output": (" yes", " no")[i % 2]} for i in range(24)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = ptune_recipe_from_dict({"num_virtual_tokens": 3, "max_steps": 4, "eval_every": 2, "batch_size": 4,
                                     "precision": "fp32", "lr": 0.05, "warmup_steps": 2,
                                     "select_by": "accuracy"})
    m = train_task(gpt2_dir, "t", data, recipe, out_dir=tmp_path / "t", progress=False)
    logged = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    # driven batch by batch (as benchmarks/bench_ptune_real.py does), the same seed gives the same run
    td = prepare(gpt2_dir, data, recipe)
    with Trainer(td, recipe) as tr:
        losses = [tr.step([td.train[td.rng.randrange(len(td.train))] for _ in range(4)]) for _ in range(4)]
        vl, _ = tr.evaluate(td.val)
    assert losses == pytest.approx([r["loss"] for r in logged], rel=1e-5)
    assert vl == pytest.approx(logged[-1]["val_loss"], rel=1e-5)
    assert tr.steps == 4 and tr.train_s > 0 and tr.eval_s > 0
    # the training clock counts the optimizer steps; validation passes are counted apart
    assert m["train_seconds"] + m["eval_seconds"] <= m["wall_seconds"]
    assert [r["train_s"] for r in logged] == sorted(r["train_s"] for r in logged)
    # the kept table is the validation pass with the highest accuracy (ties: the lower loss)
    evals = [r for r in logged if "val_loss" in r]
    best = max(evals, key=lambda r: (r["val_accuracy"], -r["val_loss"]))
    assert (m["best_step"], m["val_accuracy"], m["best_val_loss"]) == (best["step"], best["val_accuracy"],
                                                                       best["val_loss"])


def test_selection_by_accuracy_then_loss_or_by_loss():
    # accuracy first; the loss breaks ties (and alone decides while no answer is fully right)
    assert val_score(0.9, 0.5, "accuracy") > val_score(0.4, 0.25, "accuracy")
    assert val_score(0.4, 0.0, "accuracy") > val_score(0.9, 0.0, "accuracy")
    # select_by loss (the default): the lower loss wins whatever the accuracy
    assert val_score(0.4, 0.25) > val_score(0.9, 0.5)  # the default
    with pytest.raises(ConfigError, match="select_by"):
        ptune_recipe_from_dict({"select_by": "f1"})
