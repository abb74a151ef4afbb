"""Multi-step decode (EngineConfig.decode_steps, StepPlan.steps): offline generation runs several greedy decode steps
in one engine step, in the fused step's C++ loop (csrc/fused_steps.cpp) or one step at a time in the runner, and
gives the tokens, text and finish reasons of single steps, stop tokens and strings ending a run where they occur."""

from __future__ import annotations

import pytest
import torch
from conftest import make_checkpoint

import engines.cpu.fast_linear as fl
import engines.cpu.fp8_linear as f8
from engines import LLM, EngineConfig, SamplingParams
from engines.core.config import ConfigError
from engines.cpu.paged_kernel import load as load_paged

pytestmark = pytest.mark.skipif(load_paged()[0] is None, reason="the C++ kernels cannot be built here")

PROMPTS = [list(range(3 + i, 12 + 3 * i)) for i in range(4)]  # 9-18 tokens
BASE = {"block_size": 4, "adaptive_threads": False, "greedy_head_screen": False}


def _force_panels(monkeypatch) -> None:
    """Every Linear the panel kernel at decode row counts (the loop calls it), not a timed choice."""
    monkeypatch.setattr(fl, "choose_kernels", lambda weight, bias, budget_s=0.4: ("panel", "panel", "linear", "linear"))


def _run(model_dir, params, **options):
    llm = LLM(model_dir, **{**BASE, **options})
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in outs], llm.engine


@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama_tied_ms"), "llama", seed=2, tie_word_embeddings=True)


@pytest.mark.parametrize(("family", "dtype", "fused"), [
    ("gpt2", "float32", "auto"), ("gpt2", "bfloat16", "auto"), ("llama", "float32", "auto"),
    ("llama", "bfloat16", "auto"), ("tied", "bfloat16", "auto"), ("llama", "float32", "off")])
def test_several_steps_a_call_give_the_tokens_of_single_steps(gpt2_dir, llama_dir, tied_llama_dir, monkeypatch,
                                                               family, dtype, fused):
    """Rows with different max_tokens (a run never passes one; 1 token: no run), runs crossing 4-token blocks."""
    _force_panels(monkeypatch)
    d = {"gpt2": gpt2_dir, "llama": llama_dir, "tied": tied_llama_dir}[family]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (21, 1, 13, 6)]
    expect, _ = _run(d, params, dtype=dtype, fused_decode=fused, decode_steps=1)
    got, engine = _run(d, params, dtype=dtype, fused_decode=fused, decode_steps=8)
    assert got == expect
    assert [len(t) for t, *_ in got] == [21, 1, 13, 6]
    runner = engine.executor.runner
    if fused == "auto":
        assert runner.paths["fused_steps"] >= 3, (runner.paths, runner.why_not)
    else:
        assert runner.paths["fused_steps"] == 0 and "fused_decode off" in runner.why_not["fused_steps"]
    # the recorder keeps a step a token: as many decode rows as tokens drawn after the prefills' first
    decoded = sum(r[3] for r in engine.step_recorder.rows())
    assert decoded == sum(len(t) for t, *_ in got) - len(PROMPTS)


@pytest.mark.parametrize("family", ["gpt2", "tied"])
def test_the_greedy_screen_in_the_loop(gpt2_dir, tied_llama_dir, monkeypatch, family):
    """An fp32 head with the greedy screen on (engines/cpu/greedy_head.py, forced for one row and a batch; a tied head
    keeps its dense weight beside the panels): the loop draws each step's tokens through the screen's ops, as the step
    head does."""
    import engines.cpu.greedy_head as gh

    _force_panels(monkeypatch)

    def always(self, full, in_features, batch=64, rounds=5):
        self.rows_one = self.rows_many = True
        return "forced on"

    monkeypatch.setattr(gh.GreedyScreen, "decide", always)
    d = gpt2_dir if family == "gpt2" else tied_llama_dir
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (19, 11, 4, 15)]
    opts = {"dtype": "float32", "greedy_head_screen": True}
    expect, _ = _run(d, params, decode_steps=1, **opts)
    got, engine = _run(d, params, decode_steps=8, **opts)
    assert got == expect
    runner = engine.executor.runner
    assert runner.head.screen is not None and runner.paths["fused_steps"] >= 2


def test_fp8_head_and_blocks_in_the_loop(llama_dir, monkeypatch):
    """FP8 weight-only blocks and an e4m3 head: the loop's head is the FP8 kernel's fp32 sums (forward_float)."""
    _force_panels(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    opts = {"dtype": "bfloat16", "weight_dtype": "fp8", "lm_head_dtype": "fp8"}
    expect, _ = _run(llama_dir, params, decode_steps=1, **opts)
    got, engine = _run(llama_dir, params, decode_steps=16, **opts)
    assert got == expect
    runner = engine.executor.runner
    assert isinstance(runner.model.lm_head, f8.Fp8PanelLinear) and runner.paths["fused_steps"] >= 1


@pytest.mark.parametrize("fused", ["auto", "off"])
def test_stop_tokens_and_strings_end_a_run_where_they_occur(llama_dir, monkeypatch, fused):
    """A stop token id, EOS and a stop string met inside a run: the same output and finish reason as single steps (the
    tokens drawn after the stop are dropped)."""
    _force_panels(monkeypatch)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref, _ = _run(llama_dir, free, decode_steps=1, fused_decode=fused)
    toks, text = ref[0][0], ref[0][1]
    stop_tok = toks[5]  # the run of steps 2-9 meets it
    stop_str = text[len(text) // 2: len(text) // 2 + 3]
    cases = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=24, stop=[stop_str], ignore_eos=True)]
    for params in cases:
        expect, _ = _run(llama_dir, params, decode_steps=1, fused_decode=fused)
        got, _ = _run(llama_dir, params, decode_steps=8, fused_decode=fused)
        assert got == expect
    assert expect[0][3] == stop_str and len(expect[0][1]) < len(text)
    assert got[0][2] == "stop"


def test_eos_ends_a_run_where_it_occurs(llama_dir, tmp_path, monkeypatch):
    """The checkpoint's EOS is a token the first prompt draws inside a run (its first time there): its run stops at it,
    the others' go on."""
    import json
    import shutil

    _force_panels(monkeypatch)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    toks = _run(llama_dir, free, decode_steps=1)[0][0][0]
    at = next(j for j in range(3, len(toks)) if toks[j] not in toks[:j])  # a decode run of 8 holds tokens 1-8
    d = shutil.copytree(llama_dir, tmp_path / "eos")
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = toks[at]
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").unlink(missing_ok=True)
    params = SamplingParams(temperature=0, max_tokens=24)
    expect, _ = _run(d, params, decode_steps=1)
    got, engine = _run(d, params, decode_steps=8)
    assert engine.scheduler.cfg.eos_token_ids == (toks[at],)
    assert got == expect and expect[0][2] == "stop" and len(expect[0][0]) == at + 1
    assert engine.executor.runner.paths["fused_steps"] >= 1


def test_one_step_a_plan_where_a_row_needs_more_than_the_argmax(llama_dir, monkeypatch):
    """Sampled, logprobs or min_tokens rows beside greedy ones: plans of one step, the same tokens."""
    _force_panels(monkeypatch)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=4, ignore_eos=True)]
    expect, _ = _run(llama_dir, params, decode_steps=1)
    got, engine = _run(llama_dir, params, decode_steps=8)
    assert got == expect
    assert engine.executor.runner.paths["fused_steps"] == 0


def test_short_of_blocks_fewer_steps(llama_dir, monkeypatch):
    """A cache too small for every row's run of 8: runs of 4, 2 or 1 instead, and the same tokens."""
    _force_panels(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    opts = {"num_kv_blocks": 40, "max_num_seqs": 4}
    expect, _ = _run(llama_dir, params, decode_steps=1, **opts)
    got, engine = _run(llama_dir, params, decode_steps=8, **opts)
    assert got == expect and engine.scheduler.num_preemptions == 0
    assert engine.executor.runner.paths["fused_steps"] >= 1


def test_decode_steps_is_checked():
    for bad in (0, 257, 2.0, True):
        with pytest.raises(ConfigError, match="decode_steps"):
            EngineConfig(decode_steps=bad)


def test_the_loop_refuses_positions_past_its_tables(llama_dir, monkeypatch):
    _force_panels(monkeypatch)
    runner = LLM(llama_dir, **BASE).engine.executor.runner
    assert runner.fused.steps_why_not(1) is None
    table = torch.zeros(1, 2, dtype=torch.long)  # 2 blocks of 4: positions 0-7
    with pytest.raises(RuntimeError, match="past the block table"):
        runner.fused.run_steps([5], [6], table, 4, 3, [[]], runner.cfg.vocab_size)
