"""generation_config.json's sampling values (temperature, top_p, top_k, repetition_penalty,
max_new_tokens) are the defaults of requests that leave those fields unset, offline and over the
OpenAI API (as vLLM's `--generation-config auto`); a value the request sets always wins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_serving_app import MODEL, local_client

from engines import LLM, SamplingParams
from engines.core.sampling_params import generation_defaults
from engines.model.model_config import ConfigError
from serving.gateway import sampling_params

GEN = {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "max_new_tokens": 3,
       "do_sample": True}
"""Greedy by default, and 3 new tokens: both observable in the outputs of a request that sets neither."""


@pytest.fixture(scope="module")
def gen_dir(gpt2_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gen") / "gpt2"
    shutil.copytree(gpt2_dir, d)
    path = d / "generation_config.json"
    base = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**base, **GEN}))
    return d


def test_generation_defaults_read_as_sampling_fields(gen_dir, gpt2_dir, tmp_path):
    assert generation_defaults(gen_dir) == {"temperature": 0.0, "top_p": 0.9, "top_k": 5,
                                            "repetition_penalty": 1.1, "max_tokens": 3}
    assert generation_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p: must be in \(0, 1\]"):
        generation_defaults(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="generation_config.json: must hold a JSON object"):
        generation_defaults(tmp_path)


def test_offline_defaults_and_explicit_params_win(gen_dir):
    llm = LLM(str(gen_dir), dtype="float32", num_kv_blocks=64, cpu_linear_autotune=False)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.0, 0.9, 5, 1.1, 3)
    out = llm.generate(["to be or not"])[0].outputs[0]  # no params: the file's (greedy, 3 tokens)
    greedy = llm.generate(["to be or not"], SamplingParams(temperature=0, top_p=0.9, top_k=5,
                                                           repetition_penalty=1.1, max_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 3 and list(out.token_ids) == list(greedy.token_ids)
    explicit = llm.generate(["to be or not"], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(explicit.token_ids) == 5  # an explicit SamplingParams is used as given


def test_gateway_fills_only_unset_fields():
    defaults = {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    p = sampling_params(defaults, temperature=0.7, max_tokens=9)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.7, 5, 9)
    assert sampling_params(None, top_p=0.5).temperature == SamplingParams().temperature


@pytest.fixture(scope="module")
def client(gen_dir):
    with local_client(gen_dir) as c:
        yield c


def test_openai_requests_use_the_model_defaults(client):
    def completion(**body):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "to be or not", **body})
        assert r.status_code == 200, r.text
        return r.json()

    unset = completion()
    assert unset["usage"]["completion_tokens"] == 3  # max_new_tokens, not the API's 16
    assert unset["choices"][0]["text"] == completion(temperature=0, max_tokens=3)["choices"][0]["text"]  # greedy
    assert completion(max_tokens=5, ignore_eos=True)["usage"]["completion_tokens"] == 5  # the request wins
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
