"""P-tuning training: a frozen base, answer-only loss, files that the engine (and PEFT) serve."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from safetensors.numpy import load_file
from typer.testing import CliRunner

from engines import LLM, SamplingParams
from engines.core.config import ConfigError
from engines.loading.checkpoint import load_model
from training.ptune import DatasetError, train_task
from training.ptune_recipe import PtuneRecipe, ptune_recipe_from_dict

WORDS = ["the", "king", "queen", "lord", "lady", "sword", "love", "heart", "war", "blood", "night", "day", "fair", "foul"]


def _dataset(path, n: int = 48) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        f.writelines(json.dumps({"input": " ".join(rng.choices(WORDS, k=5)), "output": " yes"}) + "\n" for _ in range(n))


@pytest.fixture()
def model_copy(gpt2_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gpt2_dir, d)
    return d


def test_trained_task_is_served_as_trained(model_copy, tmp_path):
    _dataset(tmp_path / "d.jsonl")
    recipe = PtuneRecipe(num_virtual_tokens=4, lr=0.05, max_steps=40, eval_every=10, batch_size=8,
                         template="Q: {input} A:", prompt_depth="input", encoder="mlp")
    seen = []
    m = train_task(model_copy, "yes", tmp_path / "d.jsonl", recipe, progress=False, on_progress=seen.append)
    assert m["base_grad_bytes"] == 0 and m["trainable_param_bytes"] < m["base_param_bytes"]
    assert seen[-1]["step"] == m["steps"] and seen[0]["total"] == 40
    losses = [json.loads(x)["loss"] for x in (model_copy / "ptuning/yes/metrics.jsonl").read_text().splitlines()]
    assert min(losses[-5:]) < 0.9 * losses[0]
    d = model_copy / "ptuning" / "yes"
    for f in ("adapter_config.json", "adapter_model.safetensors", "task.json", "prompt_encoder.safetensors",
              "loss_curve.png"):
        assert (d / f).is_file(), f
    meta = json.loads((d / "task.json").read_text())
    assert meta["template"] == "Q: {input} A:" and meta["num_virtual_tokens"] == 4 and "base_model_sha256" in meta
    llm = LLM(model_copy)
    assert llm.engine.tasks.load_dir() == ["yes"]
    prompts = ["Q: war and blood A:", "Q: fair lady night A:", "Q: the king A:"]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    served = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params, task="yes")]
    # the training forward (dense causal attention, table prepended as embeddings) predicts the same
    model, _ = load_model(model_copy)
    table = torch.from_numpy(load_file(d / "adapter_model.safetensors")["prompt_embeddings"])
    with torch.no_grad():
        for p, tok in zip(prompts, served):
            ids = torch.tensor([llm.tokenizer.encode(p)])
            x = torch.cat([table[None], model.wte(ids)], 1)
            assert model.logits(model(torch.zeros(x.shape[:2], dtype=torch.long), inputs_embeds=x))[0, -1].argmax() == tok
    plain = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params)]
    assert plain != served


def test_bad_datasets_and_recipes_are_refused(model_copy, tmp_path):
    bad = {"notjson": "{\"input\": \"a\", \"output\": \"b\"}\nnot json\n",
           "nofield": "{\"input\": \"a\", \"output\": \"b\"}\n{\"input\": \"a\"}\n",
           "one": "{\"input\": \"a\", \"output\": \"b\"}\n"}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(DatasetError, match="line 2: not JSON"):
        train_task(model_copy, "t", tmp_path / "notjson", progress=False)
    with pytest.raises(DatasetError, match="line 2: needs string fields"):
        train_task(model_copy, "t", tmp_path / "nofield", progress=False)
    with pytest.raises(DatasetError, match="at least 2"):
        train_task(model_copy, "t", tmp_path / "one", progress=False)
    _dataset(tmp_path / "d.jsonl", n=12)
    with pytest.raises(DatasetError, match="more than max_examples=10"):
        train_task(model_copy, "t", tmp_path / "d.jsonl", PtuneRecipe(max_examples=10), progress=False)
    with pytest.raises(ConfigError, match="ptune.lrr: unknown key"):
        ptune_recipe_from_dict({"lrr": 1})
    with pytest.raises(ConfigError, match="template"):
        PtuneRecipe(template="no slot")
    assert not (model_copy / "ptuning").exists() or not any((model_copy / "ptuning").iterdir())


def test_cli_and_cancel(model_copy, tmp_path):
    from shardserve.cli import app

    _dataset(tmp_path / "d.jsonl", n=12)
    r = CliRunner().invoke(app, ["ptune", "--model", str(model_copy), "--task", "c", "--data", str(tmp_path / "d.jsonl"),
                                 "--set", "max_steps=3", "--set", "prompt_depth=input", "--set", "encoder=lstm",
                                 "--set", "eval_every=2",
                                 "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads((model_copy / "ptuning/c/task.json").read_text())["metrics"]["steps"] == 3
    r = CliRunner().invoke(app, ["ptune", "--model", str(model_copy), "--task", "../x", "--data",
                                 str(tmp_path / "d.jsonl"), "--no-progress"])
    assert r.exit_code == 2 and "not a valid task name" in r.output
    with pytest.raises(InterruptedError):
        train_task(model_copy, "c", tmp_path / "d.jsonl", PtuneRecipe(max_steps=50), progress=False,
                   should_stop=lambda: True)
    # the cancelled run left the earlier task as it was, and no staging folder
    assert sorted(p.name for p in (model_copy / "ptuning").iterdir()) == ["c"]
    assert json.loads((model_copy / "ptuning/c/task.json").read_text())["metrics"]["steps"] == 3


def test_text_init_residual_encoder_schedule_and_answer_only_loss(model_copy, tmp_path):
    from engines.loading.tokenizer import Tokenizer
    from training.ptune import PromptEncoder, init_token_ids, lr_factor, tokenize_examples

    tok = Tokenizer.from_dir(model_copy)
    # PEFT's TEXT init: the text's tokens repeated, then cut, to N
    text_ids = tok.encode("the king", add_special_tokens=False)
    ids = init_token_ids(PtuneRecipe(num_virtual_tokens=5, init_text="the king"), tok, 1000).tolist()
    assert ids == (text_ids * 5)[:5]
    with pytest.raises(DatasetError, match="init_text"):
        init_token_ids(PtuneRecipe(init_text=" "), type("T", (), {"encode": lambda *a, **k: []})(), 1000)
    # a residual encoder starts exactly at its init embeddings (PEFT's layout does not) and still trains
    init = torch.randn(5, 64)
    for kind in ("mlp", "lstm"):
        enc = PromptEncoder(kind, 5, 64, 32, init, residual=True)
        torch.testing.assert_close(enc(), init)
        enc().sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters() if p is not enc.embedding.weight)
        assert not torch.allclose(PromptEncoder(kind, 5, 64, 32, init)(), init)
    # warm-up from lr/10 to lr, cosine back to lr/10
    assert lr_factor(0, 10, 100) == pytest.approx(0.1) and lr_factor(10, 10, 100) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100) == pytest.approx(0.55) and lr_factor(100, 10, 100) == pytest.approx(0.1)
    assert lr_factor(0, 0, 10) == pytest.approx(1.0)
    # append_eos=False: the loss is on the answer tokens alone
    rec = [{"input": "a b", "output": " yes"}]
    assert tokenize_examples(rec, tok, "{input}", 2, 64)[0].output_ids == tok.encode(" yes", add_special_tokens=False) + [2]
    assert tokenize_examples(rec, tok, "{input}", None, 64)[0].output_ids == tok.encode(" yes", add_special_tokens=False)
    _dataset(tmp_path / "d.jsonl", n=24)
    recipe = ptune_recipe_from_dict({"num_virtual_tokens": 3, "prompt_depth": "input", "encoder": "mlp",
                                     "encoder_residual": True,
                                     "init_text": "the king", "append_eos": False, "warmup_steps": 2,
                                     "max_steps": 6, "eval_every": 3, "batch_size": 4})
    m = train_task(model_copy, "ti", tmp_path / "d.jsonl", recipe, progress=False)
    assert m["steps"] == 6
    saved = json.loads((model_copy / "ptuning/ti/task.json").read_text())["recipe"]
    assert saved["init_text"] == "the king" and saved["append_eos"] is False and saved["encoder_residual"] is True
    with pytest.raises(ConfigError, match="warmup_steps"):
        ptune_recipe_from_dict({"warmup_steps": -1})
    with pytest.raises(ConfigError, match="append_eos"):
        ptune_recipe_from_dict({"append_eos": "maybe"})
    with pytest.raises(ConfigError, match="precision"):
        ptune_recipe_from_dict({"precision": "fp16"})


def test_choice_loss_is_the_labels_cross_entropy_among_the_labels(model_copy, tmp_path):
    from training.ptune import Example, _batch_loss, answer_choices

    ex = [Example([3, 4, 5], [7, 2]), Example([6, 3], [9, 2]), Example([8, 8, 4], [7, 2])]
    assert answer_choices(ex, 32).tolist() == [7, 9]
    assert answer_choices(ex[:1] + ex[2:], 32) is None  # one label: nothing to choose between
    assert answer_choices(ex, 1) is None  # more labels than the limit: not a classification
    model, _ = load_model(model_copy)
    model.eval().requires_grad_(False)
    table = torch.randn(2, model.wte.weight.shape[1]) * 0.1
    choices = torch.tensor([7, 9])
    plain, exact, n = _batch_loss(model, table, ex)
    both, exact2, _ = _batch_loss(model, table, ex, choices, 0.5)
    assert (exact, n) == (exact2, 3)
    # by hand: the row before each first answer token, its logits of 7 and 9 alone
    rows = []
    for e in ex:
        ids = torch.tensor(e.input_ids)[None]
        emb = torch.cat([table[None], model.wte(ids)], 1)
        rows.append(model.logits(model(torch.zeros(emb.shape[:2], dtype=torch.long), inputs_embeds=emb)[0, -1]))
    pair = torch.stack(rows)[:, [7, 9]].float()
    want = torch.nn.functional.cross_entropy(pair, torch.tensor([0, 1, 0]))
    torch.testing.assert_close(both - plain, 0.5 * want, rtol=1e-4, atol=1e-5)
    # a shift shared by both labels' logits leaves the choice term unchanged: its gradient is the difference
    torch.testing.assert_close(torch.nn.functional.cross_entropy(pair + 3.0, torch.tensor([0, 1, 0])), want)
    # the trainer takes the labels from the data and reports how many
    rows = [{"input": f"line {i}", "output": (" yes", " no")[i % 2]} for i in range(24)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    small = {"num_virtual_tokens": 3, "append_eos": False, "max_steps": 4, "eval_every": 2, "batch_size": 4}
    assert train_task(model_copy, "cl", tmp_path / "c.jsonl", ptune_recipe_from_dict(small), progress=False)[
        "answer_choices"] == 2  # on by default
    assert train_task(model_copy, "cl", tmp_path / "c.jsonl", ptune_recipe_from_dict({**small, "choice_loss": 0}),
                      progress=False)["answer_choices"] == 0
    with pytest.raises(ConfigError, match="choice_loss"):
        ptune_recipe_from_dict({"choice_loss": -1})


def test_bf16_autocast_training_matches_fp32(model_copy, tmp_path):
    from engines.loading.tokenizer import Tokenizer
    from training.ptune import evaluate, resolve_precision, tokenize_examples

    assert resolve_precision("fp32") == "fp32" and resolve_precision("auto") in ("bf16", "fp32")
    model, _ = load_model(model_copy)
    tok = Tokenizer.from_dir(model_copy)
    _dataset(tmp_path / "d.jsonl", n=8)
    rows = [json.loads(ln) for ln in (tmp_path / "d.jsonl").read_text().splitlines()]
    ex = tokenize_examples(rows, tok, "{input}", None, 64)
    table = model.wte.weight[:4].detach().clone()
    lf, _ = evaluate(model, table, ex, 4, "fp32")
    lb, _ = evaluate(model, table, ex, 4, "bf16")
    assert lb != lf and lb == pytest.approx(lf, rel=0.03)  # autocast ran, and computes the same loss
    _dataset(tmp_path / "d.jsonl", n=24)
    for prec in ("bf16", "fp32"):
        m = train_task(model_copy, f"p{prec}", tmp_path / "d.jsonl",
                       ptune_recipe_from_dict({"precision": prec, "max_steps": 2, "eval_every": 2, "batch_size": 4}),
                       progress=False)
        assert m["precision"] == prec and math.isfinite(m["best_val_loss"])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_layer_task_trains_and_is_served_as_trained(gpt2_dir, llama_dir, tmp_path, family):
    """prompt_depth every_layer (P-tuning v2): each layer's keys/values of the virtual tokens. The
    training forward (hooks after rotary embedding) and the engine's paged backend agree."""
    from engines.loading.tokenizer import Tokenizer
    from training.ptune import LayerPrefix, hooked

    d = tmp_path / "m"
    shutil.copytree(gpt2_dir if family == "gpt2" else llama_dir, d)
    model, cfg = load_model(d)
    model.eval().requires_grad_(False)
    tok = Tokenizer.from_dir(d)
    # started from a text's keys/values, the prefix is that text: same logits as the text itself
    init = torch.tensor((tok.encode("the king and the queen", add_special_tokens=False) * 4)[:5])
    prefix = LayerPrefix.from_text(model, init)
    assert prefix.kv.shape == (cfg.n_layer, 5, 2, cfg.kv_heads, cfg.hd)
    ids = torch.tensor(tok.encode("fair lady night"))
    with torch.no_grad():
        want = model.logits(model(torch.cat([init, ids])[None]))[0, 5:]
        with hooked(model, prefix.hook):  # the real tokens alone, at positions 5..: the prefix is prepended
            got = model.logits(model(ids[None], positions=torch.arange(5, 5 + len(ids))[None]))[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    _dataset(tmp_path / "d.jsonl")
    recipe = ptune_recipe_from_dict({"prompt_depth": "every_layer", "encoder": "embedding", "num_virtual_tokens": 4,
                                     "lr": 0.3, "max_steps": 40, "eval_every": 10, "batch_size": 8,
                                     "template": "Q: {input} A:", "init_text": "the king", "precision": "fp32"})
    m = train_task(d, "deep", tmp_path / "d.jsonl", recipe, progress=False)
    assert m["base_grad_bytes"] == 0
    losses = [json.loads(x)["loss"] for x in (d / "ptuning/deep/metrics.jsonl").read_text().splitlines()]
    assert min(losses[-5:]) < 0.5 * losses[0]
    cfg_json = json.loads((d / "ptuning/deep/adapter_config.json").read_text())
    assert cfg_json["peft_type"] == "PREFIX_TUNING" and cfg_json["num_layers"] == cfg.n_layer
    assert json.loads((d / "ptuning/deep/task.json").read_text())["every_layer"] is True
    llm = LLM(d)
    assert llm.engine.tasks.load_dir() == ["deep"]
    prompts = ["Q: war and blood A:", "Q: fair lady night A:", "Q: the king A:"]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    served = [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params, task="deep")]
    table = torch.from_numpy(load_file(d / "ptuning/deep/adapter_model.safetensors")["prompt_embeddings"])
    saved = LayerPrefix(table.view(4, cfg.n_layer, 2, cfg.kv_heads, cfg.hd).permute(1, 0, 2, 3, 4))
    with torch.no_grad(), hooked(model, saved.hook):
        for p, t in zip(prompts, served):
            ids = torch.tensor([llm.tokenizer.encode(p)])
            assert model.logits(model(ids, positions=torch.arange(4, 4 + ids.shape[1])[None]))[0, -1].argmax() == t
    assert [o.outputs[0].token_ids[0] for o in llm.generate(prompts, params)] != served
    with pytest.raises(ConfigError, match="encoder"):
        ptune_recipe_from_dict({"prompt_depth": "every_layer", "encoder": "mlp"})
    with pytest.raises(ConfigError, match="prompt_depth"):
        ptune_recipe_from_dict({"prompt_depth": "deep"})
