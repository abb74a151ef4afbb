"""CPU threading defaults of the engine (engines/cpu_threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from engines.attention import KVCache, PagedAttention
from engines.cpu_threads import configure_openmp_env, single_threaded
from engines.plan import SeqWork

ROOT = Path(__file__).resolve().parents[1]


def _import_engines_first(env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env_extra
    env["PYTHONPATH"] = str(ROOT)
    code = "import engines, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_passive_wait_is_the_default_when_engines_loads_before_torch():
    assert _import_engines_first({}) == "PASSIVE"


def test_the_users_wait_policy_wins():
    assert _import_engines_first({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_too_late_once_torch_is_loaded():
    env: dict[str, str] = {}
    assert "torch" in sys.modules
    assert configure_openmp_env(env) is False and env == {}


def test_single_threaded_restores_the_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with single_threaded():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        try:
            with single_threaded():
                raise KeyError("x")
        except KeyError:
            pass
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_decode_attention_is_the_same_on_one_thread_and_on_two():
    """The per-sequence loop runs single-threaded; its result equals the same ops on two threads."""
    torch.manual_seed(0)
    bs, nh, hd = 4, 4, 8
    cache = KVCache(1, 40, bs, nh, hd, torch.float32)
    cache.data.normal_()
    decode = [SeqWork(seq_id=i, token_ids=[1], start_pos=p, sample=True,
                      block_ids=list(range(10 * i, 10 * i + p // bs + 1)))
              for i, p in enumerate([3, 17, 30])]
    q, k, v = torch.randn(3, nh, hd), torch.randn(3, nh, hd), torch.randn(3, nh, hd)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        c1 = KVCache(1, 40, bs, nh, hd, torch.float32)
        c1.data.copy_(cache.data)
        got = PagedAttention(c1, decode, [], torch.device("cpu"))(0, q, k, v)
        assert torch.get_num_threads() == 2
        c2 = KVCache(1, 40, bs, nh, hd, torch.float32)
        c2.data.copy_(cache.data)
        ref = PagedAttention(c2, decode, [], torch.device("cpu"), batched_decode=True)(0, q, k, v)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_engine_threads_default_to_every_core_unless_told():
    from engines.cpu_threads import engine_threads

    assert engine_threads(0, cpu_count=2, environ={}) == 2
    assert engine_threads(0, cpu_count=16, environ={}) == 16
    assert engine_threads(0, cpu_count=1, environ={}) == 1
    assert engine_threads(0, cpu_count=16, environ={"OMP_NUM_THREADS": "4"}) == 4
    assert engine_threads(3, cpu_count=16, environ={"OMP_NUM_THREADS": "4"}) == 3


def test_engine_steps_run_on_engine_threads_and_leave_the_callers_count(model_dir, monkeypatch):
    from engines import EngineConfig, LLMEngine, SamplingParams

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = LLMEngine(model_dir, EngineConfig(num_kv_blocks=64, worker_threads=1))
        assert torch.get_num_threads() == 2
        seen = []
        execute = eng.executor.runner.execute

        def spy(plan):
            seen.append(torch.get_num_threads())
            return execute(plan)

        monkeypatch.setattr(eng.executor.runner, "execute", spy)
        eng.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
