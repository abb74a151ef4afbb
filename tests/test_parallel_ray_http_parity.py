"""End to end over HTTP through Ray Serve: split models (TP=2 x PP=2 of Llama with GQA, 4 query heads
over 2 KV heads: both collectives and the stage hand-off; PP=2 of GPT-2) give what the single-device
engine gives, in fp32. (TP-only GPT-2 over Ray Serve is in test_serving_ray; every layout of both
families in one process is in test_parallel_mp_gpt2 / _llama: two layouts here keep this server at
2 replicas and 6 shard actors, each a process that imports torch, within a small machine's test
budget; TP=2 x PP=2 of GPT-2 and TP=2 of Llama added nothing those tests and these two miss.)

One Ray Serve application serves every layout as its own ModelServer (its shards are Ray actors in
the replica's placement group); the reference is engines.LLM (TP = PP = 1) in the test process.
Requests go through the official `openai` client (/v1/completions, logprobs=5) and must match the
reference exactly in text and tokens, and within 1e-4 in the chosen token's logprob and in each
of the top-5 alternatives. The logprobs are log_softmax of the raw fp32 logits (before any
temperature), logit - logsumexp(row), so they check the split model's logits (up to a constant per
row, which neither sampling nor softmax sees) and the ranking of the top-5.

The completions API returns no token ids; it returns each token's text (`logprobs.tokens`), which
is compared with the reference's ids decoded one by one the way the gateway does it.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")

from deploy.schema import validate_config
from engines import LLM, SamplingParams
from serving import launcher
from training.distributed import free_port

# name -> (family, tensor_parallel_size, pipeline_parallel_size)
LAYOUTS = {
    "gpt2-pp2": ("gpt2", 1, 2),
    "llama-tp2pp2": ("llama", 2, 2),
}
ENGINE = {"dtype": "float32", "num_kv_blocks": 128, "cpu_linear_autotune": False}
PROMPTS = ["To be, or not to be, that is the question", "Whether 'tis nobler in the mind",
           "Héllo wörld — naïve café, 東京"]
MAX_TOKENS = 14
TOP = 5
TOL = 1e-4
SEED, SAMPLED_TEMPERATURE = 7, 0.8



@pytest.fixture(scope="module")
def dirs(gpt2_dir, llama_dir):
    return {"gpt2": gpt2_dir, "llama": llama_dir}


@pytest.fixture(scope="module")
def url(dirs):
    if ray.is_initialized():  # another module's session: start clean
        ray.shutdown()
    # 2 replicas + 6 shard actors on a small machine: fractional CPUs, one torch thread each
    models = [{"name": name, "path": str(dirs[family]), "replicas": 1, "num_cpus": 0.25, "shard_num_cpus": 0.25,
               "engine": {**ENGINE, "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "worker_threads": 1,
                          "dist_timeout_s": 60}}
              for name, (family, tp, pp) in LAYOUTS.items()]
    cfg = validate_config({"models": models,
                           "server": {"port": free_port(), "log_requests": False, "drain_timeout_s": 2}})
    running = launcher.start(cfg, api_keys=[])
    try:
        yield running.url
    finally:
        launcher.stop(running)


@pytest.fixture(scope="module")
def reference(dirs):
    """family -> the single-device engine (TP = PP = 1), fp32."""
    return {f: LLM(d, **ENGINE) for f, d in dirs.items()}


@pytest.fixture
def client(url):
    from openai import OpenAI

    with OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)


def sampled() -> SamplingParams:
    return SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=TOP)


def http_kwargs(p: SamplingParams) -> dict:
    kw = {"max_tokens": p.max_tokens, "temperature": p.temperature, "logprobs": p.logprobs,
          "extra_body": {"ignore_eos": True}}
    if p.seed is not None:
        kw["seed"] = p.seed
    return kw


def assert_matches(choice, ref, llm: LLM, what: str) -> None:
    """One HTTP completion choice against the reference engine's RequestOutput."""
    def text(token_id: int) -> str:  # as the gateway shows a token
        return llm.tokenizer.decode([token_id], skip_special_tokens=False)

    out = ref.outputs[0]
    assert choice.text == out.text, what
    lp = choice.logprobs
    assert lp.tokens == [text(t) for t in out.token_ids], what
    assert len(lp.token_logprobs) == len(out.logprobs) == len(out.token_ids), what
    for i, (got, got_top, want) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, out.logprobs)):
        assert abs(got - want.logprob) < TOL, f"{what}: token {i}: logprob {got} vs {want.logprob}"
        want_top = {text(t): v for t, v in want.top[:TOP]}  # built the way the gateway builds it
        assert set(got_top) == set(want_top), f"{what}: token {i}: top-{TOP} {got_top} vs {want_top}"
        for tok, v in want_top.items():
            assert abs(got_top[tok] - v) < TOL, f"{what}: token {i}: top {tok!r}: {got_top[tok]} vs {v}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_greedy_tokens_and_logprobs_match_single_device(client, reference, name):
    family = LAYOUTS[name][0]
    llm = reference[family]
    refs = llm.generate(PROMPTS, greedy())
    resp = client.completions.create(model=name, prompt=PROMPTS, **http_kwargs(greedy()))
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert len(choices) == len(PROMPTS)
    for i, (choice, ref) in enumerate(zip(choices, refs)):
        assert choice.finish_reason == "length"
        assert_matches(choice, ref, llm, f"{name} prompt {i}")
    assert resp.usage.completion_tokens == len(PROMPTS) * MAX_TOKENS
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


@pytest.mark.parametrize("name", ["llama-tp2pp2", "gpt2-pp2"])
def test_concurrent_requests_match_single_device(url, reference, name):
    """Requests that join and leave the running batch at different steps (continuous batching),
    one of them seeded and sampled (it draws the same tokens whatever else is in the batch)."""
    from openai import AsyncOpenAI

    llm = reference[LAYOUTS[name][0]]
    params = [greedy(24), greedy(5), sampled(), greedy(9)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    refs = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]

    async def main():
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            async def one(i):
                await asyncio.sleep(0.05 * i)  # arrive while the others decode
                return await c.completions.create(model=name, prompt=prompts[i], **http_kwargs(params[i]))

            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    for i, (resp, ref) in enumerate(zip(asyncio.run(main()), refs)):
        assert_matches(resp.choices[0], ref, llm, f"{name} request {i}")


@pytest.mark.parametrize("name", ["gpt2-pp2", "llama-tp2pp2"])
def test_seeded_sampling_matches_single_device(client, reference, name):
    llm = reference[LAYOUTS[name][0]]
    ref = llm.generate(PROMPTS[0], sampled())[0]
    resp = client.completions.create(model=name, prompt=PROMPTS[0], **http_kwargs(sampled()))
    assert_matches(resp.choices[0], ref, llm, f"{name} seeded")
    greedy_ref = llm.generate(PROMPTS[0], greedy())[0]
    assert ref.outputs[0].token_ids != greedy_ref.outputs[0].token_ids, "the seeded sample is the greedy one"
