"""train.precision: auto trains in whichever precision measures faster (the timing is injected,
either precision made the slower), explicit precisions are kept (with a warning naming both rates
when much slower), a resumed auto run keeps its precision, and the run records it all in
metrics.jsonl and training_summary.json, which `shardserve check-model` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.core.hardware import Rates
from training import precision as precision_mod
from training.data import prepare_data
from training.metrics import read_metrics
from training.recipe import recipe_from_dict
from training.summary import SUMMARY, check_model
from training.trainer import train

TEXT = "KING. Now, my good lords, what say you to this war?\nQUEEN. I say the winter comes, and we are cold.\n"
BF16_FASTER = Rates(bf16=9000.0, fp32=3000.0, seconds=0.01)
FP32_FASTER = Rates(bf16=64.0, fp32=2200.0, seconds=0.01)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tinyp")
    for i in range(4):
        (root / f"part{i}.txt").write_text(f"SCENE {i}.\n" + TEXT * (20 + i))
    return prepare_data([str(root)], root / "data", vocab_size=300, val_fraction=0.1, log=lambda *a: None).out_dir


def make_recipe(data_dir: Path, out: Path, precision: str, **train):
    d = {"model": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "max_position_embeddings": 32},
         "data": {"dir": str(data_dir), "seq_len": 16},
         "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1},
         "train": {"max_steps": 3, "batch_size": 4, "micro_batch_size": 4, "eval_every": 0, "eval_windows": 4,
                   "precision": precision, "num_threads": 1, **train},
         "out": {"dir": str(out / "run"), "export_dir": str(out / "model")}}
    return recipe_from_dict(d, json.loads((data_dir / "meta.json").read_text()))


def inject(monkeypatch, rates: Rates) -> list:
    calls = []

    def fake(recipe, model, ctx):
        calls.append(recipe.train.precision)
        return rates

    monkeypatch.setattr(precision_mod, "measure", fake)
    return calls


def run(recipe) -> tuple[list[str], dict[int, float]]:
    lines: list[str] = []
    train(recipe, progress=False, log=lambda *a: lines.append(" ".join(map(str, a))))
    curve = {r["step"]: r["loss"] for r in read_metrics(Path(recipe.out.dir) / "metrics.jsonl") if "loss" in r}
    return lines, curve


@pytest.mark.parametrize("rates, want", [(BF16_FASTER, "bf16"), (FP32_FASTER, "fp32")])
def test_auto_trains_in_the_faster_precision(data_dir, tmp_path, monkeypatch, rates, want):
    calls = inject(monkeypatch, rates)
    lines, auto_curve = run(make_recipe(data_dir, tmp_path / "auto", "auto"))
    assert calls == ["auto"]
    assert any(line.startswith(f"precision: {want} (auto: {want} measured faster") for line in lines), lines
    # it really trains in that precision: the same losses, step for step, as the explicit run
    _, same = run(make_recipe(data_dir, tmp_path / "same", want))
    _, other = run(make_recipe(data_dir, tmp_path / "other", "fp32" if want == "bf16" else "bf16"))
    assert auto_curve == same and auto_curve != other
    record = read_metrics(tmp_path / "auto" / "run" / "metrics.jsonl")[0]
    assert record["precision"] == want and record["requested_precision"] == "auto"
    assert record["bf16_tokens_per_s"] == rates.bf16 and record["fp32_tokens_per_s"] == rates.fp32
    for d in ("run", "model"):
        summary = json.loads((tmp_path / "auto" / d / SUMMARY).read_text())
        assert summary["precision"]["chosen"] == want and summary["steps"] == 3
        assert summary["val_loss"] == pytest.approx(read_metrics(tmp_path / "auto" / "run" / "metrics.jsonl")[-1]
                                                    ["val_loss"])


@pytest.mark.parametrize("explicit, rates, warns", [
    ("bf16", FP32_FASTER, True), ("fp32", BF16_FASTER, True),
    ("bf16", BF16_FASTER, False), ("fp32", Rates(bf16=3300.0, fp32=3000.0, seconds=0.01), False),
])
def test_explicit_precision_is_kept_and_warned_about_when_slow(data_dir, tmp_path, monkeypatch, explicit, rates,
                                                               warns):
    inject(monkeypatch, rates)
    lines, _ = run(make_recipe(data_dir, tmp_path, explicit, max_steps=1))
    assert any(line.startswith(f"precision: {explicit} ({explicit} as configured)") for line in lines), lines
    warning = [line for line in lines if line.startswith("warning:")]
    if warns:
        other = "fp32" if explicit == "bf16" else "bf16"
        mine, theirs = (rates.bf16, rates.fp32) if explicit == "bf16" else (rates.fp32, rates.bf16)
        assert len(warning) == 1 and f"{mine:,.0f} tokens/s" in warning[0] and f"{theirs:,.0f} tokens/s in {other}" \
            in warning[0], warning
        assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["precision_warning"] == warning[0][9:]
    else:
        assert not warning


def test_resumed_auto_run_keeps_its_precision(data_dir, tmp_path, monkeypatch):
    inject(monkeypatch, BF16_FASTER)
    recipe = make_recipe(data_dir, tmp_path, "auto", max_steps=2)
    run(recipe)
    calls = inject(monkeypatch, FP32_FASTER)  # the machine now says fp32; the checkpoint was bf16
    more = make_recipe(data_dir, tmp_path, "auto", max_steps=2)
    lines: list[str] = []
    train(more, resume=True, progress=False, log=lambda *a: lines.append(" ".join(map(str, a))))
    assert calls == [] and any("auto: bf16, as the resumed checkpoint was trained" in line for line in lines), lines


def test_real_probe_times_both_precisions(data_dir, tmp_path):
    # no injection: the real forward + backward of the recipe's model, both rates positive
    from training.distributed import init_context, shutdown
    from training.model_setup import build_model

    recipe = make_recipe(data_dir, tmp_path, "auto")
    ctx = init_context("cpu")
    try:
        model = build_model(recipe.model, 0, ctx.device)
        before = [p.detach().clone() for p in model.parameters()]
        rates = precision_mod.measure(recipe, model, ctx)
    finally:
        shutdown(ctx)
    assert rates.bf16 > 0 and rates.fp32 > 0 and rates.seconds < 30
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradients behind
    assert all((a == b.detach()).all() for a, b in zip(before, model.parameters()))


def test_check_model_against_the_recorded_result(data_dir, tmp_path, monkeypatch):
    inject(monkeypatch, FP32_FASTER)
    recipe = make_recipe(data_dir, tmp_path, "auto")
    run(recipe)
    model = tmp_path / "model"
    val = json.loads((model / SUMMARY).read_text())["val_loss"]
    kind = json.loads((model / SUMMARY).read_text())["hardware"]["kind"]
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("# recipe\n")
    ref = {"cpu": "Test CPU", "steps": 3, "precision": "fp32", "load_average": 0.1}
    (tmp_path / "r.results.json").write_text(json.dumps({kind: {**ref, "val_loss": val - 0.1}}))
    report, warning = check_model(model, recipe_file)
    assert f"validation loss {val:.3f}" in report and "trained in fp32, auto requested" in report
    assert "bf16 64, fp32 2,200 tokens/s" in report and warning is None
    (tmp_path / "r.results.json").write_text(json.dumps({kind: {**ref, "val_loss": val - 1.0}}))
    _, warning = check_model(model, recipe_file)
    assert warning is not None and "much worse than its recipe's recorded result" in warning
    (model / SUMMARY).unlink()
    _, warning = check_model(model, recipe_file)
    assert warning is not None and "quality is unchecked" in warning


def test_budget_cut_run_leaves_warmup_and_anneals():
    from training.optim import lr_at
    from training.recipe import OptimSpec

    spec = OptimSpec(lr=2e-3, min_lr=2e-4, warmup_steps=20)
    # no budget: the warmup is in steps, as before
    assert lr_at(spec, 4, 370) == pytest.approx(2e-3 * 5 / 20)
    # a budget that buys ~40 steps: the warmup runs its 20 steps as before
    assert lr_at(spec, 4, 370, progress=0.1) == pytest.approx(2e-3 * 5 / 20)
    # one that buys ~12 steps: the warmup ends half-way and the run anneals to min_lr
    assert 2e-4 < lr_at(spec, 6, 370, progress=0.55) < 2e-3
    assert lr_at(spec, 11, 370, progress=1.0) == pytest.approx(2e-4)
