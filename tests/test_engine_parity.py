"""Numerics against the reference everyone trusts: transformers, on tiny random configs (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines import LLM, SamplingParams
from engines.loading.checkpoint import load_model, save_checkpoint

torch.manual_seed(0)


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_logits_match_transformers(model_dir):
    ours, cfg = load_model(model_dir)
    ref = hf_model(model_dir)
    idx = torch.randint(0, cfg.vocab_size, (3, 40))
    with torch.no_grad():
        diff = (ours.logits(ours(idx)) - ref(idx).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_greedy_tokens_equal_transformers_generate(model_dir):
    ref = hf_model(model_dir)
    llm = LLM(model_dir)
    prompts = [[5, 17, 42, 9], list(range(30, 75)), [3]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        gen = ref.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
        expect = gen.sequences[0, len(prompt):].tolist()
        comp = out.outputs[0]
        assert comp.token_ids == expect
        assert comp.finish_reason == "length"
        # the engine's logprobs (paged decode path) equal log_softmax of the reference logits
        for step, entry in enumerate(comp.logprobs):
            ref_lp = torch.log_softmax(gen.logits[step][0].float(), -1)
            assert entry.token_id == expect[step]
            assert abs(entry.logprob - ref_lp[entry.token_id].item()) <= 1e-4
            top_ids = [t for t, _ in entry.top]
            assert top_ids == ref_lp.topk(3).indices.tolist()
            for t, lp in entry.top:
                assert abs(lp - ref_lp[t].item()) <= 1e-4


def test_prompt_logprobs_match_transformers(model_dir):
    ref = hf_model(model_dir)
    llm = LLM(model_dir, max_num_batched_tokens=16)  # the prompt is prefilled in chunks
    prompt = list(range(40, 90))
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    with torch.no_grad():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0], -1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - ref_lp[i - 1, prompt[i]].item()) <= 1e-4
        assert len(entry.top) == 2


@pytest.mark.parametrize("shard_bytes", [2**30, 40_000])
def test_saved_checkpoint_loads_in_transformers(model_dir, tmp_path, shard_bytes):
    ours, cfg = load_model(model_dir)
    out = save_checkpoint(ours, cfg, tmp_path / "saved", max_shard_bytes=shard_bytes, tokenizer_dir=model_dir)
    if shard_bytes < 2**30:
        assert (out / "model.safetensors.index.json").is_file()
    ref = hf_model(out)
    again, _ = load_model(out)
    idx = torch.randint(0, cfg.vocab_size, (2, 33))
    with torch.no_grad():
        mine = ours.logits(ours(idx))
        assert (mine - ref(idx).logits).abs().max().item() <= 1e-4
        assert torch.equal(mine, again.logits(again(idx)))
    assert (out / "tokenizer.json").is_file()


def test_legacy_bin_loads_weights_only(model_dir, tmp_path):
    from safetensors.torch import load_file

    d = tmp_path / "legacy"
    d.mkdir()
    (d / "config.json").write_text((model_dir / "config.json").read_text())
    torch.save(load_file(model_dir / "model.safetensors"), d / "pytorch_model.bin")
    ours, cfg = load_model(d)
    ref = hf_model(model_dir)
    idx = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert (ours.logits(ours(idx)) - ref(idx).logits).abs().max().item() <= 1e-4


def test_pickled_objects_are_refused(model_dir, tmp_path):
    from engines.loading.checkpoint import CheckpointError

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    d = tmp_path / "evil"
    d.mkdir()
    (d / "config.json").write_text((model_dir / "config.json").read_text())
    torch.save({"x": Evil()}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights-only"):
        load_model(d)


def test_bf16_engine_runs_close_to_fp32(gpt2_dir):
    prompt = list(range(10, 40))
    fp32 = LLM(gpt2_dir).generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=0))[0]
    bf16 = LLM(gpt2_dir, dtype="bfloat16").generate([prompt], SamplingParams(max_tokens=4, temperature=0,
                                                                              logprobs=0))[0]
    assert bf16.outputs[0].token_ids[0] == fp32.outputs[0].token_ids[0]
    assert abs(bf16.outputs[0].logprobs[0].logprob - fp32.outputs[0].logprobs[0].logprob) < 0.1


def test_config_round_trip(model_dir):
    from engines.core.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    raw = json.loads((model_dir / "config.json").read_text())
    assert cfg.vocab_size == raw["vocab_size"]


def test_engine_model_has_no_dropout_modules(gpt2_dir):
    """HF GPT-2 configs ask for dropout 0.1: the engine's copy drops the modules (no-ops in eval, ~3 us
    of calls each), the loaded model keeps them, and the engine's tokens still equal transformers'
    (test_greedy_tokens_equal_transformers_generate)."""
    loaded, cfg = load_model(gpt2_dir)
    assert cfg.dropout > 0 and any(isinstance(m, torch.nn.Dropout) for m in loaded.modules())
    engine_model = LLM(gpt2_dir).engine.executor.runner.model
    assert not any(isinstance(m, torch.nn.Dropout) for m in engine_model.modules())
