"""Bad input gets a clear exception naming the problem and leaves other requests untouched."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from engines import LLM, AsyncLLMEngine, EngineConfig, RequestError, SamplingParams
from engines.core.config import ConfigError
from engines.loading.checkpoint import CheckpointError


@pytest.mark.parametrize("field,value,match", [
    ("max_tokens", 0, "max_tokens"), ("max_tokens", -3, "max_tokens"), ("temperature", -0.1, "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("top_k", -2, "top_k"), ("n", 0, "n"),
    ("logprobs", 21, "logprobs"), ("presence_penalty", 3.0, "presence_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("min_tokens", 50, "min_tokens"), ("stop", [""], "stop"),
    ("temperature", float("inf"), "finite"), ("temperature", float("nan"), "finite"), ("stop", 5, "stop"),
    ("stop_token_ids", 3, "stop_token_ids"),
])
def test_sampling_params_are_validated(field, value, match):
    with pytest.raises(RequestError, match=match) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_no_stop_given_as_none():
    """None for stop and stop_token_ids is no stop (as an OpenAI request's null), not a TypeError naming nothing."""
    p = SamplingParams(stop=None, stop_token_ids=None)
    assert p.stop == () and p.stop_token_ids == ()


def test_missing_directory():
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM("/nonexistent/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(tmp_path)


def test_malformed_config(gpt2_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gpt2_dir, d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LLM(d)


def test_unsupported_model_type(gpt2_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gpt2_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "bert"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'bert'"):
        LLM(d)


def test_missing_weights_and_wrong_shapes(gpt2_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(gpt2_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no weights"):
        LLM(d)
    shutil.copy(gpt2_dir / "model.safetensors", d / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    cfg["n_embd"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        LLM(d)


def test_config_errors_name_the_field():
    from engines.core.config import ModelConfig

    with pytest.raises(ConfigError, match="n_embd"):
        ModelConfig(model_type="gpt2", vocab_size=10, n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM("/x", max_num_sequences=3)


@pytest.fixture(scope="module")
def llm(gpt2_dir):
    return LLM(gpt2_dir, num_kv_blocks=20, block_size=8)


@pytest.mark.parametrize("prompt,params,param,code", [
    ("", SamplingParams(), "prompt", None),
    ([], SamplingParams(), "prompt", None),
    ([1, 2, 10**6], SamplingParams(), "prompt", "invalid_token_id"),
    ([1, -1], SamplingParams(), "prompt", "invalid_token_id"),
    ("x " * 300, SamplingParams(), "prompt", "context_length_exceeded"),
    ([1] * 200, SamplingParams(max_tokens=100), "max_tokens", "context_length_exceeded"),
    ([1] * 150, SamplingParams(max_tokens=100), "max_tokens", "kv_cache_too_small"),
    ([1, 2], SamplingParams(logprobs=20), None, None),
])
def test_bad_requests(llm, prompt, params, param, code):
    if param is None:  # a valid edge: logprobs=20 is allowed
        llm.generate([prompt], params)
        return
    with pytest.raises(RequestError) as err:
        llm.generate([prompt], params)
    assert err.value.param == param
    if code:
        assert err.value.code == code
    assert str(err.value).startswith(param)


def test_a_request_the_cache_cannot_hold_says_what_max_tokens_would_fit(llm):
    """20 blocks of 8 tokens: a 10-token prompt with no max_tokens (up to the 256-token context) is refused with the
    max_tokens that would fit (150), and says that none was set, rather than telling the caller to lower one."""
    with pytest.raises(RequestError, match=r"not set: up to the context window of 256.*max_tokens <= 150") as err:
        llm.generate([[1] * 10], SamplingParams(max_tokens=None))
    assert err.value.param == "max_tokens" and err.value.code == "kv_cache_too_small"
    assert llm.generate([[1] * 10], SamplingParams(max_tokens=150, ignore_eos=True))[0].outputs[0].finish_reason == "length"


def test_bad_request_leaves_others_untouched(gpt2_dir):
    """An invalid request among running ones fails alone; the others finish exactly as alone."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expect = LLM(gpt2_dir).generate(["To be, or not"], params)[0].outputs[0].token_ids
    engine = AsyncLLMEngine.from_model_dir(gpt2_dir, EngineConfig())

    async def good(i):
        toks = []
        async for out in engine.generate(f"g{i}", "To be, or not", params):
            toks += out.outputs[0].token_ids_delta
        return toks

    async def bad(prompt, sp):
        await asyncio.sleep(0.01)
        with pytest.raises(RequestError):
            async for _ in engine.generate(f"b{prompt!r}", prompt, sp):
                pass
        return "rejected"

    async def main():
        return await asyncio.gather(good(0), bad([10**7], params), good(1), bad("", params),
                                    bad([1] * 300, params))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert results[0] == expect and results[2] == expect
    assert results[1] == results[3] == results[4] == "rejected"


def test_async_abort_frees_blocks(gpt2_dir):
    engine = AsyncLLMEngine.from_model_dir(gpt2_dir, EngineConfig())

    async def main():
        agen = engine.generate("a", list(range(1, 60)), SamplingParams(max_tokens=150, ignore_eos=True))
        async for out in agen:
            assert engine.stats()["kv_cache_usage"] > 0
            break
        await agen.aclose()
        await engine.abort("a")  # returns once the loop has processed it
        return engine.stats()

    try:
        stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert stats["kv_cache_usage"] == 0 and stats["num_running"] == 0


def test_engine_failure_fails_requests_clearly(gpt2_dir):
    from engines.core.async_engine import EngineDeadError

    engine = AsyncLLMEngine.from_model_dir(gpt2_dir, EngineConfig())

    def boom(plan):
        raise RuntimeError("worker exploded")

    engine.engine.executor.execute = boom

    async def main():
        with pytest.raises(EngineDeadError, match="worker exploded"):
            async for _ in engine.generate("x", [1, 2, 3], SamplingParams()):
                pass
        with pytest.raises(EngineDeadError):
            engine.check_health()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
