"""A dead or hung shard worker fails the engine promptly and clearly; nothing hangs."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest
from parallel_fixtures import PROMPTS

from engines.core.async_engine import AsyncLLMEngine, EngineDeadError
from engines.core.config import EngineConfig
from engines.core.executor import ExecutorError
from engines.core.llm_engine import LLMEngine
from engines.core.plan import StepPlan
from engines.core.sampling_params import SamplingParams
from engines.parallel.mp_executor import MultiprocExecutor

CFG = EngineConfig(num_kv_blocks=64, worker_threads=1, tensor_parallel_size=2, dist_timeout_s=30)


def test_killed_worker_fails_in_flight_requests_promptly(gpt2_dir):
    engine = LLMEngine(gpt2_dir, CFG, executor_factory=MultiprocExecutor)
    executor = engine.executor
    victim = executor.shard_info[1]["pid"]
    aengine = AsyncLLMEngine(engine)

    async def consume(i: int, first: asyncio.Event):
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        n = 0
        try:
            async for _ in aengine.generate(f"r{i}", PROMPTS[i], params):
                n += 1
                if n == 3:
                    first.set()
        except EngineDeadError as exc:
            return n, exc, time.monotonic()
        return n, None, time.monotonic()

    async def main():
        first = asyncio.Event()
        tasks = [asyncio.create_task(consume(i, first)) for i in range(len(PROMPTS))]
        await asyncio.wait_for(first.wait(), 60)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)  # no hang
        return killed_at, results

    try:
        killed_at, results = asyncio.run(main())
        for n, exc, t in results:
            assert exc is not None, "a request finished although its shard died"
            assert "shard worker 1" in str(exc) and "died" in str(exc)
            assert n < 200
            assert t - killed_at < 10.0, f"failure took {t - killed_at:.1f} s to surface"
        with pytest.raises(ExecutorError, match="shard worker 1"):
            executor.check_health()
        with pytest.raises(EngineDeadError):
            aengine.check_health()
    finally:
        aengine.shutdown()
    assert all(not p.is_alive() for p in executor.procs)  # the survivors were reaped


def test_hung_worker_fails_the_step_at_the_deadline(llama_dir):
    executor = MultiprocExecutor(llama_dir, CFG.replace(pipeline_parallel_size=2, tensor_parallel_size=1,
                                                         dist_timeout_s=3))
    engine = LLMEngine(llama_dir, CFG, executor_factory=lambda d, c: executor)
    pid = executor.shard_info[1]["pid"]
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(pid, signal.SIGSTOP)  # alive but stuck: only the deadline can tell
        t0 = time.monotonic()
        with pytest.raises(ExecutorError, match=r"no reply from shard worker\(s\) \[1\] within 3 s"):
            while True:
                engine.step()
        assert time.monotonic() - t0 < 10
        with pytest.raises(ExecutorError):
            executor.check_health()
    finally:
        executor.shutdown()


def test_an_idle_replica_outlives_the_collective_timeout(llama_dir):
    """Shards wait for the next plan inside a collective whose timeout catches hung peers; an idle
    replica is not hung: rank 0's keepalives keep every shard up past that timeout (here 2 s deadline,
    4 s collective timeout, 6 s idle), and the next request is served as before the pause."""
    cfg = CFG.replace(tensor_parallel_size=1, pipeline_parallel_size=2, dist_timeout_s=2)
    engine = LLMEngine(llama_dir, cfg, executor_factory=MultiprocExecutor)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(rid: str) -> list[int]:
        engine.add_request(rid, PROMPTS[0], params)
        out = []
        while engine.has_unfinished_requests():
            out += [o for o in engine.step() if o.finished]
        return out[0].outputs[0].token_ids

    try:
        first = tokens("before")
        time.sleep(6.0)
        engine.executor.check_health()
        assert tokens("after") == first
        stats = engine.executor.collect_stats()
        assert stats[0]["calls"].get("keepalive", 0) >= 3, stats[0]["calls"]
    finally:
        engine.executor.shutdown()


def test_worker_error_at_start_is_reported(gpt2_dir, tmp_path):
    bad = tmp_path / "noweights"
    bad.mkdir()
    shutil.copy(gpt2_dir / "config.json", bad / "config.json")
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match="shard worker [01] failed: CheckpointError: .* has no weights"):
        MultiprocExecutor(bad, CFG)
    assert time.monotonic() - t0 < 200  # reported, not waited out: the start deadline here is 300 s


def test_health_check_sees_a_dead_idle_worker(llama_dir):
    """With no step in flight (an idle replica), check_health() from another thread reports the
    dead shard, so a health probe can replace the replica before a request hits it."""
    import threading

    executor = MultiprocExecutor(llama_dir, CFG)
    try:
        executor.check_health()
        os.kill(executor.shard_info[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        errors: list[BaseException] = []

        def probe():
            while time.monotonic() < deadline:
                try:
                    executor.check_health()
                except ExecutorError as exc:
                    errors.append(exc)
                    return
                time.sleep(0.05)

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        assert errors and "shard worker 0" in str(errors[0])
        with pytest.raises(ExecutorError, match="shard worker 0"):
            executor.execute(StepPlan(step=0))  # the next step fails at once, without the workers
    finally:
        executor.shutdown()
    assert not executor.procs


def test_rendezvous_waits_past_the_step_timeout_then_names_the_missing_ranks():
    """A rank that is slow to start (imports, shard loading on a busy machine) gets the start
    deadline, not the short per-collective one; one that never comes is reported by count."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from engines.parallel.comm import init_distributed

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="only 1 of 2 shard ranks joined within 2 s"):
        init_distributed(0, 2, "127.0.0.1", store.port, "gloo", 0.1, None, torch.device("cpu"), start_timeout_s=2)
    assert time.monotonic() - t0 >= 2  # waited for the start deadline, not the 0.1 s step timeout
