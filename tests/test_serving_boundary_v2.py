"""The KServe v2 boundary over real HTTP (uvicorn on 127.0.0.1, the real engine on a tiny model) and
the official `tritonclient.http`: errors in the v2 shape that tritonclient can print, naming the
field as the v2 request sent it; tensor values checked against their datatype; compressed bodies;
the model's generation_config.json defaults; and a client that leaves stops its generation."""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import time
import zlib

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from test_serving_app import MODEL
from test_serving_faults import make_core, serve_http
from tritonclient.utils import InferenceServerException

MAX_BODY = 64 * 1024
V2 = f"/v2/models/{MODEL}"
TEXT = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["To be"]}


def tensor(name: str, dtype: str, value) -> triton.InferInput:
    t = triton.InferInput(name, list(np.shape(value)) or [1], dtype)
    arr = np.array(value, dtype=np.object_ if dtype == "BYTES" else triton.triton_to_np_dtype(dtype))
    t.set_data_from_numpy(arr.reshape(t.shape()))
    return t


def scalar(name: str, dtype: str, value) -> dict:
    return {"name": name, "datatype": dtype, "shape": [1], "data": [value]}


@pytest.fixture(scope="module")
def url(gpt2_dir):
    # capacity 4 running + 4 waiting sequences: 9 prompts can never be admitted
    core = make_core(gpt2_dir)
    with serve_http(core, max_body_bytes=MAX_BODY) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    c = triton.InferenceServerClient(url=url.removeprefix("http://"))
    yield c
    c.close()


def refused(client: triton.InferenceServerClient, inputs: list, **kw) -> str:
    """str() of the InferenceServerException that `infer` raises (a TypeError if its error is not a string)."""
    with pytest.raises(InferenceServerException) as e:
        client.infer(MODEL, inputs, **kw)
    assert e.value.status() == "400", str(e.value)
    return str(e.value)


def v2_error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert isinstance(body["error"], str) and body["error"], body
    assert body["param"] == param, body
    return body["error"]


def test_tritonclient_prints_errors_naming_the_tensor(client):
    msg = refused(client, [tensor("text_input", "BYTES", [b"To be"]), tensor("max_tokens", "FP32", [3.7])])
    assert "inputs[max_tokens]" in msg and "parameters" not in msg, msg
    # a request parameter is named where it was sent; a limit beyond the context names it too
    msg = refused(client, [tensor("text_input", "BYTES", [b"To be"])], parameters={"max_tokens": 999})
    assert msg.startswith("[400] parameters.max_tokens: ") and "context window" in msg, msg
    msg = refused(client, [tensor("text_input", "BYTES", [b"To be"]), tensor("top_k", "INT32", [-5])])
    assert "inputs[top_k]" in msg, msg


def test_engine_and_limit_errors_name_the_v2_fields(client, url):
    msg = refused(client, [tensor("text_input", "BYTES", [b"To be"] * 9)])
    assert msg.startswith("[400] inputs[text_input]: the request asks for 9 sequences") and "n:" not in msg, msg
    long = " ".join(["word"] * 400)  # past the model's 256 positions
    msg = refused(client, [tensor("text_input", "BYTES", [long.encode()])])
    assert msg.startswith("[400] inputs[text_input]: ") and "prompt" not in msg.split(":")[0], msg
    # the generate extension: fields at the top level keep their names, nested ones are parameters.<name>
    r = httpx.post(f"{url}{V2}/generate", json={"text_input": long}, timeout=30)
    assert v2_error(r, 400, "text_input").startswith("text_input: ")
    r = httpx.post(f"{url}{V2}/generate", json={"text_input": "x", "parameters": {"max_tokens": 999}}, timeout=30)
    assert v2_error(r, 400, "parameters.max_tokens").startswith("parameters.max_tokens: ")
    r = httpx.post(f"{url}{V2}/generate", json={"text_input": "x", "max_tokens": 999}, timeout=30)
    assert v2_error(r, 400, "max_tokens").startswith("max_tokens: ")
    r = httpx.post(f"{url}{V2}/generate", json={"text_input": "x", "top_p": 3}, timeout=30)
    assert "'top_p'" in v2_error(r, 400, "top_p")
    with httpx.stream("POST", f"{url}{V2}/generate_stream", json={"text_input": "x", "parameters": {"max_tokens": 999}},
                      timeout=30) as r:
        r.read()
        v2_error(r, 400, "parameters.max_tokens")


def test_every_v2_error_has_the_string_body(client, url):
    assert "no route" in v2_error(httpx.get(f"{url}/v2/models/{MODEL}/nothing", timeout=30), 404, None)
    v2_error(httpx.get(f"{url}/v2/models/nope", timeout=30), 404, "model")
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata("nope")
    assert "'nope' does not exist" in str(e.value)
    # the OpenAI routes keep OpenAI's body
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(("name", "dtype", "value", "why"), [
    ("ignore_eos", "BOOL", "false", "JSON true or false"),
    ("ignore_eos", "BOOL", 0, "JSON true or false"),
    ("max_tokens", "INT32", 5_000_000_000, "integers in [-2147483648, 2147483647]"),
    ("max_tokens", "UINT8", -1, "integers in [0, 255]"),
    ("max_tokens", "INT64", 2.0, "integers in"),
    ("temperature", "FP32", "0.5", "finite numbers"),
    ("temperature", "FP32", 1e39, "finite numbers within FP32's range"),
])
def test_json_tensor_values_are_checked_against_their_datatype(url, name, dtype, value, why):
    r = httpx.post(f"{url}{V2}/infer", json={"inputs": [TEXT, scalar(name, dtype, value)]}, timeout=30)
    msg = v2_error(r, 400, f"inputs[{name}]")
    assert msg.startswith(f"inputs[{name}]: {dtype} data must be {why}"), msg


def test_non_finite_floats_are_refused_json_and_binary(client, url):
    raw = json.dumps({"inputs": [TEXT, scalar("temperature", "FP32", float("nan"))]})  # Python writes NaN
    r = httpx.post(f"{url}{V2}/infer", content=raw, headers={"content-type": "application/json"}, timeout=30)
    v2_error(r, 400, "inputs[temperature]")
    msg = refused(client, [tensor("text_input", "BYTES", [b"To be"]), tensor("temperature", "FP32", [np.inf])])
    assert "inputs[temperature]: FP32 data must be finite" in msg, msg


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests(client, algorithm):
    inputs = [tensor("text_input", "BYTES", [b"To be, or not"]), tensor("max_tokens", "INT32", [4]),
              tensor("temperature", "FP32", [0.0])]
    want = client.infer(MODEL, inputs).as_numpy("text_output")[0]
    got = client.infer(MODEL, inputs, request_compression_algorithm=algorithm).as_numpy("text_output")[0]
    assert got == want


def test_compressed_body_limits_and_unknown_encodings(url):
    body = json.dumps({"text_input": "To be", "max_tokens": 2, "temperature": 0}).encode()
    plain = httpx.post(f"{url}{V2}/generate", content=body, timeout=30).json()["text_output"]
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                      ("deflate", zlib.compress(body, wbits=-15))):  # raw deflate too
        r = httpx.post(f"{url}{V2}/generate", content=data, headers={"content-encoding": enc}, timeout=30)
        assert r.status_code == 200 and r.json()["text_output"] == plain, (enc, r.text)
    bomb = gzip.compress(b" " * (MAX_BODY * 50))  # ~3 MB of JSON whitespace in a few KB
    assert len(bomb) < MAX_BODY
    r = httpx.post(f"{url}{V2}/infer", content=bomb, headers={"content-encoding": "gzip"}, timeout=30)
    assert "decompresses (gzip) to more than the limit" in v2_error(r, 413, None)
    r = httpx.post(f"{url}{V2}/infer", content=body, headers={"content-encoding": "br"}, timeout=30)
    assert v2_error(r, 415, None).startswith("Content-Encoding: 'br' is not supported")
    r = httpx.post(f"{url}{V2}/infer", content=gzip.compress(body)[:-12], headers={"content-encoding": "gzip"},
                   timeout=30)
    assert "truncated" in v2_error(r, 400, None)


def test_v2_uses_the_models_generation_defaults(gpt2_dir, tmp_path):
    d = tmp_path / "gen"
    shutil.copytree(gpt2_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    with serve_http(make_core(d)) as (base, _):
        greedy = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "To be", "temperature": 0,
                                                            "max_tokens": 3}, timeout=30).json()
        assert greedy["usage"]["completion_tokens"] == 3
        want = greedy["choices"][0]["text"]
        for _ in range(3):  # unset temperature and max_tokens: the file's greedy and 3 tokens, every time
            r = httpx.post(f"{base}{V2}/generate", json={"text_input": "To be"}, timeout=30)
            assert r.status_code == 200 and r.json()["text_output"] == want, r.text
            r = httpx.post(f"{base}{V2}/infer", json={"inputs": [TEXT]}, timeout=30)
            assert r.json()["outputs"][0]["data"] == [want], r.text
        # a value the request sets wins
        r = httpx.post(f"{base}{V2}/generate", json={"text_input": "To be", "max_tokens": 6, "ignore_eos": True,
                                                     "temperature": 0}, timeout=30)
        assert r.json()["text_output"].startswith(want) and r.json()["text_output"] != want


@pytest.mark.parametrize("route", ["infer", "generate"])
def test_a_client_that_leaves_stops_its_generation(gpt2_dir, route):
    core = make_core(gpt2_dir, step_delay_s=0.03)  # 240 tokens: over 7 s of generation
    body = ({"inputs": [TEXT], "parameters": {"max_tokens": 240, "ignore_eos": True}} if route == "infer" else
            {"text_input": "To be", "max_tokens": 240, "ignore_eos": True})

    async def main(base: str) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            call = asyncio.ensure_future(c.post(f"{V2}/{route}", json=body))
            deadline = time.monotonic() + 10
            while core.engine.stats()["num_running"] < 1:
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.01)
            call.cancel()  # the client gives up: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await call
        t0 = time.monotonic()
        while core.admitted or core.engine.stats()["num_running"]:
            assert time.monotonic() - t0 < 3, "the generation went on after its client left"
            await asyncio.sleep(0.02)

    with serve_http(core) as (base, _):
        asyncio.run(main(base))
        r = httpx.post(f"{base}{V2}/generate", json={"text_input": "To be", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200  # the engine serves the next request
