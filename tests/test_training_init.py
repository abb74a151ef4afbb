"""`shardserve train --init`: continued training from a model directory.

For every family the engine loads (tiny random configs saved by transformers), the trainer's first
step's loss equals transformers' loss on the same batch, on one process and on TP=2 + SP + selective
recompute and PP=2 (gloo); the export keeps the tokenizer, the chat template and the generation
config, and loads in the engine with transformers' greedy tokens; bad recipe values are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from engines.core.config import ConfigError
from training.data import TokenData, TrainOrder, prepare_data
from training.metrics import read_metrics
from training.recipe import recipe_from_dict
from training.tokenizer import save_tokenizer, train_bpe

TEXT = "KING. Now, my good lords, what say you to this war?\nQUEEN. I say the winter comes, and we are cold;\n"
VOCAB = 384  # the model's rows (>= the tokenizer's ~320; divisible by TP=2)
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endfor %}"


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True, rope_theta=10000.0, **kw)


def _gpt2(**kw):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, **kw)


def _auto(model_type: str, **extra):
    """A Llama-shaped tiny config of another family (qkv biases, q/k norms, sliding-window keys)."""
    from transformers import AutoConfig

    def make(**kw):
        return AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, tie_word_embeddings=True, rope_theta=10000.0,
                                    **extra, **kw)
    return make


# one line per family the engine loads
FAMILIES = {"llama": _llama, "gpt2": _gpt2, "qwen2": _auto("qwen2"),
            "qwen3": _auto("qwen3", head_dim=16),  # explicit head_dim: 4 heads x 16 = hidden 32
            "mistral": _auto("mistral", sliding_window=None)}
EXPORTED = ("gpt2", "llama")
"""Families whose export is also served and compared (the round trip is family-independent; kept lean)."""


def _model_dir(root: Path, family: str) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    d = root / family
    torch.manual_seed(0)
    cfg = FAMILIES[family](bos_token_id=0, eos_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    tk = train_bpe([TEXT * 4], 320)
    save_tokenizer(tk, d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": TEMPLATE}))
    GenerationConfig(bos_token_id=0, eos_token_id=[0, 1], temperature=0.6, top_p=0.9, do_sample=True
                     ).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (root / f"part{i}.txt").write_text(f"SCENE {i}.\n" + TEXT * (20 + i))
    return root


def recipe(init: Path, data: Path, run: Path, export: Path | None = None, **train) -> dict:
    return {"init": str(init), "data": {"dir": str(data), "seq_len": 16},
            "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1},
            "train": {"max_steps": 1, "batch_size": 4, "micro_batch_size": 2, "eval_every": 0, "eval_windows": 2,
                      "precision": "fp32", **train},
            "out": {"dir": str(run), "export_dir": str(export or "")}}


def hf_loss(model_dir: Path, data_dir: Path) -> float:
    """transformers' mean next-token loss on the trainer's first global batch."""
    from transformers import AutoModelForCausalLM

    data = TokenData(data_dir)
    starts = TrainOrder(data.meta["train_tokens"], 16, 0).starts(0, 4)
    x, y = data.batch("train", starts, 16)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def first_loss(run: Path) -> float:
    return next(r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_step_loss_equals_transformers_and_export_keeps_tokenizer(family, corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    from engines import LLM, SamplingParams
    from engines.loading.tokenizer import Tokenizer
    from training.trainer import train

    init = _model_dir(tmp_path, family)
    data = prepare_data([str(corpus)], tmp_path / "data", tokenizer_dir=init, log=lambda *a: None).out_dir
    assert (data / "tokenizer.json").read_bytes() == (init / "tokenizer.json").read_bytes()
    export = tmp_path / "export" if family in EXPORTED else None
    out = train(recipe_from_dict(recipe(init, data, tmp_path / "run", export)), progress=False,
                log=lambda *a: None)
    assert first_loss(tmp_path / "run") == pytest.approx(hf_loss(init, data), abs=2e-6)
    if export is None:
        return

    exported = out.export_dir
    for name in ("tokenizer.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (init / name).read_bytes(), name
    assert json.loads((exported / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert Tokenizer.from_dir(exported).chat_template == TEMPLATE
    # it serves: the engine's greedy tokens are transformers' on the exported directory
    prompt = Tokenizer.from_dir(exported).encode("KING. Now, my good")
    ours = LLM(str(exported)).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                      min_new_tokens=6)[0, len(prompt):].tolist()
    assert list(ours[0].outputs[0].token_ids) == ref


def test_parallel_layouts_start_from_init(corpus, tmp_path):
    """TP=2 + SP + selective recompute, and PP=2: the first step's loss is transformers' (fp32)."""
    from training_parallel_worker import train_worker

    from training.distributed import free_port

    init = _model_dir(tmp_path, "llama")
    data = prepare_data([str(corpus)], tmp_path / "data", tokenizer_dir=init, log=lambda *a: None).out_dir
    plan = [(recipe(init, data, tmp_path / "tp", tensor_parallel_size=2, sequence_parallel=True,
                    recompute="selective"), False, 0),
            (recipe(init, data, tmp_path / "pp", pipeline_parallel_size=2, micro_batch_size=1), False, 0)]
    mp.start_processes(train_worker, args=(2, free_port(), plan), nprocs=2, start_method="spawn")
    ref = hf_loss(init, data)
    assert first_loss(tmp_path / "tp") == pytest.approx(ref, abs=2e-6)
    assert first_loss(tmp_path / "pp") == pytest.approx(ref, abs=2e-6)


def test_bad_init_recipes_are_refused_by_name(corpus, tmp_path):
    init = _model_dir(tmp_path, "llama")
    data = prepare_data([str(corpus)], tmp_path / "data", tokenizer_dir=init, log=lambda *a: None)
    meta = json.loads((data.out_dir / "meta.json").read_text())
    base = recipe(init, data.out_dir, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^init: .*not a model directory"):
        recipe_from_dict({**base, "init": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match=r"^model.n_layer: is set by init"):
        recipe_from_dict({**base, "model": {"n_layer": 3}})
    with pytest.raises(ConfigError, match=r"^model.dropuot: unknown key"):
        recipe_from_dict({**base, "model": {"dropuot": 0.1}})
    assert recipe_from_dict({**base, "model": {"dropout": 0.1}}).model.dropout == 0.1
    with pytest.raises(ConfigError, match=r"^train.max_steps: must be a positive integer"):
        recipe_from_dict({**base, "train": {"max_steps": 0}})
    with pytest.raises(ConfigError, match=r"^inti: unknown section"):
        recipe_from_dict({**base, "inti": str(init)})
    # data tokenized by another tokenizer than the model's
    bpe = prepare_data([str(corpus)], tmp_path / "bpe", vocab_size=300, log=lambda *a: None)
    with pytest.raises(ConfigError, match=r"^data.dir: was tokenized with another tokenizer"):
        recipe_from_dict(base, json.loads((bpe.out_dir / "meta.json").read_text()))
    recipe_from_dict(base, meta)  # its own tokenizer: accepted
    # a recipe written out (checkpoint metadata) reads back the same
    r = recipe_from_dict(base, meta)
    assert recipe_from_dict(r.to_dict()) == r


def test_a_local_ray_that_misses_its_start_wait_is_started_three_times(monkeypatch):
    """training.distributed.init_ray: Ray's "timed out during startup" (a loaded host's raylet missing
    Ray's fixed 30 s wait) is retried on a local Ray, three starts in all, then raised; a cluster's
    address and any other error get one try. ray.init is replaced by one raising Ray's own text."""
    import ray

    from training.distributed import init_ray

    calls = []

    def failing_init(*args, **kwargs):
        calls.append(kwargs)
        raise Exception("The current node timed out during startup.")  # noqa: TRY002 - the class Ray raises

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    for address, tries in ((None, 3), ("10.0.0.1:6379", 1)):
        calls.clear()
        with pytest.raises(Exception, match="timed out during startup"):
            init_ray(address, pause_s=0.0, num_cpus=2)
        assert len(calls) == tries and all(c == {"address": address, "num_cpus": 2} for c in calls)
    calls.clear()
    monkeypatch.setattr(ray, "init", lambda **k: calls.append(k) or (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError, match="bad"):
        init_ray(None, pause_s=0.0)
    assert len(calls) == 1
