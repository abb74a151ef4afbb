"""The multiprocess executor: one spawned process per shard, a torch.distributed group between them.

The driver (the engine's process, where the scheduler runs) is not a rank. It hosts the
rendezvous TCPStore, sends each step's plan to rank 0 over a pipe (rank 0 broadcasts it), and
waits for the sampling rank's reply. Keeping the driver out of the process group means it
never blocks in a collective: it waits on pipes and on the processes' exit sentinels with a
deadline, so a dead or hung shard fails the step with ExecutorError at once (dead) or after
dist_timeout_s (hung), and the engine process holds no torch.distributed state to corrupt.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

from engines.core.config import EngineConfig, ModelConfig, resolve_engine_config
from engines.core.executor import Executor, ExecutorError
from engines.core.plan import StepPlan, StepResult
from engines.parallel.layout import ParallelLayout

log = logging.getLogger(__name__)

# how long a rank's error waits for a peer's exit to show, so that the peer that died is the one blamed
PEER_EXIT_GRACE_S = 1.0


def default_threads(engine_cfg: EngineConfig, world: int) -> int:
    return engine_cfg.worker_threads or max(1, (os.cpu_count() or 1) // world)


class MultiprocExecutor(Executor):
    def __init__(self, model_dir: str | Path, engine_cfg: EngineConfig, start_timeout_s: float | None = None):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from engines.parallel.worker_proc import worker_main

        self.model_config = ModelConfig.from_dir(model_dir)
        engine_cfg = resolve_engine_config(engine_cfg, self.model_config)  # dtype auto: once, for every shard
        self.layout = ParallelLayout.from_configs(self.model_config, engine_cfg)  # ConfigError before spawning
        self.engine_cfg = engine_cfg
        self.timeout = engine_cfg.dist_timeout_s
        self._dead: str | None = None
        self._lock = threading.Lock()
        """Held while a command is in flight: a health check from another thread (a Ray Serve
        replica's) then only reports, and the stepping thread cleans up."""
        world = self.layout.world_size
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=self.timeout),
                                   wait_for_workers=False)
        ctx = mp.get_context("spawn")
        threads = default_threads(engine_cfg, world)
        self.procs, self.conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=worker_main, name=f"shard-{rank}", daemon=True,
                            args=(rank, self.layout, "127.0.0.1", self.store.port, str(model_dir), engine_cfg,
                                  threads, child))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        deadline = time.monotonic() + (start_timeout_s or max(self.timeout, 300.0))
        self.shard_info = self._wait(set(range(world)), deadline, "start", expect="ready")
        blocks = {info["num_blocks"] for info in self.shard_info.values()}
        if len(blocks) != 1:
            self._fail(f"shards disagree on the KV pool size: {sorted(blocks)}")
        self.num_blocks = blocks.pop()

    # the contract
    def execute(self, plan: StepPlan) -> StepResult:
        return self._call("step", plan, f"step {plan.step}")

    def execute_with_logits(self, plan: StepPlan, want_logits: bool = True):
        """(StepResult, {seq_id: fp32 logits row}) : the tests' window on the sharded logits."""
        return self._call("logits", plan, f"step {plan.step}")

    def check_health(self) -> None:
        """Raise ExecutorError when a shard is gone; safe to call from any thread."""
        if self._dead is not None:
            raise ExecutorError(self._dead)
        for rank, p in enumerate(list(self.procs)):
            if not p.is_alive():
                message = f"shard worker {rank} (pid {p.pid}) exited with code {p.exitcode}"
                if self._lock.acquire(blocking=False):
                    try:
                        self._fail(message)
                    finally:
                        self._lock.release()
                raise ExecutorError(message)

    def collect_stats(self, reset: bool = False) -> dict[int, dict]:
        """Every rank's payload bytes by purpose, step spans (for the bubble) and memory."""
        self.check_health()
        with self._lock:
            self._send(("stats", reset))
            return self._wait(set(range(len(self.procs))), time.monotonic() + self.timeout, "stats")

    def shutdown(self) -> None:
        with self._lock:
            if self._dead is None and self.procs and all(p.is_alive() for p in self.procs):
                try:
                    self._send(("stop", None))
                    self._wait(set(range(len(self.procs))), time.monotonic() + 10, "stop")
                except ExecutorError:
                    pass
            self._kill_all()
            self._dead = self._dead or "executor was shut down"

    # internals
    def _call(self, kind: str, payload, what: str):
        self.check_health()
        with self._lock:
            self._send((kind, payload))
            rank = self.layout.sampler_rank
            return self._wait({rank}, time.monotonic() + self.timeout, what)[rank]

    def _send(self, msg: tuple) -> None:
        try:
            self.conns[0].send(msg)
        except (BrokenPipeError, ConnectionError, OSError) as exc:
            self._fail(f"shard worker 0 is unreachable ({exc})")

    def _wait(self, ranks: set[int], deadline: float, what: str, expect: str = "ok") -> dict[int, object]:
        """Replies of `ranks`; fails on any error reply, dead worker or the deadline."""
        got: dict[int, object] = {}
        limit = deadline - time.monotonic()
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(got) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"{what}: no reply from shard worker(s) {sorted(ranks - set(got))} within "
                           f"{limit:.0f} s (a hung shard; see dist_timeout_s)")
            ready = mp_wait([*self.conns, *by_sentinel], timeout=left)
            for obj in sorted(ready, key=lambda o: o in by_sentinel):  # messages before exits
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        kind, src, payload = obj.recv()
                    except (EOFError, OSError):
                        self._fail(f"{what}: shard worker {rank} (pid {self.procs[rank].pid}) died "
                                   f"(exit code {self.procs[rank].exitcode})")
                    if kind == "error":
                        self._fail(self._blame(what, src, payload))
                    if kind != expect:
                        self._fail(f"{what}: unexpected {kind!r} from shard worker {src}")
                    got[src] = payload
                else:
                    rank = by_sentinel[obj]
                    p = self.procs[rank]
                    p.join(timeout=0.1)
                    self._fail(f"{what}: shard worker {rank} (pid {p.pid}) died (exit code {p.exitcode})")
        return got

    def _blame(self, what: str, src: int, payload) -> str:
        """A rank's collective fails when a peer dies (gloo: "connection reset by peer"): wait briefly for the
        peers' exits, so that the message names the worker that died rather than its first victim."""
        peers = {p.sentinel: r for r, p in enumerate(self.procs) if r != src}
        dead = sorted(peers[s] for s in mp_wait(list(peers), timeout=PEER_EXIT_GRACE_S))
        if not dead:
            return f"{what}: shard worker {src} failed: {payload}"
        rank = dead[0]
        p = self.procs[rank]
        p.join(timeout=0.1)
        return (f"{what}: shard worker {rank} (pid {p.pid}) died (exit code {p.exitcode}); "
                f"as a result shard worker {src} failed: {payload}")

    def _fail(self, message: str):
        if self._dead is None:
            self._dead = message
            log.error("multiprocess executor failed: %s", message)
        self._kill_all()
        raise ExecutorError(self._dead)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.conns = []
        self.procs = []
        self.store = None
