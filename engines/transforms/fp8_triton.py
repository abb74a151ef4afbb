"""FP8 weight-only Linear on a GPU: e4m3 weights read at one byte each and widened to bf16 in registers.

Decode reads every weight once a step and does little arithmetic with it, so a batch-1 or batch-8 step is
bound by the weight bytes. `torch._scaled_mm` (engines/transforms/fp8.py) halves those bytes too, but it first
quantizes the activation (a reduction and a cast, two more launches a layer) and its CUTLASS tiles are sized
for large M: on the H200 (torch 2.11) the load-time timing picked plain bf16 over it for all 128 Linears of the
Llama-8B shape (FP8 1.00x bf16 at batch 1). This kernel (Triton, which ships with torch's CUDA builds) keeps x
in bf16 and streams W (N, K) e4m3 tile by tile, converting each tile in registers before `tl.dot`; the
per-output-channel scale and the bias are applied to the fp32 sums before the single bf16 store.

`triton_available()` says whether it can run here (CUDA, compute capability >= 8.9, triton importable);
engines.transforms.fp8_choice times it beside the other kernels for each layer shape and keeps it only
where it is the fastest. With TRITON_INTERPRET=1 the same kernel runs on CPU tensors (numpy), which is how
the tests check its arithmetic on a machine without a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

CONFIGS = {"wo-n32": (32, 128)}
"""Kernel variants timed at load: name -> (BLOCK_N outputs, BLOCK_K inputs) per program. On the H200 (2026-11-30,
Llama-8B shapes, 1 / 8 / 64 rows) this one was the fastest of three on every shape; (16, 256) and (64, 128) were
slower by 5-60 % and only added compile and timing time at load. It still reads weights at ~1.6 TB/s at one row
(qkv 6144x4096: 15.4 us against bf16's 16.4; up 28672x4096: 44.4 against 56.6), far from the copy rate's ~4 TB/s:
the next step is split-K (one program per SM streams a whole row block today)."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel (triton imported on first use only: engines/ runs with torch alone)."""
    import triton
    import triton.language as tl

    @triton.jit
    def wo_fp8_linear(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      UPCAST: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # (BLOCK_M, BLOCK_K)
        w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # (BLOCK_K, BLOCK_N): W^T's tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(tl.cdiv(K, BLOCK_K)):
            if K % BLOCK_K == 0:  # no mask along the contiguous axis: 16-byte loads
                x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
                w = tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0)
            else:
                k_ok = (kb * BLOCK_K + rk) < K
                x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0)
            if UPCAST:  # the interpreter's tl.dot multiplies bf16 inputs' raw bits (triton 3.6): fp32 there
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        n_ok = rn < N
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])

    return wo_fp8_linear


def triton_available(device: torch.device | str) -> bool:
    """CUDA with FP8 conversions (compute capability >= 8.9) and triton importable; or the interpreter (tests)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return _interpreting() and _importable()
    return dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(dev) >= (8, 9) \
        and _importable()


@functools.lru_cache(maxsize=1)
def _importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def block_m(m: int) -> int:
    """Rows per program: tl.dot wants at least 16; a decode batch rarely fills more than 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def wo_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  block_n: int, block_k: int) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ (weight (N, K) e4m3 * scale (N,) fp32)^T + bias -> (M, N) in x's dtype."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"wo_fp8_linear: x must be bfloat16 or float16, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("wo_fp8_linear: weight (N, K) float8_e4m3fn and x (M, K), each row-contiguous")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = block_m(m)
    grid = ((n + block_n - 1) // block_n, (m + bm - 1) // bm)
    _kernel()[grid](x, weight, scale, bias if bias is not None else scale, y, m, n, x.stride(0), weight.stride(0), y.stride(0),
                    K=k, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
                    UPCAST=_interpreting(), num_warps=4, num_stages=4)
    return y


@torch.library.custom_op("shardserve::wo_fp8_linear", mutates_args=())
def wo_fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     block_n: int, block_k: int) -> torch.Tensor:
    """wo_fp8_linear as one operator for a compiled decode step (fullgraph), which calls it as it is."""
    return wo_fp8_linear(x, weight, scale, bias, block_n, block_k)


@wo_fp8_linear_op.register_fake
def _(x, weight, scale, bias, block_n, block_k):
    return x.new_empty(x.shape[0], weight.shape[0])


class WeightOnlyFp8Linear(nn.Module):
    """An engines.transforms.fp8.Fp8Linear (e4m3 weight (out, in), fp32 weight_scale (out, 1)) run through
    the Triton kernel with the `config` (a CONFIGS name) that the load-time timing chose for its shape. A
    row-parallel shard all-reduces the product, then adds the bias."""

    def __init__(self, src: nn.Module, config: str = "wo-n32"):
        super().__init__()
        if config not in CONFIGS:
            raise ValueError(f"weight-only FP8 config {config!r}; allowed: {sorted(CONFIGS)}")
        self.in_features, self.out_features, self.config = src.in_features, src.out_features, config
        self.block_n, self.block_k = CONFIGS[config]
        self.weight = src.weight  # (N, K) e4m3, shared with the source: no copy
        self.register_buffer("scale", src.weight_scale.detach().float().reshape(-1).contiguous(), persistent=False)
        self.bias, self.comm = src.bias, src.comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        fused_bias = self.bias if self.comm is None else None
        run = wo_fp8_linear_op if torch.compiler.is_compiling() else wo_fp8_linear  # eager skips the dispatch
        y = run(x2, self.weight, self.scale, fused_bias, self.block_n, self.block_k)
        if self.comm is not None:
            y = self.comm.all_reduce(y, "tp_layer")
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, e4m3 weight-only (Triton, {self.config})"
