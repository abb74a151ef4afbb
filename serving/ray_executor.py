"""The Ray executor: TP x PP shard-worker actors, one per placement-group bundle, forming a
torch.distributed (gloo on CPU, NCCL on GPU) group; the engine's Executor contract.

The actors run the multiprocess executor's worker loop (engines/parallel/worker_proc.py): rank 0
takes each step's plan from the driver and broadcasts it in the group, the sampling rank (last
stage, TP rank 0) returns the sampled tokens. The driver is the ModelServer replica: it hosts the
rendezvous store, never joins the group, and waits on the sampling rank's reply *and* on every
actor's long-running `run()` call, so an actor that dies (or whose loop fails) fails the step
at once with ExecutorError, and a hung one at dist_timeout_s.

Placement: inside a Ray Serve replica deployed with `placement_group_bundles=
placement_bundles(...)` (the replica in bundle 0, one bundle per shard after it) the workers
use bundles 1..TP*PP of the replica's group, so Ray reserves and co-schedules the whole model
copy; elsewhere (tests, tools) the executor reserves its own group of TP*PP bundles.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engines.core.config import ConfigError, EngineConfig, ModelConfig, resolve_engine_config
from engines.core.executor import Executor, ExecutorError
from engines.core.plan import StepPlan, StepResult
from engines.parallel.layout import ParallelLayout

log = logging.getLogger("shardserve.ray_executor")
SHARD_ACTOR_PREFIX = "shardserve-shard-"


# resources
def worker_bundles(tp: int, pp: int, cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0
                   ) -> list[dict[str, float]]:
    bundle = {"CPU": float(cpus_per_worker)}
    if gpus_per_worker:
        bundle["GPU"] = float(gpus_per_worker)
    return [dict(bundle) for _ in range(tp * pp)]


def placement_bundles(tp: int, pp: int, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                      cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0) -> list[dict[str, float]]:
    """Ray Serve `placement_group_bundles` for one ModelServer replica: the replica's own bundle
    first, then one per shard worker (RayExecutor finds them through the current group)."""
    replica = {"CPU": float(replica_cpus)}
    if replica_gpus:
        replica["GPU"] = float(replica_gpus)
    return [replica, *worker_bundles(tp, pp, cpus_per_worker, gpus_per_worker)]


def check_cluster_resources(tp: int, pp: int, replicas: int, *, cpus_per_worker: float = 1.0,
                            gpus_per_worker: float = 0.0, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                            model: str = "model", cluster: dict[str, float] | None = None) -> None:
    """Raise ConfigError when the Ray cluster cannot hold replicas x (replica + TP x PP workers).

    `cluster` is ray.cluster_resources() (the default) or a given {"CPU": n, "GPU": m}; the
    message names the model's fields and the numbers. Call it before deploying the model.
    """
    if cluster is None:
        cluster = ray.cluster_resources()
    workers = tp * pp * replicas
    for res, per_worker, per_replica in (("CPU", cpus_per_worker, replica_cpus), ("GPU", gpus_per_worker, replica_gpus)):
        need = workers * per_worker + replicas * per_replica
        have = float(cluster.get(res, 0.0))
        if need > have + 1e-9:
            raise ConfigError(
                f"models[{model}]: tensor_parallel_size x pipeline_parallel_size x replicas = {tp} x {pp} x "
                f"{replicas} = {workers} shard workers need {need:g} {res}s ({per_worker:g} per worker + "
                f"{per_replica:g} per replica) but the Ray cluster has {have:g}; lower tp, pp or replicas, "
                f"or add nodes")


# the actor
class _QueueChannel:
    """The worker loop's link to the driver inside an actor: the actor's submit() fills the inbox,
    its reply() drains the outbox."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self._polled: list[tuple] = []  # a command poll() took from the inbox, for the next recv()

    def poll(self, timeout_s: float) -> bool:
        if not self._polled:
            try:
                self._polled.append(self.inbox.get(timeout=timeout_s))
            except queue.Empty:
                return False
        return True

    def recv(self) -> tuple:
        return self._polled.pop() if self._polled else self.inbox.get()

    def send(self, msg: tuple) -> None:
        self.outbox.put(msg)


@ray.remote(max_concurrency=4)  # run() holds one thread for the actor's life; submit/reply use others
class ShardWorker:
    def __init__(self, rank: int, layout: ParallelLayout, model_dir: str, engine_cfg: EngineConfig, threads: int):
        self.args = (rank, layout, model_dir, engine_cfg, threads)
        self.channel = _QueueChannel()

    def ping(self) -> int:
        import os

        return os.getpid()

    def run(self, store_host: str, store_port: int) -> None:
        """Join the group, load the shard and serve until "stop"; raises when the loop fails."""
        from engines.parallel.worker_proc import run_worker

        rank, layout, model_dir, engine_cfg, threads = self.args
        run_worker(rank, layout, store_host, store_port, model_dir, engine_cfg, threads, self.channel)

    def submit(self, msg: tuple) -> None:
        self.channel.inbox.put(msg)

    def reply(self, timeout_s: float) -> tuple:
        try:
            return self.channel.outbox.get(timeout=timeout_s)
        except queue.Empty:
            return ("timeout", self.args[0], None)


class RayExecutor(Executor):
    def __init__(self, model_dir: str | Path, engine_cfg: EngineConfig, cpus_per_worker: float = 1.0,
                 gpus_per_worker: float = 0.0, start_timeout_s: float = 300.0):
        from datetime import timedelta

        import torch.distributed as dist

        self.model_config = ModelConfig.from_dir(model_dir)
        engine_cfg = resolve_engine_config(engine_cfg, self.model_config)  # dtype auto: once, for every shard
        self.layout = ParallelLayout.from_configs(self.model_config, engine_cfg)  # ConfigError first
        self.engine_cfg = engine_cfg
        self.timeout = engine_cfg.dist_timeout_s
        self._dead: str | None = None
        self._lock = threading.Lock()  # held while a command is in flight (see check_health)
        self._own_pg = None
        world = self.layout.world_size
        pg, first_bundle = self._placement(world, cpus_per_worker, gpus_per_worker, start_timeout_s)
        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=self.timeout),
                                   wait_for_workers=False)
        threads = engine_cfg.worker_threads or max(1, int(cpus_per_worker))
        token = uuid.uuid4().hex[:8]
        self.actor_names = [f"{SHARD_ACTOR_PREFIX}{token}-r{rank}" for rank in range(world)]
        """Named (ray.util.list_named_actors) so that operators and tests can find a model copy's shards."""
        self.workers = [
            ShardWorker.options(
                num_cpus=cpus_per_worker, num_gpus=gpus_per_worker, name=self.actor_names[rank],
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=first_bundle + rank,
                    placement_group_capture_child_tasks=False),
            ).remote(rank, self.layout, str(model_dir), engine_cfg, threads)
            for rank in range(world)]
        self.run_refs = [w.run.remote(host, self.store.port) for w in self.workers]
        deadline = time.monotonic() + start_timeout_s
        self.shard_info = self._wait_all("start", "ready", deadline)
        blocks = {info["num_blocks"] for info in self.shard_info.values()}
        if len(blocks) != 1:
            self._fail(f"shards disagree on the KV pool size: {sorted(blocks)}")
        self.num_blocks = blocks.pop()

    def _placement(self, world: int, cpus: float, gpus: float, timeout_s: float):
        pg = get_current_placement_group()
        if pg is not None and len(pg.bundle_specs) >= world + 1:
            return pg, 1  # the replica's own group: bundle 0 is the replica, then the shards
        bundles = worker_bundles(self.layout.tp, self.layout.pp, cpus, gpus)
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=min(timeout_s, 60.0))
        except Exception as exc:  # GetTimeoutError: the cluster cannot hold the bundles
            remove_placement_group(pg)
            raise ExecutorError(
                f"could not reserve {world} shard bundles of {bundles[0]} (tensor_parallel_size x "
                f"pipeline_parallel_size = {self.layout.tp} x {self.layout.pp}) within "
                f"{min(timeout_s, 60.0):.0f} s; the Ray cluster has {ray.cluster_resources()}") from exc
        self._own_pg = pg
        return pg, 0

    # the contract
    def execute(self, plan: StepPlan) -> StepResult:
        return self._call(("step", plan), f"step {plan.step}")

    def execute_with_logits(self, plan: StepPlan, want_logits: bool = True):
        return self._call(("logits", plan), f"step {plan.step}")

    def check_health(self) -> None:
        """Raise ExecutorError when a shard actor is gone; safe to call from any thread (a Ray
        Serve health check): while a step is in flight it only reports, the stepping thread cleans up."""
        if self._dead is not None:
            raise ExecutorError(self._dead)
        refs = list(self.run_refs)
        done, _ = ray.wait(refs, num_returns=1, timeout=0) if refs else ([], [])
        if done:
            message = self._ended(done[0], "health check", refs)
            if self._lock.acquire(blocking=False):
                try:
                    self._fail(message)
                finally:
                    self._lock.release()
            raise ExecutorError(message)

    def collect_stats(self, reset: bool = False) -> dict[int, dict]:
        self.check_health()
        with self._lock:
            self.workers[0].submit.remote(("stats", reset))
            return self._wait_all("stats", "ok", time.monotonic() + self.timeout)

    def shutdown(self) -> None:
        with self._lock:
            if self._dead is None and self.workers:
                try:
                    self.workers[0].submit.remote(("stop", None))
                    ray.wait(self.run_refs, num_returns=len(self.run_refs), timeout=10)
                except Exception as exc:  # noqa: BLE001 - best effort; the actors are killed below
                    log.debug("graceful stop failed: %r", exc)
            self._kill_all()
            self._dead = self._dead or "executor was shut down"

    # internals
    def _call(self, msg: tuple, what: str):
        self.check_health()
        with self._lock:
            self.workers[0].submit.remote(msg)  # the plan goes to rank 0 only; rank 0 broadcasts it
            return self._wait_rank(self.layout.sampler_rank, what, "ok", time.monotonic() + self.timeout)

    def _wait_rank(self, rank: int, what: str, expect: str, deadline: float):
        ref = self.workers[rank].reply.remote(max(0.0, deadline - time.monotonic()))
        while True:
            left = deadline - time.monotonic()
            ready, _ = ray.wait([ref, *self.run_refs], num_returns=1, timeout=max(0.0, left))
            if not ready:
                self._fail(f"{what}: no reply from shard worker {rank} within {self.timeout:.0f} s "
                           "(a hung shard; see dist_timeout_s)")
            if ready[0] is not ref:
                self._fail(self._ended(ready[0], what))
            try:
                kind, src, payload = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the replying actor died
                self._fail(f"{what}: shard worker {rank} died ({type(exc).__name__}: {exc})")
            if kind == "timeout":
                self._fail(f"{what}: no reply from shard worker {rank} within {self.timeout:.0f} s "
                           "(a hung shard; see dist_timeout_s)")
            if kind == "error":
                self._fail(f"{what}: shard worker {src} failed: {payload}")
            if kind != expect:
                self._fail(f"{what}: unexpected {kind!r} from shard worker {src}")
            return payload

    def _wait_all(self, what: str, expect: str, deadline: float) -> dict[int, Any]:
        return {r: self._wait_rank(r, what, expect, deadline) for r in range(len(self.workers))}

    def _ended(self, ref, what: str, refs: list | None = None) -> str:
        rank = (refs if refs is not None else self.run_refs).index(ref)
        try:
            ray.get(ref, timeout=5)
            return f"{what}: shard worker {rank} stopped"
        except ray.exceptions.RayActorError as exc:
            return f"{what}: shard worker {rank} died ({type(exc).__name__})"
        except Exception as exc:  # noqa: BLE001 - the worker loop raised: its message is the cause
            return f"{what}: shard worker {rank} failed: {exc}"

    def _fail(self, message: str):
        if self._dead is None:
            self._dead = message
            log.error("Ray executor failed: %s", message)
        self._kill_all()
        raise ExecutorError(self._dead)

    def _kill_all(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception as exc:  # noqa: BLE001 - already gone
                log.debug("kill of a shard actor: %r", exc)
        self.workers, self.run_refs = [], []
        if self._own_pg is not None:
            try:
                remove_placement_group(self._own_pg)
            except Exception as exc:  # noqa: BLE001 - Ray is shutting down
                log.debug("placement group removal: %r", exc)
            self._own_pg = None
        self.store = None


def ray_executor_factory(cpus_per_worker: float = 1.0, gpus_per_worker: float = 0.0
                         ) -> Callable[[str, EngineConfig], Executor]:
    """executor_factory for LLMEngine / ModelCore: the in-process executor for one shard, else
    a RayExecutor whose workers reserve cpus_per_worker / gpus_per_worker each."""

    def factory(model_dir: str, engine_cfg: EngineConfig) -> Executor:
        if engine_cfg.world_size == 1:
            from engines.core.executor import InProcessExecutor

            return InProcessExecutor(model_dir, engine_cfg)
        return RayExecutor(model_dir, engine_cfg, cpus_per_worker, gpus_per_worker)

    return factory
