"""/openapi.json describes the real API, and schemathesis fuzzes a live server (real HTTP, uvicorn,
the real engine on a tiny model) with valid and invalid requests generated from it: no 5xx, every
response conforms to the document, invalid requests are refused with 4xx, the server stays healthy.
Bounded and seeded: EXAMPLES per operation and mode, derandomized."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from deploy.schema import validate_config
from serving.app import create_local_app
from serving.protocol import MAX_COMPLETION_LOGPROBS, MAX_N, MAX_STOP
from training.distributed import free_port

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = 12
STATS: dict = {"cases": 0, "by_status": {}}


@pytest.fixture(scope="module")
def url(gpt2_dir):
    cfg = validate_config({"models": [{"name": "gpt2", "path": str(gpt2_dir), "max_waiting": 16,
                                       "engine": {"num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 96,
                                                  "cpu_linear_autotune": False}}],
                           "server": {"log_requests": False, "request_timeout_s": 30}})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_local_app(cfg), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(30)


def test_openapi_document_carries_the_real_limits(url):
    doc = httpx.get(f"{url}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v2/models/{name}/infer",
                 "/v2/models/{name}/generate", "/v2/health/ready"):
        assert path in doc["paths"], path
    comp = doc["components"]["schemas"]["CompletionRequest"]
    assert comp["additionalProperties"] is False and set(comp["required"]) == {"model", "prompt"}
    n = next(s for s in comp["properties"]["n"]["anyOf"] if s.get("type") == "integer")
    assert (n["minimum"], n["maximum"]) == (1, MAX_N)
    lp = next(s for s in comp["properties"]["logprobs"]["anyOf"] if s.get("type") == "integer")
    assert lp["maximum"] == MAX_COMPLETION_LOGPROBS
    assert comp["properties"]["stop"]["anyOf"][1]["maxItems"] == MAX_STOP
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}


def _operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance, status_code_conformance]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_5xx_and_no_schema_violation(url, mode):
    ops = _operations(url)
    assert len(ops) >= 15
    checks = [*CHECKS, negative_data_rejection] if mode == GenerationMode.NEGATIVE else CHECKS
    failures = []
    with httpx.Client(timeout=60) as client:
        for op in ops:
            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                if case.body is not None and isinstance(case.body, dict) and case.path.startswith("/v1/"):
                    # keep generation short: the fuzzer's max_tokens may be huge (still validated)
                    case.body.setdefault("max_tokens", 4)
                try:
                    r = case.call_and_validate(base_url=url, checks=checks, timeout=60)
                except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - collect every failing operation, then report
                    failures.append(f"{case.operation.label}: {str(exc)[:400]}")
                    return
                STATS["cases"] += 1
                STATS["by_status"][r.status_code] = STATS["by_status"].get(r.status_code, 0) + 1

            try:
                run()
            except Unsatisfiable:  # no invalid input exists for this operation (a GET without parameters)
                STATS["unsatisfiable"] = STATS.get("unsatisfiable", 0) + 1
        assert client.get(f"{url}/health").status_code == 200  # healthy after the fuzzing
        with contextlib.suppress(Exception):
            print(f"schemathesis {mode.value}: {STATS}")
    assert not failures, "\n".join(failures[:10])
