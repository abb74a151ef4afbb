"""The Ray executor: shard workers as actors in a placement group, forming a gloo group.

Parity with the single-device engine, the resource check, and a killed actor failing the
engine promptly. (End to end over HTTP through Ray Serve: see the note at the bottom.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

ray = pytest.importorskip("ray")

from parallel_fixtures import PROMPTS, LogitsRecorder, max_logit_error, run_engine

from engines.core.async_engine import AsyncLLMEngine, EngineDeadError
from engines.core.config import ConfigError, EngineConfig
from engines.core.executor import ExecutorError, InProcessExecutor
from engines.core.llm_engine import LLMEngine
from engines.core.sampling_params import SamplingParams
from serving.ray_executor import RayExecutor, check_cluster_resources, placement_bundles, ray_executor_factory
from training.distributed import init_ray

BASE = EngineConfig(num_kv_blocks=64, worker_threads=1, dist_timeout_s=60)


def test_check_cluster_resources_names_fields_and_numbers():
    check_cluster_resources(2, 2, 1, cluster={"CPU": 5.0})  # 4 workers + 1 replica
    with pytest.raises(ConfigError, match=r"models\[m\]: tensor_parallel_size x pipeline_parallel_size x replicas = "
                                          r"2 x 2 x 2 = 8 shard workers need 10 CPUs .* has 6"):
        check_cluster_resources(2, 2, 2, model="m", cluster={"CPU": 6.0})
    with pytest.raises(ConfigError, match="need 2 GPUs"):
        check_cluster_resources(2, 1, 1, gpus_per_worker=1, cluster={"CPU": 8.0})
    assert placement_bundles(2, 1, replica_cpus=1, cpus_per_worker=2) == [{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}]


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        init_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


@pytest.mark.parametrize("family, tp, pp", [("gpt2", 2, 1), ("llama", 1, 2)])
def test_ray_executor_matches_single_device(ray_cluster, gpt2_dir, llama_dir, family, tp, pp):
    d = gpt2_dir if family == "gpt2" else llama_dir
    ref, _ = run_engine(d, InProcessExecutor(d, BASE), BASE)
    ex = RayExecutor(d, BASE.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_microbatches=2))
    try:
        rec = LogitsRecorder(ex)
        outs, _ = run_engine(d, rec, BASE)
        assert outs == ref
        assert max_logit_error(d, PROMPTS, outs, rec.logits) < 1e-4
        stats = ex.collect_stats()
        assert stats[0]["bytes"]["plan"] > 0 and all("plan" not in s["bytes"] for r, s in stats.items() if r)
        assert all(i["weight_bytes"] == i["expected_weight_bytes"] for i in ex.shard_info.values())
    finally:
        ex.shutdown()


def test_killed_actor_fails_in_flight_requests_promptly(ray_cluster, gpt2_dir):
    engine = LLMEngine(gpt2_dir, BASE.replace(tensor_parallel_size=2),
                       executor_factory=ray_executor_factory(cpus_per_worker=1))
    executor = engine.executor
    aengine = AsyncLLMEngine(engine)

    async def consume(i: int, started: asyncio.Event):
        n = 0
        try:
            async for _ in aengine.generate(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=200, ignore_eos=True)):
                n += 1
                if n == 3:
                    started.set()
        except EngineDeadError as exc:
            return exc, time.monotonic()
        return None, time.monotonic()

    async def main():
        started = asyncio.Event()
        tasks = [asyncio.create_task(consume(i, started)) for i in range(len(PROMPTS))]
        await asyncio.wait_for(started.wait(), 60)
        t0 = time.monotonic()
        ray.kill(executor.workers[1])
        return t0, await asyncio.wait_for(asyncio.gather(*tasks), 30)

    try:
        t0, results = asyncio.run(main())
        for exc, t in results:
            assert exc is not None and "shard worker 1" in str(exc)
            assert t - t0 < 10.0
        with pytest.raises(ExecutorError):
            executor.check_health()
    finally:
        aengine.shutdown()


# End to end over HTTP (Ray Serve, the ModelServer's shards as actors in its placement group):
# parity of every layout in test_parallel_ray_http_parity.py, a killed shard in
# test_parallel_ray_http.py; see docs/parallel.md.
