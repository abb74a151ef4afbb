"""The families people serve, against transformers on tiny random configs (fp32): Llama with each
rope scaling type, Qwen2 (qkv biases), Qwen3 (q/k norm, explicit head_dim), Mistral; alone and,
each of llama (llama3 rope), qwen2, qwen3 and mistral, as TP=2 (threads) and PP=2 (processes, gloo)
shards against one device; configs refused by name; generation_config's EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import train_tokenizer
from parallel_fixtures import PROMPTS, LogitsRecorder, ThreadTPExecutor, max_logit_error, run_engine
from transformers import AutoConfig, AutoModelForCausalLM

from engines import LLM, SamplingParams
from engines.core.config import ConfigError, EngineConfig, ModelConfig
from engines.core.executor import InProcessExecutor
from engines.loading.checkpoint import load_model, save_checkpoint
from engines.parallel.mp_executor import MultiprocExecutor

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 0}
FAMILIES = {
    "llama": ("llama", {}),
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # explicit head_dim: 4 heads x 32 != hidden 64
    "mistral": ("mistral", {"sliding_window": None}),
}


def family_checkpoint(out: Path, name: str, **overrides) -> Path:
    model_type, extra = FAMILIES[name]
    out.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(out)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{"vocab_size": vocab, **LLAMA, **extra, **overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # wide weights: logits far from ties, so greedy comparisons are robust
        for n, p in model.named_parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else (p.normal_(1.0, 0.1) if "norm" in n else p.normal_(0, 0.1))
    model.eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This file's own torch work (transformers' references, load_model, the reference forwards, the thread
    shards) on one intra-op thread; the engines set their own counts (worker_threads, engine_threads). Its
    tensors are tiny (hidden 64): on the pytest worker's default two threads every op paid an OpenMP fork-join,
    which on make test's 4 workers over 2 cores waits for a descheduled partner (tests/test_training_parallel.py
    measured 8x the CPU for such a model's steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = family_checkpoint(tmp_path_factory.mktemp(name), name)
        return made[name]
    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_transformers(ckpt, name):
    d = ckpt(name)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours, cfg = load_model(d)
    assert cfg.model_type == FAMILIES[name][0]
    idx = torch.randint(0, cfg.vocab_size, (2, 100))  # past every original_max_position_embeddings above
    with torch.no_grad():
        diff = (ours.logits(ours(idx)) - ref(idx).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # the engine's paged path (prefill in chunks + decode) gives transformers' greedy tokens
    llm = LLM(d, max_num_batched_tokens=32)
    prompts = [list(range(5, 60)), [3, 9, 4]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, out in zip(prompts, outs):
        gen = ref.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == gen[0, len(p):].tolist()


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "yarn"])
def test_family_round_trips_through_our_writer(ckpt, name, tmp_path):
    """What we write for a family, transformers loads with the same logits (and we read it back)."""
    ours, cfg = load_model(ckpt(name))
    out = save_checkpoint(ours, cfg, tmp_path / "ours", tokenizer_dir=ckpt(name))
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ModelConfig.from_dir(out) == cfg
    idx = torch.randint(0, cfg.vocab_size, (1, 60))
    with torch.no_grad():
        assert (ours.logits(ours(idx)) - ref(idx).logits).abs().max().item() <= 1e-4


SHARDED = ["llama3", "qwen2", "qwen3", "mistral"]
"""One checkpoint of each family (Llama with llama3 rope scaling), each run as TP=2 and PP=2 shards."""


def _sharded_run(d: Path, executor, base: EngineConfig) -> tuple[dict, float]:
    """Greedy tokens of PROMPTS on `executor`, and the largest |logit - one full forward on one device|."""
    rec = LogitsRecorder(executor)
    try:
        got, _ = run_engine(d, rec, base)
    finally:
        executor.shutdown()
    return got, max_logit_error(d, PROMPTS, got, rec.logits)


@pytest.fixture(scope="module")
def one_device(ckpt):
    """Greedy tokens of PROMPTS on one in-process device, per family: computed once and shared by the
    thread-TP and the process-shard tests (qwen2 is the reference of three of them)."""
    made: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in made:
            d = ckpt(name)
            base = EngineConfig(num_kv_blocks=64, worker_threads=1)
            made[name], _ = run_engine(d, InProcessExecutor(d, base), base)
        return made[name]
    return get


@pytest.mark.parametrize("name", SHARDED)
def test_family_tp2_matches_one_device(ckpt, one_device, name):
    """TP=2 as threads over one process (the tensor-parallel layers and runner, no process group)."""
    d = ckpt(name)
    base = EngineConfig(num_kv_blocks=64, worker_threads=1)
    expect = one_device(name)
    got, err = _sharded_run(d, ThreadTPExecutor(d, base.replace(tensor_parallel_size=2)), base)
    assert got == expect and len(got) == len(PROMPTS)
    assert err <= 1e-4, err


@pytest.mark.parametrize(("name", "tp", "pp"), [(n, 1, 2) for n in SHARDED] + [("qwen2", 2, 1)],
                         ids=[f"pp2-{n}" for n in SHARDED] + ["tp2-qwen2"])
def test_family_shards_match_one_device(ckpt, one_device, name, tp, pp):
    """Shards as processes (gloo) that load only their slice: PP=2 for every family, and TP=2 where
    the loader slices a bias (Qwen2's qkv)."""
    d = ckpt(name)
    base = EngineConfig(num_kv_blocks=64, worker_threads=1, dist_timeout_s=60)
    expect = one_device(name)
    got, err = _sharded_run(d, MultiprocExecutor(d, base.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp)),
                            base)
    assert got == expect and len(got) == len(PROMPTS)
    assert err <= 1e-4, err


def _config(**changes) -> dict:
    return {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096, **changes}


def test_unsupported_configs_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type 'longrope' unsupported; supported: default"):
        ModelConfig.from_hf(_config(rope_scaling={"rope_type": "longrope", "factor": 2.0}))
    with pytest.raises(ConfigError, match=r"rope_scaling: rope type 'llama3' needs low_freq_factor"):
        ModelConfig.from_hf(_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16}))
    with pytest.raises(ConfigError, match=r"sliding_window=1024 is shorter than max_position_embeddings=4096"):
        ModelConfig.from_hf(_config(model_type="mistral", sliding_window=1024))
    # a window as long as the context is plain causal attention; Qwen's window is off unless asked for
    assert ModelConfig.from_hf(_config(model_type="mistral", sliding_window=4096)).model_type == "mistral"
    assert ModelConfig.from_hf(_config(model_type="qwen2", sliding_window=1024)).qkv_bias
    with pytest.raises(ConfigError, match="sliding_window=1024"):
        ModelConfig.from_hf(_config(model_type="qwen2", sliding_window=1024, use_sliding_window=True))


def test_generation_config_eos_ids_end_generation(ckpt, tmp_path):
    """Llama 3 style: config.json's EOS is <|end_of_text|>, generation_config.json adds <|eot_id|>."""
    import shutil

    d = shutil.copytree(ckpt("llama"), tmp_path / "m")
    free = LLM(d).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    eot = free.outputs[0].token_ids[5]  # the 6th greedy token becomes an end-of-turn id
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eot]}))
    assert eot in ModelConfig.from_dir(d).eos_token_id
    out = LLM(d).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    first = free.outputs[0].token_ids.index(eot)
    assert out.finish_reason == "stop" and out.token_ids == free.outputs[0].token_ids[:first + 1][:len(out.token_ids)]
    assert len(out.token_ids) <= first + 1


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_family_fp8_file_and_online_quantization_agree(ckpt, name, tmp_path):
    """FP8 leaves Qwen2's qkv biases and Qwen3's q/k norms alone: the FP8 file we write and online
    quantization at load give the same greedy tokens, close to the float model's logits."""
    d = ckpt(name)
    ours, cfg = load_model(d)
    fp8_dir = save_checkpoint(ours, cfg, tmp_path / "fp8", tokenizer_dir=d, fp8=True)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [list(range(5, 40)), [3, 9, 4]]
    online = [o.outputs[0].token_ids for o in LLM(d, weight_dtype="fp8").generate(prompts, params)]
    from_file = [o.outputs[0].token_ids for o in LLM(fp8_dir).generate(prompts, params)]
    assert online == from_file


def test_chat_template_jinja_file_is_read(tmp_path):
    """transformers 5 saves the chat template as chat_template.jinja, not inside tokenizer_config.json."""
    from tokenizers import Tokenizer, models

    from engines.loading.tokenizer import Tokenizer as OurTokenizer
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert OurTokenizer.from_dir(tmp_path).chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
