"""The training loop on tiny models: loss falls, bitwise resume after SIGTERM, refused resumes,
time budgets, data parallel on gloo (and a Ray Train smoke test), and export parity with the
engine and with transformers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training.data import prepare_data
from training.metrics import read_metrics
from training.recipe import recipe_from_dict
from training.state import ResumeError
from training.trainer import train

TEXT = """KING. Now, my good lords, what say you to this war?
QUEEN. I say the winter comes, and we are cold;
Let the fire burn, and let the horses rest.
KING. Then rest they shall, until the spring be green.
"""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    for i in range(6):
        (root / f"part{i}.txt").write_text(f"SCENE {i}.\n" + TEXT * (8 + i))
    return prepare_data([str(root)], root / "data", vocab_size=320, val_fraction=0.1, log=lambda *a: None).out_dir


def make_recipe(data_dir: Path, run_dir: Path, model: dict | None = None, **sections):
    d = {
        "model": {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "max_position_embeddings": 64,
                  **(model or {})},
        "data": {"dir": str(data_dir), "seq_len": 32},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "train": {"max_steps": 8, "batch_size": 8, "micro_batch_size": 4, "eval_every": 4, "eval_windows": 8,
                  "precision": "fp32", "num_threads": 1},
        "out": {"dir": str(run_dir)},
    }
    for section, values in sections.items():
        d[section].update(values)
    meta = json.loads((data_dir / "meta.json").read_text())
    return recipe_from_dict(d, meta)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_loss_falls_on_a_tiny_corpus(data_dir, tmp_path):
    recipe = make_recipe(data_dir, tmp_path / "run", train={"max_steps": 40, "eval_every": 20})
    result = train(recipe, progress=False, log=lambda *a: None)
    curve = losses(tmp_path / "run")
    assert len(curve) == 40 and curve[40] < curve[1] - 2.0, curve
    assert result.val_loss is not None and result.val_loss < curve[1] - 2.0
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert all({"lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= set(r) for r in records if "loss" in r)
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "run" / "checkpoint.safetensors").is_file()


def _interrupt_at(step: int):
    def on_step(state, record):
        if state.step == step:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler path: finish the step, save, return
    return on_step


@pytest.mark.parametrize("precision, model", [
    ("fp32", {"dropout": 0.1}),
    ("bf16", {"model_type": "llama", "n_kv_head": 2, "bias": False, "activation": "silu", "dropout": 0.1}),
])
def test_resume_after_interruption_is_bitwise(data_dir, tmp_path, precision, model):
    """Interrupted (by SIGTERM) after step 3 and resumed == uninterrupted: losses and weights, bit for bit."""
    common = {"model": model, "train": {"precision": precision, "ckpt_every": 2, "max_steps": 8}}
    full = train(make_recipe(data_dir, tmp_path / "full", **common), progress=False, log=lambda *a: None)
    part = train(make_recipe(data_dir, tmp_path / "part", **common), progress=False, log=lambda *a: None,
                 on_step=_interrupt_at(3))
    # the signal lands after step 3; the step then in flight (4) finishes before the save
    assert part.interrupted and part.state.step == 4 and part.val_loss is None
    resumed = train(make_recipe(data_dir, tmp_path / "part", **common), resume=True, progress=False,
                    log=lambda *a: None)
    assert resumed.state.step == 8 and not resumed.interrupted
    assert losses(tmp_path / "part") == losses(tmp_path / "full")  # one curve, each step once
    assert resumed.val_loss == full.val_loss
    a = load_file(tmp_path / "full" / "checkpoint.safetensors")
    b = load_file(tmp_path / "part" / "checkpoint.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        if k.startswith(("model.", "optim.")):
            assert torch.equal(a[k], b[k]), k


def test_resume_refuses_another_recipe(data_dir, tmp_path):
    train(make_recipe(data_dir, tmp_path / "run", train={"max_steps": 2}), progress=False, log=lambda *a: None)
    other = make_recipe(data_dir, tmp_path / "run", model={"n_layer": 3}, train={"max_steps": 2})
    with pytest.raises(ResumeError, match=r"different recipe \(model.n_layer: checkpoint 2, recipe 3\)"):
        train(other, resume=True, progress=False, log=lambda *a: None)
    other = make_recipe(data_dir, tmp_path / "run", optim={"lr": 1e-3}, train={"max_steps": 2})
    with pytest.raises(ResumeError, match=r"optim.lr: checkpoint 0.003, recipe 0.001"):
        train(other, resume=True, progress=False, log=lambda *a: None)
    with pytest.raises(ResumeError, match="no checkpoint at"):
        train(make_recipe(data_dir, tmp_path / "empty"), resume=True, progress=False, log=lambda *a: None)
    # cadence and paths may change on resume
    same = make_recipe(data_dir, tmp_path / "run", train={"max_steps": 2, "eval_every": 1, "log_every": 2})
    assert train(same, resume=True, progress=False, log=lambda *a: None).state.step == 2


def test_time_budget_ends_the_run_annealed(data_dir, tmp_path):
    # 3 s: long enough that one slow last step (a stall on a busy machine) still starts late in the cosine
    recipe = make_recipe(data_dir, tmp_path / "run", train={"max_steps": 100000, "time_budget_s": 3.0})
    result = train(recipe, progress=False, log=lambda *a: None)
    assert 1 < result.state.step < 100000 and result.state.elapsed_s < 10
    last = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "lr" in r][-1]
    assert last["lr"] < 0.1 * recipe.optim.lr + recipe.optim.min_lr  # the cosine has run its course


def test_final_evaluation_on_fixed_windows_or_off(data_dir, tmp_path):
    """train.final_eval_windows scores the final model on that many evenly spread windows (the ones
    val_starts gives, as a benchmark scores other models on); final_eval false: no validation at all."""
    from training.data import TokenData, val_starts
    from training.distributed import DistContext
    from training.model_setup import build_model
    from training.trainer import evaluate

    train_spec = {"max_steps": 3, "eval_every": 0}
    r = make_recipe(data_dir, tmp_path / "a", train={**train_spec, "final_eval_windows": 2},
                    out={"export_dir": str(tmp_path / "a-model")})
    got = train(r, progress=False, log=lambda *a: None).val_loss
    data = TokenData(data_dir)
    starts = val_starts(data.meta["val_tokens"], 32, 2)
    model = build_model(r.model, 0, torch.device("cpu"), str(tmp_path / "a-model"))
    assert len(starts) == 2 and got == pytest.approx(evaluate(model, data, starts, r, DistContext(), "fp32"), abs=1e-5)
    whole = val_starts(data.meta["val_tokens"], 32, data.meta["val_tokens"])
    assert len(whole) > 2 and got != pytest.approx(evaluate(model, data, whole, r, DistContext(), "fp32"), abs=1e-5)
    r = make_recipe(data_dir, tmp_path / "b", train={**train_spec, "final_eval": False})
    assert train(r, progress=False, log=lambda *a: None).val_loss is None
    assert not [x for x in read_metrics(tmp_path / "b" / "metrics.jsonl") if "val_loss" in x]


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """The training model's own greedy decode: full forward each step, argmax of the last logits."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model.logits(model(idx))[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            idx = torch.cat([idx, nxt], dim=1)
    return idx[0, len(ids):].tolist()


@pytest.mark.parametrize("model", [
    {},
    {"activation": "gelu"},  # the default recipe's exact GELU: HF's activation_function "gelu"
    {"model_type": "llama", "n_kv_head": 2, "bias": False, "activation": "silu", "tie_word_embeddings": False},
])
def test_export_matches_engine_and_transformers(data_dir, tmp_path, model):
    from engines import LLM, SamplingParams
    from training.export import export_checkpoint
    from training.model_setup import build_model

    recipe = make_recipe(data_dir, tmp_path / "run", model=model,
                         train={"max_steps": 20}, out={"export_dir": str(tmp_path / "model")})
    train(recipe, progress=False, log=lambda *a: None)
    trained = build_model(recipe.model, 0, torch.device("cpu")).eval()
    state = load_file(tmp_path / "run" / "checkpoint.safetensors")
    trained.load_state_dict({k[6:]: v for k, v in state.items() if k.startswith("model.")}, strict=False)

    exported = tmp_path / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in exported.iterdir()}
    llm = LLM(exported)
    prompt = llm.tokenizer.encode("KING. Now, my good")
    assert prompt[0] == 0  # BOS, as every training document starts
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _greedy(trained, prompt, 12)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + out.outputs[0].token_ids])
    with torch.no_grad():
        ours = trained.logits(trained(ids))
        theirs = hf(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)

    # `shardserve export` of the run writes the same weights
    again = export_checkpoint(tmp_path / "run", tmp_path / "again")
    a, b = load_file(exported / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_data_parallel_gloo_matches_one_rank(data_dir, tmp_path):
    """DP=2 (two processes, gloo) and DP=1 with the same global batch walk the same loss curve."""
    from training.cli import _worker
    from training.distributed import spawn_local

    single = make_recipe(data_dir, tmp_path / "dp1", train={"max_steps": 5, "batch_size": 8, "micro_batch_size": 2})
    train(single, progress=False, log=lambda *a: None)  # 4 micro-steps of 2 on one rank
    double = make_recipe(data_dir, tmp_path / "dp2", train={"max_steps": 5, "batch_size": 8, "micro_batch_size": 2})
    spawn_local(_worker, 2, ({"recipe": double.to_dict(), "resume": False, "progress": False},), threads_per_rank=1)
    one, two = losses(tmp_path / "dp1"), losses(tmp_path / "dp2")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    a = load_file(tmp_path / "dp1" / "checkpoint.safetensors")
    b = load_file(tmp_path / "dp2" / "checkpoint.safetensors")
    assert {k for k in b if k.startswith("rng.")} == {"rng.0.cpu", "rng.1.cpu"}  # every rank's RNG, one file
    for k in a:
        if k.startswith("model."):
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_ray_train_launch_smoke(data_dir, tmp_path):
    """Two Ray Train workers (gloo) run the same training function and rank 0 exports the model."""
    pytest.importorskip("ray.train.torch", exc_type=ImportError)  # needs ray[train]
    import yaml
    from typer.testing import CliRunner

    from shardserve.cli import app

    recipe = make_recipe(data_dir, tmp_path / "run", train={"max_steps": 2, "batch_size": 4, "micro_batch_size": 2},
                         out={"export_dir": str(tmp_path / "model")})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe.to_dict()))
    res = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "r.yaml"), "--num-workers", "2",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_fused_linear_cross_entropy_matches_the_plain_loss():
    import torch.nn.functional as F

    from training.loss import linear_cross_entropy

    torch.manual_seed(0)
    h0, w0 = torch.randn(300, 32), torch.randn(500, 32) * 0.3
    t = torch.randint(0, 500, (300,))
    h1, w1 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = F.cross_entropy(h1 @ w1.T, t)
    (ref * 3).backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    got = linear_cross_entropy(h2, w2, t)
    (got * 3).backward()  # the upstream gradient scales both input gradients
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h0, w0, t, reduction="sum"), ref * 300)
    # bf16: the same logits as the autocast lm_head (bf16 matmul, read in fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy((h0 @ w0.T).float(), t)
    torch.testing.assert_close(linear_cross_entropy(h0, w0, t, torch.bfloat16), plain, atol=1e-3, rtol=1e-3)


def test_fused_loss_is_exact_when_a_target_probability_underflows():
    """A target ~100 nats below the best logit has an fp32 probability of 0: the loss stays finite and exact."""
    import torch.nn.functional as F

    from training.loss import linear_cross_entropy

    torch.manual_seed(0)
    h, w = torch.randn(64, 16) * 40, torch.randn(100, 16)
    t = torch.randint(0, 100, (64,))
    logits = h.double() @ w.double().T
    assert (torch.softmax(logits.float(), -1).gather(1, t[:, None]) == 0).any()  # the case is exercised
    hh = h.clone().requires_grad_()
    got = linear_cross_entropy(hh, w, t)
    got.backward()
    torch.testing.assert_close(got.double(), F.cross_entropy(logits, t), rtol=1e-5, atol=1e-4)
    assert torch.isfinite(hh.grad).all()


def test_batch_that_does_not_split_over_the_workers_fails_before_launch(data_dir, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from shardserve.cli import app

    recipe = make_recipe(data_dir, tmp_path / "run", train={"max_steps": 2, "batch_size": 32, "micro_batch_size": 8})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe.to_dict()))
    res = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "r.yaml"), "--num-workers", "3",
                                   "--launcher", "local", "--no-progress"])
    assert res.exit_code != 0
    assert "train.batch_size: must be a multiple of train.micro_batch_size x ranks (8 x 3), got 32" in res.output
    assert not (tmp_path / "run").exists()  # no rank started
