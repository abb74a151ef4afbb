"""Structured output through the real server and the official openai client: response_format
(json_object, json_schema) and tools (tool_choice "required" and a named function), streaming and
not. The model has random weights, so its unconstrained text is junk: output that parses and
validates against the schema (jsonschema) shows the grammar did it. Plus the refusals (a schema
the grammar compiler refuses, tool_choice "auto") and, in the engine, a constrained and an
unconstrained request in one batch (the unconstrained one's tokens as if it ran alone)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from deploy.schema import validate_config
from serving.app import create_local_app
from training.distributed import free_port

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"},
                         "tier": {"enum": ["gold", "silver"]}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 5}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_person", "parameters": PERSON}}]
SCHEMAS = {"get_weather": WEATHER, "get_person": PERSON}
MSG = [{"role": "user", "content": "Tell me about it."}]
KW = {"model": "gpt2", "max_tokens": 80, "seed": 7}


@pytest.fixture(scope="module")
def url(gpt2_dir):
    cfg = validate_config({"models": [{"name": "gpt2", "path": str(gpt2_dir), "engine": {
        "num_kv_blocks": 128, "max_num_seqs": 8, "max_model_len": 200, "cpu_linear_autotune": False}}],
        "server": {"log_requests": False}})
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_local_app(cfg), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _collect(stream) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index with joined arguments, finish_reason) of a chat stream."""
    text, calls, finish = "", {}, None
    for ev in stream:
        for ch in ev.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.id or c["id"]
                c["name"] = (tc.function.name if tc.function else None) or c["name"]
                c["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return text, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    texts = []
    for seed in (1, 2):
        kw = {**KW, "seed": seed, "temperature": 1.0}
        if stream:
            text, _, finish = _collect(client.chat.completions.create(messages=MSG, response_format=fmt,
                                                                      stream=True, **kw))
        else:
            r = client.chat.completions.create(messages=MSG, response_format=fmt, **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
        texts.append(text)
    # completions too (vLLM accepts response_format there); greedy
    r = client.completions.create(prompt="Once upon", extra_body={"response_format": fmt}, stream=stream,
                                  temperature=0, **{k: v for k, v in KW.items() if k != "seed"})
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object_is_an_object(client):
    """Any JSON object: a random model may run to max_tokens inside one (finish "length"); every
    completion that ends must be an object, and some end (n=4, seeded)."""
    r = client.chat.completions.create(messages=MSG, response_format={"type": "json_object"}, n=4,
                                       temperature=1.0, **{**KW, "max_tokens": 60})
    ended = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert ended, [c.message.content for c in r.choices]
    for text in ended:
        assert isinstance(json.loads(text), dict)
    for c in r.choices:  # an unfinished one is still the start of an object
        assert c.message.content.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_required_and_named(client, stream):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = {**KW, "max_tokens": 160, "messages": MSG, "tools": TOOLS, "tool_choice": choice,
              "parallel_tool_calls": False}  # one call: a random model's array may run long
        if stream:
            text, by_index, finish = _collect(client.chat.completions.create(stream=True, **kw))
            calls = [by_index[i] for i in sorted(by_index)]
        else:
            r = client.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            text = msg.content
            calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                     for c in msg.tool_calls or []]
        assert finish == "tool_calls" and not text and calls, (choice, text, finish)
        for c in calls:
            assert c["id"].startswith("call_")
            if isinstance(choice, dict):
                assert c["name"] == "get_weather"
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_refusals_name_the_field(url):
    body = {"model": "gpt2", "messages": MSG, "max_tokens": 4}
    with httpx.Client(timeout=60) as c:
        bad = {"type": "integer", "minimum": 5, "maximum": 1}
        r = c.post(f"{url}/v1/chat/completions", json={**body, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema" and "minimum" in err["message"], err
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "("}}}]
        r = c.post(f"{url}/v1/chat/completions", json={**body, "tools": tools, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text
        r = c.post(f"{url}/v1/chat/completions", json={**body, "tools": TOOLS})  # tool_choice auto by default
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        r = c.post(f"{url}/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "nope"}}})
        assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text
        r = c.post(f"{url}/v1/chat/completions", json={**body, "response_format": {"type": "json_object"},
                                                       "ignore_eos": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text
        r = c.post(f"{url}/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"].get("tool_calls") is None, r.text


def test_engine_batch_mixes_constrained_and_plain(gpt2_dir):
    from engines import LLM, SamplingParams
    from engines.runner.grammar import StructuredOutput

    llm = LLM(gpt2_dir, cpu_linear_autotune=False, num_kv_blocks=64, max_model_len=200)
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate(["the cat sat"], plain)[0].outputs[0]
    shaped = SamplingParams(max_tokens=80, temperature=0, structured=StructuredOutput.json_schema(PERSON, "x"))
    free = llm.generate(["hello there"], SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    both = llm.generate(["hello there", "the cat sat"], [shaped, plain])
    assert both[1].outputs[0].token_ids == alone.token_ids
    text = both[0].outputs[0].text
    assert both[0].outputs[0].finish_reason == "stop" and text != free
    jsonschema.validate(json.loads(text), PERSON)


def _sampler_pair(gpt2_dir):
    """Two samplers over the tiny model's vocabulary: one checks a constrained row's own choice first
    (the default), one masks every constrained row first (the reference)."""
    import torch

    from engines.loading.tokenizer import Tokenizer
    from engines.runner.grammar import Grammars, tokenizer_bytes
    from engines.runner.sampler import Sampler

    vocab = Tokenizer.from_dir(gpt2_dir).vocab_size
    grammars = Grammars(tokenizer_bytes(gpt2_dir), vocab)
    first, masked = (Sampler(vocab, 0, torch.device("cpu"), grammars=grammars) for _ in range(2))
    masked.check_first = False
    return vocab, grammars, first, masked


def _init(seq_id: int, params):
    from engines.core.plan import SeqInit

    return SeqInit(seq_id, 0, params, [1, 2, 3], (0,))


def test_check_first_greedy_equals_masked_first(gpt2_dir):
    """Greedy constrained rows: testing the model's own choice first (and masking only a refused row)
    gives the tokens that masking every row first gives, step by step; both paths are taken (the
    logits favour an allowed token in about half the rows, a random one otherwise)."""
    import torch

    from engines import SamplingParams
    from engines.runner.grammar import StructuredOutput

    vocab, grammars, first, masked = _sampler_pair(gpt2_dir)
    params = SamplingParams(max_tokens=80, temperature=0, structured=StructuredOutput.json_schema(PERSON, "x"))
    plain = SamplingParams(max_tokens=80, temperature=0)
    ids = [1, 2, 3, 4]
    for s in (first, masked):
        for i in ids:
            s.add(_init(i, plain if i == 4 else params))
    gen = torch.Generator().manual_seed(3)
    for _ in range(40):
        live = [i for i in ids if i == 4 or not masked.states[i].matcher.is_terminated()]
        logits = torch.randn(len(live), vocab, generator=gen) * 3
        for row, i in enumerate(live):
            if i != 4 and torch.rand(1, generator=gen).item() < 0.5:  # favour a random allowed token
                bm = grammars.bitmask(1)
                masked.states[i].matcher.fill_next_token_bitmask(bm, 0)
                allowed = [t for t in range(vocab) if (bm[0, t // 32] >> (t % 32)) & 1]
                logits[row, allowed[int(torch.randint(len(allowed), (1,), generator=gen))]] += 50
        masked.prepare(live)
        want = masked.sample(live, logits.clone())
        first.prepare(live)
        assert first.sample(live, logits.clone()) == want
    assert first.grammar_checked > first.grammar_refused > 0 and masked.grammar_checked == 0


def test_check_first_sampling_follows_the_masked_law(gpt2_dir):
    """Temperature sampling with a grammar: drawing from the model's distribution, keeping an allowed
    token and drawing again from the masked distribution after a refusal, is exactly the masked
    distribution. Mass on 3 allowed and 3 refused tokens; 3,000 draws from the start of a grammar;
    every frequency within 0.04 of softmax over the allowed ones (about 4 standard errors; keeping
    the refused draws' mass on the best allowed token, for one, would be off by 0.2)."""
    import torch

    from engines import SamplingParams
    from engines.runner.grammar import StructuredOutput

    vocab, grammars, first, _ = _sampler_pair(gpt2_dir)
    params = SamplingParams(max_tokens=8, temperature=1.0, structured=StructuredOutput.json_schema(WEATHER, "x"))
    from engines.loading.tokenizer import Tokenizer

    head = Tokenizer.from_dir(gpt2_dir).tk.encode('{"city": "', add_special_tokens=False).ids  # inside a string
    probe = grammars.matcher(params.structured, (0,))
    assert all(probe.accept_token(t) for t in head)
    bm = grammars.bitmask(1)
    probe.fill_next_token_bitmask(bm, 0)
    ok = [t for t in range(vocab) if (bm[0, t // 32] >> (t % 32)) & 1]
    bad = [t for t in range(vocab) if not (bm[0, t // 32] >> (t % 32)) & 1]
    allowed, refused = ok[:3], bad[:3]
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, allowed] = torch.tensor([2.0, 1.0, 0.0])
    logits[0, refused] = torch.tensor([3.0, 2.5, 1.0])
    counts = dict.fromkeys(allowed, 0)
    n = 3000
    for k in range(n):
        first.add(_init(k, params))
        assert all(first.states[k].matcher.accept_token(t) for t in head)
        ((tok, _),) = first.sample([k], logits)
        first.release(k)
        counts[tok] += 1  # a refused token would raise KeyError
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0).tolist()
    got = [counts[t] / n for t in allowed]
    assert max(abs(a - b) for a, b in zip(got, want)) < 0.04, (got, want)
    assert 0 < first.grammar_refused < first.grammar_checked == n


def test_schema_properties_come_in_the_schemas_order(gpt2_dir):
    """The output writes an object's properties in the order its schema lists them (as OpenAI's and vLLM's do:
    a "reasoning" field before the "answer" it leads to), not sorted: both orders of one schema, each honoured."""
    from engines import LLM, SamplingParams
    from engines.runner.grammar import StructuredOutput

    props = {"zeta": {"type": "integer", "minimum": 0, "maximum": 9}, "alpha": {"type": "boolean"}}
    llm = LLM(gpt2_dir, cpu_linear_autotune=False, num_kv_blocks=64, max_model_len=200)
    for order in (["zeta", "alpha"], ["alpha", "zeta"]):
        schema = {"type": "object", "additionalProperties": False, "required": order,
                  "properties": {k: props[k] for k in order}}
        params = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput.json_schema(schema, "x"))
        text = llm.generate(["hello there"], params)[0].outputs[0].text
        assert list(json.loads(text)) == order, text
