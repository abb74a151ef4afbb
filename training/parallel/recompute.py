"""Activation recomputation: keep a region's inputs, drop everything it saved, redo it in backward.

Like Megatron's CheckpointFunction (and unlike torch.utils.checkpoint's non-reentrant mode) the
inputs are kept with `save_for_backward`, so a saved-tensor hook sees exactly what stays alive
(memory.py counts with one). The default generator and the TP tracker's stream are captured at
the region's entry and restored for the recomputation, so dropout masks come out identical;
both are put back afterwards, so the rest of the run's randomness is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from training.parallel.rng import RNGTracker, get_rng, set_rng


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tracker, device, *inputs):
        ctx.fn, ctx.tracker, ctx.device = fn, tracker, device
        ctx.amp = (torch.get_autocast_dtype(device.type), torch.is_autocast_enabled(device.type))
        ctx.rng = get_rng(device)
        ctx.tracker_rng = tracker.state.clone() if tracker is not None else None
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:])]
        now_rng = get_rng(ctx.device)
        now_tracker = ctx.tracker.state if ctx.tracker is not None else None
        set_rng(ctx.device, ctx.rng)
        if ctx.tracker is not None:
            ctx.tracker.state = ctx.tracker_rng
        try:
            dtype, enabled = ctx.amp  # the forward's autocast state, as torch.utils.checkpoint restores it
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                outputs = ctx.fn(*inputs)
        finally:
            set_rng(ctx.device, now_rng)
            if ctx.tracker is not None:
                ctx.tracker.state = now_tracker
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *[x.grad if x.requires_grad else None for x in inputs])


def recompute(fn: Callable[..., torch.Tensor], tracker: RNGTracker | None, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), its activations recomputed in backward. `fn` may use parameters (their
    gradients accumulate during the recomputation) and collectives (every rank recomputes)."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    return _Recompute.apply(fn, tracker, inputs[0].device, *inputs)
