"""Process groups and launchers for data-parallel training.

One training function (`training.trainer.train`) runs on every rank. It gets a `DistContext`
from `init_context`, which joins the process group a launcher prepared:

- one rank: no process group at all (the plain single-process path);
- `spawn_local`: torch.multiprocessing workers on this machine (tests, no Ray needed);
- `launch_ray`: Ray Train `TorchTrainer` workers, so the cluster that serves also trains; Ray
  creates the process group (gloo on CPU, NCCL on GPU) before our function runs.

The launcher plumbing uses the standard variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and nothing else.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: Any = None
    """The data-parallel process group (None with one rank). Tensor/pipeline groups join it later."""
    owns_group: bool = False
    """True when init_context created the process group (and so shutdown destroys it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In place; a CPU tensor makes the round trip to the GPU under NCCL."""
        if self.world_size > 1:
            buf = t.to(self.device)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            if buf is not t:
                t.copy_(buf)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t`, on t's device."""
        if self.world_size == 1:
            return [t]
        buf = t.to(self.device).contiguous()
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.group)
        return [o.to(t.device) for o in out]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


class StopFlag:
    """SIGTERM / SIGINT set a flag that the training loop reads once per step.

    A launched rank calls `StopFlag.install_early()` first thing, so a signal that arrives while
    it is still importing or loading data is remembered rather than killing it unsaved. Handlers
    can only be installed from the main thread; elsewhere (a thread) the flag stays unset.
    """

    _early = False

    @classmethod
    def _early_handler(cls, signum, frame) -> None:
        cls._early = True

    @classmethod
    def install_early(cls) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, cls._early_handler)

    def __init__(self) -> None:
        self.set = StopFlag._early
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.set = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def pick_device(kind: str, local_rank: int = 0) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("train.device: cuda requested but no CUDA device is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_context(device_kind: str = "auto") -> DistContext:
    """Join the process group a launcher prepared, or run as the single rank."""
    if dist.is_available() and dist.is_initialized():  # Ray Train (or a caller) made the group
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return DistContext(rank, world, local, pick_device(device_kind, local), dist.group.WORLD)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistContext(device=pick_device(device_kind))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = pick_device(device_kind, local)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    return DistContext(rank, world, local, device, dist.group.WORLD, owns_group=True)


def shutdown(ctx: DistContext, all_done: bool = False) -> None:
    """Tear down the process group this module created (Ray Train tears down its own). all_done:
    this rank finished normally, so every rank should arrive: meet them first, so that no rank tears
    its side down while a peer's gloo threads still talk to it (a peer aborted in teardown once,
    "terminate called without an active exception"); a rank that does not arrive within a minute
    fails the barrier instead of hanging it."""
    if ctx.owns_group and dist.is_initialized():
        if all_done and ctx.world_size > 1:
            try:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=timedelta(seconds=60))
                else:
                    dist.barrier()
            finally:
                dist.destroy_process_group()
        else:
            dist.destroy_process_group()


def free_port() -> int:
    """A port free on 127.0.0.1, chosen below the kernel's ephemeral range when possible.

    A port from bind(0) is an ephemeral one: the kernel may hand it to any outgoing connection
    between now and its use (Ray starts dozens of processes in that time). Ports in 20000 up to the
    ephemeral range are above Ray's worker ports (10002-19999) and are never given out that way.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100 if low > 21000 else 0):
        port = rng.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere the range differs, but 20000-32767 is rarely used


def _spawned(local_rank: int, world_size: int, port: int, threads: int, fn: Callable, args: tuple) -> None:
    StopFlag.install_early()
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if threads:
        torch.set_num_threads(threads)
    fn(*args)


def spawn_local(fn: Callable, world_size: int, args: tuple = (), threads_per_rank: int = 0) -> None:
    """Run fn(*args) on `world_size` local processes (spawned, so safe after torch is loaded).

    `threads_per_rank` 0 splits this machine's cores evenly between the ranks. SIGTERM or
    Ctrl-C to this process is passed on to every rank as SIGTERM, so they checkpoint together.
    """
    import torch.multiprocessing as mp

    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    context = mp.start_processes(_spawned, args=(world_size, free_port(), threads, fn, args), nprocs=world_size,
                                 join=False, start_method="spawn")

    def forward(signum, frame) -> None:
        for proc in context.processes:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not context.join():
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def init_ray(address: str | None = None, pause_s: float = 5.0, **kwargs: Any) -> None:
    """ray.init(address, **kwargs); a local Ray started here (no address) gets three starts, a pause before each
    retry, where its raylet missed Ray's fixed 30 s registration wait (a loaded host: CI at load 8 met it twice
    in a row). A cluster's address gets one try: it is not ours to restart."""
    import ray

    for attempt in range(1, 4):
        try:
            ray.init(address=address, **kwargs)
            return
        except Exception as exc:
            if address or attempt == 3 or "timed out during startup" not in str(exc):
                raise
            logging.getLogger(__name__).warning("Ray did not start (%s); starting it again", exc)
            ray.shutdown()
            time.sleep(pause_s * attempt)


def launch_ray(fn: Callable[[dict], Any], config: dict, num_workers: int, device: str,
               storage_path: str, name: str) -> None:
    """Run fn(config) on `num_workers` Ray Train workers (joins a running cluster or starts one).

    device "auto" uses one GPU per worker when the cluster has enough, else CPU workers on gloo.
    """
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = not ray.is_initialized()
    if started:
        if not os.environ.get("RAY_ADDRESS"):  # a local instance: workers at the caller's priority,
            os.environ.setdefault("RAY_worker_niceness", "0")  # not Ray's nice 15 (serving/launcher.py)
            # and no preemption watcher: Ray Train's controller (Ray 2.60) starts one more actor process to poll
            # the node's drain state every 5 s, which a one-node Ray we started and stop never reports (on 2 busy
            # cores, one more Ray worker's start beside the controller's and the ranks': ~3 s of CPU)
            os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        init_ray(os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=True)
    resources = ray.cluster_resources()
    use_gpu = device == "cuda" or (device == "auto" and resources.get("GPU", 0) >= num_workers)
    cpus = max(1, int(resources.get("CPU", 1)) // num_workers)
    trainer = TorchTrainer(
        fn, train_loop_config=config,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(storage_path=os.path.abspath(storage_path), name=name))
    try:
        trainer.fit()
    finally:
        if started:
            ray.shutdown()
