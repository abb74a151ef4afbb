"""Dropout randomness per tensor-parallel rank (the idea of Megatron's CUDA RNG tracker).

Where a tensor is split across the TP group (attention probabilities of a rank's heads; with
sequence parallelism, every activation of a rank's sequence shard), each rank must draw its own
mask, so dropout runs inside `tracker.fork()`: the device generator is swapped for a stream
seeded per TP rank, then swapped back. Where a tensor is replicated (the hidden states without
SP), every TP rank must draw the same mask, so dropout uses the default generator, which the
trainer seeds identically across a TP group. Recomputation (recompute.py) saves and restores
both streams, so a recomputed dropout draws the masks of the original forward.
"""

from __future__ import annotations

import contextlib

import torch


def get_rng(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """A second generator stream on `device`, used inside `fork()`."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        saved = get_rng(device)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.state = get_rng(device)
        set_rng(device, saved)

    @contextlib.contextmanager
    def fork(self):
        saved = get_rng(self.device)
        set_rng(self.device, self.state)
        try:
            yield
        finally:
            self.state = get_rng(self.device)
            set_rng(self.device, saved)


def tracker_seed(seed: int, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
    """Megatron offsets its model-parallel seed by 2718 + tp_rank; we also separate DP replicas and
    stages (each draws masks for different data and layers)."""
    return (seed * 1_000_003 + 2718 + tp_rank + 101 * dp_rank + 10_007 * pp_rank) % 2**63
