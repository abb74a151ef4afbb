"""The GPU's FP8 weight-only kernel (engines/transforms/fp8_triton.py) checked on CPU: triton's interpreter
(TRITON_INTERPRET=1) runs the same kernel on CPU tensors with numpy. `make setup` installs the triton the GPU
image has into .venv/triton-interp, apart from .venv's own packages (torch's CPU build does not pin triton, and
inductor's CPU path must not see it). What only a GPU shows (speed, the bf16 tl.dot, CUDA graphs) is
benchmarks/bench_gpu.py's fp8 section."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRITON = ROOT / ".venv" / "triton-interp"

CHECK = r'''
import torch
from engines.transforms.fp8 import Fp8Linear
from engines.transforms.fp8_triton import (CONFIGS, GEMV, GEMV_SPLIT_ROWS, WeightOnlyFp8Linear, split_plan,
                                          triton_available, wo_fp8_linear)

assert triton_available("cpu")
torch.manual_seed(0)
splits = set()
for n, k, bias in ((40, 130, True), (48, 256, False), (64, 576, True)):  # K a multiple of BLOCK_K or not
    ref = Fp8Linear.quantize(torch.nn.Linear(k, n, bias=bias))  # e4m3 weight, per-channel scales
    w = ref.weight.float() * ref.weight_scale.float()  # what the kernel computes with
    for dtype in (torch.bfloat16, torch.float16):
        b = ref.bias.detach().float() if bias else 0.0
        for config in CONFIGS:
            layer = WeightOnlyFp8Linear(ref, config)
            if bias:
                layer.bias = torch.nn.Parameter(ref.bias.detach().to(dtype), requires_grad=False)
            assert layer.weight.data_ptr() == ref.weight.data_ptr()  # one byte a weight, shared, no copy
            # 70: past SPLIT_MAX_ROWS, never split. A GEMV program holds one row (no tile edge in M): its split
            # (up to GEMV_SPLIT_ROWS) and unsplit paths at 1-5 rows; more rows only cost the interpreter time
            gemv = CONFIGS[config][3] == GEMV
            for m in (1, GEMV_SPLIT_ROWS, GEMV_SPLIT_ROWS + 1) if gemv else (1, 5, 17, 40, 70):
                x = torch.randn(m, k).to(dtype)
                want = (x.float() @ w.T + b).to(dtype)
                torch.testing.assert_close(layer(x), want, atol=1e-3, rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3,
                                           msg=lambda s: f"{n}x{k} {dtype} {config} m={m}: {s}")
                assert not layer.counters.any(), "a split call left its tile counters set"
                splits.add(split_plan(m, n, k, layer.block_n, layer.block_k, layer.per_sm, 4, layer.mode))
assert {(5, 1), (3, 1), (2, 1)} <= splits, splits  # K split over a ragged last block (130, 576) and whole ones (256)
assert all(split * per == -(-k // bk) for k in (130, 256, 576, 4096, 14336) for bk in (128, 256, 512) for m in (1, 8, 64)
           for split, per in [split_plan(m, 6144, k, 32, bk, 4, 132)]), 'a slice reached past K'
layer = WeightOnlyFp8Linear(ref, "wo-n32")
layer.bias = torch.nn.Parameter(ref.bias.detach().bfloat16(), requires_grad=False)
x = torch.randn(2, 3, 576).bfloat16()
with torch.inference_mode():  # a compiled decode step (fullgraph) calls it as one operator
    assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x))
for bad, what in ((x.float().view(6, 576), "bfloat16 or float16"), (x.view(6, 576)[:, ::2], "row-contiguous")):
    try:
        wo_fp8_linear(bad, layer.weight if what != "row-contiguous" else layer.weight[:, ::2], layer.scale, None, 32, 128)
    except ValueError as exc:
        assert what in str(exc), exc
    else:
        raise AssertionError(f"no error for {what}")
try:
    wo_fp8_linear(x.view(6, 576), layer.weight, layer.scale, None, 32, 128, per_sm=4)
except ValueError as exc:
    assert "counters" in str(exc), exc
else:
    raise AssertionError("no error for a split call without counters")
print("OK")
'''


def test_weight_only_kernel_equals_the_dequantized_product_in_the_interpreter():
    """Every config at 1-70 rows (tile edges in M, N and K; GEMV's one row a program at 1-5), bias or none, bf16 and
    fp16 rows, K split into equal slices (over a ragged last block or not) or not split, tl.dot, swapped (y^T = W x^T)
    or GEMV: the kernel's output equals x @ (e4m3 weight * per-channel scale)^T + bias rounded to x's dtype, and a
    split call leaves its tile counters at zero; compiled = eager; bad input gets a ValueError naming what is allowed."""
    if not (TRITON / "triton").is_dir():
        pytest.skip(f"triton's interpreter is not installed in {TRITON} (make setup installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TRITON), str(ROOT)]))
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:] + run.stderr[-3000:]
