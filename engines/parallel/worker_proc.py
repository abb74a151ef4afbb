"""The shard worker's loop, shared by the multiprocess executor (a spawned process per rank) and the
Ray executor (an actor per rank).

Rank 0 takes each command from the driver over its channel and broadcasts it to every rank
(the plan is pickled once and crosses the process group once); the sampling rank (last stage,
TP rank 0) sends the step result back over its own channel. Any rank reports its own failure
over its channel, so the driver learns of it without waiting for a collective to time out.

Commands: ("step", plan) -> StepResult; ("logits", plan) -> (StepResult, {seq_id: logits});
("stats", reset) -> every rank's counters; ("stop", None).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Protocol

import torch

from engines.core.config import EngineConfig
from engines.parallel.comm import Comm
from engines.parallel.layout import ParallelLayout
from engines.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)


class Channel(Protocol):
    def recv(self) -> tuple: ...

    def poll(self, timeout_s: float) -> bool:
        """True when a command can be received now or arrives within timeout_s."""

    def send(self, msg: tuple) -> None: ...


def memory_bytes() -> dict[str, int]:
    """Resident memory of this process (Linux /proc): rss, and anon (heap: weights, KV cache,
    runtime) apart from file-backed pages (mapped safetensors pages and libraries, reclaimable)."""
    out = {"rss": 0, "anon": 0, "file": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                name = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}.get(key)
                if name:
                    out[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def release_memory() -> None:
    """Hand the loader's freed temporaries back to the OS (glibc keeps freed heap otherwise)."""
    import gc

    from engines.cpu.host_memory import give_back_freed_memory

    gc.collect()
    give_back_freed_memory()


def shard_info(runner: ModelRunner) -> dict:
    from engines.parallel.sharded_loading import expected_shard_bytes, shard_bytes

    start, end = runner.layout.stages[runner.pp_rank]
    return {"rank": runner.rank, "tp_rank": runner.tp_rank, "pp_rank": runner.pp_rank, "layers": (start, end),
            "num_blocks": runner.num_blocks, "weight_bytes": shard_bytes(runner.model),
            "expected_weight_bytes": expected_shard_bytes(runner.cfg, runner.layout.tp, start, end,
                                                          torch.empty(0, dtype=runner.dtype).element_size()),
            "kv_bytes": runner.cache.nbytes, "pid": os.getpid(), "why_not": dict(runner.why_not),
            **{f"{k}_bytes": v for k, v in memory_bytes().items()}}


def stats(runner: ModelRunner, comm: Comm, reset: bool) -> dict:
    out = {"rank": runner.rank, "tp_rank": runner.tp_rank, "pp_rank": runner.pp_rank, "bytes": dict(comm.bytes),
           "calls": dict(comm.calls), "spans": list(runner.spans),
           "paths": dict(runner.paths), "rss_bytes": memory_bytes()["rss"]}
    if reset:
        comm.reset_counters()
        runner.spans.clear()
        runner.paths.clear()
    return out


def serve(runner: ModelRunner, comm: Comm, channel: Channel, keepalive_s: float = 10.0) -> None:
    """Run commands until "stop". Raises on any failure (the caller reports it).

    The other ranks wait for rank 0's next command inside a collective, whose timeout is there to
    catch a hung peer; an idle server must not look hung. So rank 0, with no command for
    keepalive_s (a fraction of the collective timeout), broadcasts a keepalive that every rank
    ignores: a replica idle for hours stays up, and its bytes are counted apart from the plans'."""
    while True:
        msg = None
        if runner.rank == 0:
            msg = channel.recv() if channel.poll(keepalive_s) else ("keepalive", None)
        kind, payload = comm.broadcast_object(msg, purpose="keepalive" if msg and msg[0] == "keepalive" else "plan")
        if kind == "keepalive":
            continue
        if kind in ("step", "logits"):
            result, logits = runner.run(payload, want_logits=kind == "logits")
            if runner.samples:
                channel.send(("ok", runner.rank, result if kind == "step" else (result, logits)))
        elif kind == "stats":
            channel.send(("ok", runner.rank, stats(runner, comm, bool(payload))))
        elif kind == "stop":
            channel.send(("ok", runner.rank, None))
            return
        else:
            raise ValueError(f"unknown command {kind!r}")


def device_for(engine_cfg: EngineConfig, rank: int) -> torch.device:
    """cuda:<local index> for a GPU engine (one GPU per rank), else the configured device."""
    if engine_cfg.device.startswith("cuda") and torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(engine_cfg.device)


def collective_timeout_s(step_deadline_s: float) -> float:
    """A shard's collective timeout: longer than the driver's step deadline (dist_timeout_s).

    When one shard hangs, its peers wait on it in a collective. The driver, which sees every rank,
    must reach its deadline first and name the hung shard; were the peers' collectives to time out
    first (on a busy host, the two clocks race), the step would fail naming a healthy peer."""
    return step_deadline_s + max(2.0, 0.25 * step_deadline_s)


def run_worker(rank: int, layout: ParallelLayout, store_host: str, store_port: int, model_dir: str,
               engine_cfg: EngineConfig, threads: int, channel: Channel) -> None:
    """Join the group, load the shard, report ready, serve; report any failure on the channel."""
    from engines.parallel.comm import init_distributed

    try:
        torch.set_num_threads(threads)
        device = device_for(engine_cfg, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cfg = engine_cfg.replace(device=str(device))
        backend = "nccl" if device.type == "cuda" else "gloo"
        t0 = time.perf_counter()
        comm = init_distributed(rank, layout.world_size, store_host, store_port, backend,
                                collective_timeout_s(engine_cfg.dist_timeout_s), layout, device)
        runner = ModelRunner(model_dir, cfg, layout=layout, rank=rank, comm=comm)
        release_memory()
        info = shard_info(runner)
        info["load_s"] = time.perf_counter() - t0
        channel.send(("ready", rank, info))
        serve(runner, comm, channel, keepalive_s=collective_timeout_s(engine_cfg.dist_timeout_s) / 4)
    except BaseException as exc:
        try:
            channel.send(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except Exception as send_exc:  # noqa: BLE001 - the driver is gone or the pipe is broken
            log.debug("shard %d could not report its failure: %r", rank, send_exc)
        raise


def worker_main(rank: int, layout: ParallelLayout, store_host: str, store_port: int, model_dir: str,
                engine_cfg: EngineConfig, threads: int, conn) -> None:
    """Entry point of a spawned shard process; `conn` is its end of a duplex Pipe to the driver."""
    try:
        run_worker(rank, layout, store_host, store_port, model_dir, engine_cfg, threads, conn)
    except BaseException:  # noqa: BLE001 - already reported; exit non-zero without a second traceback
        os._exit(1)
    os._exit(0)
