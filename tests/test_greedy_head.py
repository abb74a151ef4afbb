"""The greedy screen of an fp32 head (engines/cpu/greedy_head.py): the same tokens as the fp32 logits' argmax, with
the candidates' kernel against a reference, the panel kernel's variants forced, and an engine's greedy streams equal
with the screen on and off."""

from __future__ import annotations

import pytest
import torch

from engines import LLM, SamplingParams
from engines.core.config import EngineConfig
from engines.cpu import panel_kernel as pk
from engines.cpu.greedy_head import GreedyScreen, screen_constant
from engines.cpu.kernels import load

pytestmark = pytest.mark.skipif(not pk.available(torch.bfloat16), reason="no bf16 panel kernel on this machine")


def _variant_runs(variant: str) -> bool:
    try:
        return pk.panel_variant(variant) == variant
    except ValueError:
        return False


VARIANTS = ["auto", "portable", "amx_emulated",
            pytest.param("avx2", marks=pytest.mark.skipif(not _variant_runs("avx2"), reason="this CPU lacks AVX2 + FMA"))]


def test_near_max_rows_against_a_reference():
    near = load()[0].near_max_rows
    g = torch.Generator().manual_seed(0)
    for S, V in ((5, 37), (3, 16), (4, 1000)):
        a = torch.randn(S, V, generator=g)
        k = torch.rand(S, generator=g) * 0.3
        wn = torch.rand(V, generator=g) + 0.5
        lo = (a - k[:, None] * wn).max(dim=1).values
        want = (a + k[:, None] * wn >= lo[:, None]).nonzero()
        assert torch.equal(near(a, k, wn), want)
    a = torch.randn(3, 40, generator=g)
    a[1, 7] = float("nan")
    a[2, :] = float("-inf")
    got = near(a, torch.full((3,), 0.1), torch.ones(40))
    assert got[got[:, 0] == 1].tolist() == [[1, -1]] and got[got[:, 0] == 2].tolist() == [[2, -1]]
    assert (got[got[:, 0] == 0, 1] >= 0).all()
    with pytest.raises(RuntimeError, match="wn \\(V\\) float32"):
        near(a, torch.full((3,), 0.1), torch.ones(39))


@pytest.mark.parametrize("variant", VARIANTS)
def test_screen_equals_the_fp32_argmax(variant):
    g = torch.Generator().manual_seed(1)
    V, C = 1003, 96
    w = torch.randn(V, C, generator=g) * 0.2
    w[500] = w[77]  # an exact tie: the lower id, as torch.argmax
    # entries equal in bf16, 1e-3 apart in fp32: the bf16 pass cannot order them, the fp32 recheck must
    w[900] = w[300].bfloat16().float()
    w[901] = w[900] + torch.sign(w[900]) * 2.0 ** -12 * w[900].abs()
    assert torch.equal(w[900].bfloat16(), w[901].bfloat16())
    h = torch.randn(40, C, generator=g) * 3
    h[0] = w[77] * 5  # its best is the tie (77, 500)
    h[1] = w[901] * 5  # 900 and 901 neck and neck
    screen = GreedyScreen(w, V, variant=variant)
    tokens = screen.tokens(h)
    want = (h @ w.T).argmax(dim=-1)
    assert tokens is not None and torch.equal(tokens, want)
    assert tokens[0] == 77 and tokens[1] == 901
    assert screen.tokens(h[:1]).tolist() == [77]  # one row, as a batch
    bad = h.clone()
    bad[3, 5] = float("nan")
    assert screen.tokens(bad) is None  # the caller takes the full logits


@pytest.mark.parametrize("variant", ["auto", "portable"])
def test_screen_with_suppressed_ids_equals_the_masked_argmax(variant):
    """min_tokens' EOS / stop ids ruled out per row: the argmax of each row's allowed fp32 logits."""
    g = torch.Generator().manual_seed(4)
    V, C = 300, 64
    w = torch.randn(V, C, generator=g) * 0.2
    w[9] = w[20]  # a tie: 9 suppressed in row 0, so 20
    h = torch.randn(6, C, generator=g) * 3
    h[0] = w[9] * 5
    logits = h @ w.T
    best = logits.argmax(dim=-1)
    rows, cols = [0, 0, 1, 1, 2, 5], [9, 3, int(best[1]), 250, 3, int(best[5])]
    masked = logits.clone()
    masked[rows, cols] = float("-inf")
    screen = GreedyScreen(w, V, variant=variant)
    got = screen.tokens(h, (rows, cols))
    assert got is not None and torch.equal(got, masked.argmax(dim=-1))
    assert got[0] == 20 and got[1] != best[1] and got[5] != best[5] and torch.equal(screen.tokens(h), best)


def test_the_bound_holds_where_bf16_rounding_is_worst():
    """Entries rounded by almost 2^-9 each way: the screen's error against the fp32 logits stays within c |h| |w_j|."""
    g = torch.Generator().manual_seed(2)
    C = 64
    base = (torch.randint(1, 255, (C,), generator=g).float() + 128.4) / 256  # far from bf16 grid points
    w = torch.stack([base, -base, base.flip(0)])
    h = ((torch.randint(1, 255, (4, C), generator=g).float() + 128.6) / 256)
    a = pk.panel_linear_f32(h.bfloat16().contiguous(), GreedyScreen(w, 3).panels, 3)
    exact = h.double() @ w.double().T
    bound = screen_constant(C) * h.norm(dim=1)[:, None] * w.norm(dim=1)[None]
    assert ((a.double() - exact).abs() <= bound.double()).all()
    assert (a.double() - exact).abs().max() > 1e-4  # the bf16 rounding is really there


def test_engine_greedy_streams_equal_with_the_screen_on_and_off(llama_dir):
    prompts = [[3, 17, 42, 8], [5, 6, 7, 8, 9, 10, 11], [99, 100], [1, 2, 3]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    off = LLM(llama_dir, dtype="float32", greedy_head_screen=False, num_kv_blocks=64, block_size=8)
    on = LLM(llama_dir, dtype="float32", greedy_head_screen=False, num_kv_blocks=64, block_size=8,
             decode_steps=1)  # a step a call: the step head draws each token (the loop's screen: test_engine_multi_step)
    head = on.engine.executor.runner.head
    assert head.screen is None
    runner = on.engine.executor.runner
    lm = runner.model.lm_head  # its fp32 weight: dropped where the kernels timed here read only its panels
    weight = lm.dense_weight() if getattr(lm, "weight", None) is None else lm.weight
    screen = GreedyScreen(weight, runner.model_config.vocab_size)
    calls = []
    tokens = screen.tokens
    screen.tokens = lambda h, *a: calls.append(h.shape[0]) or tokens(h, *a)
    head.screen = screen  # forced on, whatever the timing says here
    want = [r.outputs[0].token_ids for r in off.generate(prompts, params)]
    got = [r.outputs[0].token_ids for r in on.generate(prompts, params)]
    assert got == want and sum(calls) >= len(prompts) * 11  # every decode row went through the screen
    # a row that needs its logits (logprobs) is not screened, and gets them
    mixed = [params[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    res = on.generate(prompts[:2], mixed)
    assert [r.outputs[0].token_ids for r in res] == want[:2]
    assert res[1].outputs[0].logprobs is not None and len(res[1].outputs[0].logprobs) == 12
    # min_tokens rows are screened too, their EOS and stop ids ruled out until min_tokens: the tokens with it off
    stop = [SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[w[2]], ignore_eos=True)
            for w in want]
    calls.clear()
    got = [r.outputs[0] for r in on.generate(prompts, stop)]
    assert [o.token_ids for o in got] == [r.outputs[0].token_ids for r in off.generate(prompts, stop)]
    assert sum(calls) >= len(prompts) * 5 and all(len(o.token_ids) >= 6 for o in got)
    assert all(w[2] not in o.token_ids[:6] for w, o in zip(want, got))


def test_config_names_the_field():
    with pytest.raises(ValueError, match="greedy_head_screen"):
        EngineConfig(greedy_head_screen="yes")
