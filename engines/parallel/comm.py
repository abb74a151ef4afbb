"""The collectives a shard uses, behind one small interface that counts the bytes it moves.

Parallel layers take a `Comm` as an argument (never a global), so they build and run on one
CPU with `LocalComm` (a world of one) and in tests with a thread-backed group; `DistComm` is the
torch.distributed one (gloo on CPU, NCCL on GPU).

Bytes are counted as payload: an all-reduce of an (N, C) fp32 tensor counts N*C*4 bytes, the
quantity of the analytic model ("two all-reduces of batch x hidden per layer"). For a ring
all-reduce each rank sends 2(p-1)/p times that, which is exactly the payload when p == 2.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

import torch

ARRIVED_KEY = "shardserve/ranks_arrived"


class Comm:
    """A shard's view of its tensor-parallel group and its pipeline neighbours."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        """Payload bytes by purpose: tp_layer, tp_embed, tp_logits, pp_send, plan."""
        self.calls: dict[str, int] = defaultdict(int)

    def count(self, what: str, t: torch.Tensor) -> None:
        self.bytes[what] += t.numel() * t.element_size()
        self.calls[what] += 1

    def reset_counters(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    # tensor parallel
    def all_reduce(self, t: torch.Tensor, what: str = "tp_layer") -> torch.Tensor:
        """Sum over the TP group (in place where possible); returns the sum."""
        raise NotImplementedError

    def gather(self, t: torch.Tensor, what: str = "tp_logits") -> list[torch.Tensor] | None:
        """Every TP rank's `t` (same shape everywhere), in rank order, on TP rank 0; None elsewhere."""
        raise NotImplementedError

    # pipeline parallel
    def send_next(self, t: torch.Tensor, tag: int) -> None:
        """Start sending activations to the same TP rank of the next stage (completes in flush())."""
        raise NotImplementedError

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> torch.Tensor:
        raise NotImplementedError

    def flush(self) -> None:
        """Wait until every started send has completed."""

    # the whole world
    def broadcast_object(self, obj: object, purpose: str = "plan") -> object:
        """Rank 0's `obj` on every rank (the step plan: pickled once, sent once to each rank);
        its bytes are counted under `purpose`."""
        return obj


class LocalComm(Comm):
    """A world of one: every collective is the identity."""

    def all_reduce(self, t: torch.Tensor, what: str = "tp_layer") -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor, what: str = "tp_logits") -> list[torch.Tensor] | None:
        return [t]


class DistComm(Comm):
    """torch.distributed: an all-reduce/gather group per stage, point-to-point between stages."""

    def __init__(self, tp_size: int, tp_rank: int, pp_size: int, pp_rank: int, tp_group, tp_ranks: list[int],
                 prev_rank: int | None, next_rank: int | None, device: torch.device, rank: int = 0,
                 world_size: int = 1):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.tp_size, self.tp_rank, self.pp_size, self.pp_rank = tp_size, tp_rank, pp_size, pp_rank
        self.group, self.tp_ranks = tp_group, tp_ranks
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.device = device
        self._pending: list = []

    def all_reduce(self, t: torch.Tensor, what: str = "tp_layer") -> torch.Tensor:
        import torch.distributed as dist

        if self.tp_size == 1:
            return t
        self.count(what, t)
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        return t

    def gather(self, t: torch.Tensor, what: str = "tp_logits") -> list[torch.Tensor] | None:
        import torch.distributed as dist

        if self.tp_size == 1:
            return [t]
        t = t.contiguous()
        if self.tp_rank == 0:
            out = [torch.empty_like(t) for _ in range(self.tp_size)]
            dist.gather(t, out, dst=self.tp_ranks[0], group=self.group)
            return out
        self.count(what, t)  # payload sent to the root
        dist.gather(t, None, dst=self.tp_ranks[0], group=self.group)
        return None

    def send_next(self, t: torch.Tensor, tag: int) -> None:
        import torch.distributed as dist

        t = t.contiguous()
        self.count("pp_send", t)
        self._pending.append((dist.isend(t, self.next_rank, tag=tag), t))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, tag: int) -> torch.Tensor:
        import torch.distributed as dist

        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self.prev_rank, tag=tag)
        return t

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def broadcast_object(self, obj: object, purpose: str = "plan") -> object:
        import pickle

        import torch.distributed as dist

        if self.world_size == 1:
            return obj
        # pickled by rank 0 only: a length, then the bytes (a pinned CPU tensor with gloo; NCCL
        # needs device tensors)
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8).to(dev)
            length = torch.tensor([data.numel()], dtype=torch.long, device=dev)
            self.count(purpose, data)
        else:
            length = torch.zeros(1, dtype=torch.long, device=dev)
        dist.broadcast(length, src=0)
        if self.rank != 0:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
        dist.broadcast(data, src=0)
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())


def init_distributed(rank: int, world_size: int, store_host: str, store_port: int, backend: str,
                     timeout_s: float, layout, device: torch.device, start_timeout_s: float = 300.0) -> DistComm:
    """Join the group through the driver's TCPStore and build this rank's DistComm.

    Every rank creates every stage's TP group, in the same order (torch.distributed requires it).
    timeout_s bounds each collective (a hung peer); start_timeout_s bounds the wait for all ranks to
    arrive, which on a busy machine (each rank imports torch and loads its shard) can take longer.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    start = max(timeout_s, start_timeout_s)
    store = dist.TCPStore(store_host, store_port, world_size=None, is_master=False, timeout=timedelta(seconds=start))
    # a barrier on the store first, so that the group forms only once every rank is there
    store.add(ARRIVED_KEY, 1)
    deadline = time.monotonic() + start
    while (arrived := store.add(ARRIVED_KEY, 0)) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} shard ranks joined within {start:.0f} s")
        time.sleep(0.02)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    tp_rank, pp_rank = layout.coords(rank)
    my_group = None
    for s in range(layout.pp):
        ranks = layout.tp_group_ranks(s)
        g = dist.new_group(ranks, timeout=timeout) if layout.tp > 1 else None
        if s == pp_rank:
            my_group = g
    prev_rank = layout.rank(tp_rank, pp_rank - 1) if pp_rank > 0 else None
    next_rank = layout.rank(tp_rank, pp_rank + 1) if pp_rank < layout.pp - 1 else None
    return DistComm(layout.tp, tp_rank, layout.pp, pp_rank, my_group, layout.tp_group_ranks(pp_rank),
                    prev_rank, next_rank, device, rank=rank, world_size=world_size)
