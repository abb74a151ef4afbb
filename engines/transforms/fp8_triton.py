"""FP8 weight-only Linear on a GPU: e4m3 weights read at one byte each and widened to bf16 in registers.

Decode reads every weight once a step and does little arithmetic with it, so a batch-1 or batch-8 step is
bound by the weight bytes. `torch._scaled_mm` (engines/transforms/fp8.py) halves those bytes too, but it first
quantizes the activation (a reduction and a cast, two more launches a layer) and its CUTLASS tiles are sized
for large M: on the H200 (torch 2.11) the load-time timing picked plain bf16 over it for all 128 Linears of the
Llama-8B shape (FP8 1.00x bf16 at batch 1). This kernel (Triton, which ships with torch's CUDA builds) keeps x
in bf16 and streams W (N, K) e4m3 tile by tile, converting each tile in registers before `tl.dot` (or, at one
row, before fp32 multiplies and adds: the GEMV configs); the per-output-channel scale and the bias are applied to
the fp32 sums before the single bf16 store.

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

DOT, SWAP, GEMV = 0, 1, 2
"""How a config computes its tile: tl.dot of (rows, K) x (K, outputs); tl.dot swapped, y^T = W x^T; or no tl.dot
at all (GEMV): the widened weight tile times each row's x, summed along K in fp32 registers."""

CONFIGS = {"wo-n32": (32, 128, 0, DOT, 4), "wo-n32-sk2": (32, 128, 2, DOT, 4), "wo-n32-sk4": (32, 128, 4, DOT, 4),
           "wo-t64-sk2": (64, 128, 2, SWAP, 4), "wo-t64-sk4": (64, 128, 4, SWAP, 4),
           "gv-n16-k512-sk4": (16, 512, 4, GEMV, 4), "gv-n8-k512-sk8": (8, 512, 8, GEMV, 4),
           "gv-n32-k256-sk4": (32, 256, 4, GEMV, 4)}
"""Kernel variants timed at load: name -> (BLOCK_N outputs, BLOCK_K inputs per program, programs per SM wanted
through split-K (0: none), mode, triton's num_stages: loads of later K blocks in flight, staged in shared memory,
which also bounds how many programs an SM holds). DOT pads the rows to 16 (tl.dot's least M); SWAP makes the
weight tile the wide operand (64 outputs, what Hopper's warp-group product wants as its M) and the rows the narrow
one; GEMV (one row a program, a tile's rows neighbouring programs, so that the rows after the first read it from
L2; timed at one row only: a plan's one-row kernel also runs two) multiplies and adds in fp32 without tl.dot:
nothing is padded, each thread holds whole 16-byte runs of the e4m3 row, and the sums cross threads once, after
the last K block. On the H200 (2026-12-04) it read e4m3 at 1.9-3.3 TB/s at one row (the padded tl.dot at 1.5-2.7),
in 0.63-0.65x bf16's time on each Llama-8B shape; at 8 rows a program holding all 8 (fp32 products of a (rows,
outputs, K) block) was 5-70x slower than tl.dot, so a GEMV program holds one row. (16, 512) split for 8 programs
an SM with num_stages 1 and (16, 256) for 8 with 2 were 1-30 % slower than these three at one row. Without a
split, each program streams a whole BLOCK_N row block of W: on the H200 (2026-11-30, Llama-8B shapes) "wo-n32"
read the weights at ~1.6 TB/s at one row (qkv 6144x4096: 15.4 us against bf16's 16.4), 128-192 programs for 132
SMs, too few loads in flight for HBM. A split cuts K into slices so that about that many programs run per SM; each
writes its fp32 partial sums, and the last slice of a tile to finish (a counter per tile) adds the slices in slice
order (the same sum whatever the finishing order) and stores the bf16 result: one launch, no memset. (16, 256) and
(64, 128) without a split were 5-60 % slower than "wo-n32" on every shape there; (16, 256) split four ways 10-90 %
slower than wo-n32-sk4, (128, 64) swapped and split four ways slower than wo-t64-sk2 (2026-12-04)."""

GEMV_SPLIT_ROWS = 4
"""A GEMV call splits K only up to this many rows (beyond, tl.dot's configs are the faster ones): its tile
counters, one per (row, BLOCK_N outputs), stay few."""

SPLIT_MAX_ROWS = 64
"""Split-K only for decode-sized products: past this many rows the tiles alone fill the device."""


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel (triton imported on first use only: engines/ runs with torch alone)."""
    import triton
    import triton.language as tl

    @triton.jit
    def wo_fp8_linear(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, stride_wn, stride_ym,
                      K: tl.constexpr, KB_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      MODE: tl.constexpr, UPCAST: tl.constexpr):
        if MODE == 2:  # GEMV: a tile's rows are neighbouring programs, so the rows after the first read it from L2
            pid_m, pid_n, grid_m, grid_n = tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1)
        else:
            pid_n, pid_m, grid_n, grid_m = tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1)
        pid_k = tl.program_id(2)  # this program's slice of K: KB_SPLIT blocks of BLOCK_K
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = pid_k * (KB_SPLIT * BLOCK_K) + tl.arange(0, BLOCK_K)
        if MODE == 2:  # GEMV, one row a program: the e4m3 tile widened to fp32 times x's row, no tl.dot
            x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # (1, BLOCK_K)
            w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]  # (BLOCK_N, BLOCK_K)
            acc_k = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed along K in place, across threads at the end
            for kb in range(KB_SPLIT):
                if EVEN_K:
                    x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
                    w = tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)
                else:
                    k_ok = (rk + kb * BLOCK_K) < K
                    x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
                    w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
                acc_k += w.to(tl.float32) * x.to(tl.float32)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            acc = tl.sum(acc_k, axis=1)[None, :]  # (1, BLOCK_N)
        elif MODE == 1:  # the weight tile as the product's wide operand, the rows as its narrow one: y^T = W x^T
            x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]  # (BLOCK_K, BLOCK_M): x^T's tile
            w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]  # (BLOCK_N, BLOCK_K)
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for kb in range(KB_SPLIT):
                if EVEN_K:
                    x = tl.load(x_ptrs, mask=rm[None, :] < M, other=0.0)
                    w = tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)
                else:
                    k_ok = (rk + kb * BLOCK_K) < K
                    x = tl.load(x_ptrs, mask=(rm[None, :] < M) & k_ok[:, None], other=0.0)
                    w = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
                if UPCAST:
                    acc_t += tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
                else:
                    acc_t += tl.dot(w.to(x.dtype), x)
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            acc = tl.trans(acc_t)
        else:
            x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # (BLOCK_M, BLOCK_K)
            w_ptrs = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # (BLOCK_K, BLOCK_N): W^T's tile
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(KB_SPLIT):
                if EVEN_K:  # every slice whole: no mask along the contiguous axis, 16-byte loads
                    x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
                    w = tl.load(w_ptrs, mask=rn[None, :] < N, other=0.0)
                else:  # past K (a ragged last block) reads zeros
                    k_ok = (rk + kb * BLOCK_K) < K
                    x = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
                    w = tl.load(w_ptrs, mask=(rn[None, :] < N) & k_ok[:, None], other=0.0)
                if UPCAST:  # the interpreter's tl.dot multiplies bf16 inputs' raw bits (triton 3.6): fp32 there
                    acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(x, w.to(x.dtype))
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]  # per-channel scale: linear, so per slice
        if SPLIT_K == 1:
            last = pid_k == 0  # (always true) the one program of the tile stores it
        else:
            mp = grid_m * BLOCK_M  # the workspace (SPLIT_K, mp, np) fp32 is padded: no masks
            np_ = grid_n * BLOCK_N
            tl.store(ws_ptr + (pid_k * mp + rm[:, None]) * np_ + rn[None, :], acc)
            tl.debug_barrier()  # every thread's partial stored before the release below
            tile = cnt_ptr + pid_m * grid_n + pid_n
            last = tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1  # the tile's last slice to finish
            if last:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):  # slice order: the same sum whichever slice came last
                    acc += tl.load(ws_ptr + (s * mp + rm[:, None]) * np_ + rn[None, :], cache_modifier=".cg")
                tl.atomic_xchg(tile, 0)  # ready for the next call (a replayed graph too)
        if last:
            n_ok = rn < N
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


def block_m(m: int, mode: int = DOT) -> int:
    """Rows per program: tl.dot wants at least 16 and a decode batch rarely fills more than 64; a GEMV program
    takes one."""
    if mode == GEMV:
        return 1
    return 16 if m <= 16 else 32 if m <= 32 else 64


@functools.lru_cache(maxsize=8)
def multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device; 4 under the interpreter (so that the tests' small shapes split)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=4096)  # an eager decode step asks once a Linear: the divisor search is not repeated
def split_plan(m: int, n: int, k: int, block_n: int, block_k: int, per_sm: int, sms: int,
               mode: int = DOT) -> tuple[int, int]:
    """(slices of K, BLOCK_K blocks a slice) giving about per_sm programs per SM; (1, all) without a split. The
    slices are equal: the count is the divisor of K's blocks nearest the wanted one (the larger of two as near), since
    one slice reaching past K would make every load of the call a masked one (EVEN_K off: the 2026-12-04 H200
    timings' qkv 6144x4096, 32 blocks in 3 slices of 11, took 29.2 us at 64 rows swapped where o's 4096x4096 in 4
    slices of 8 took 15.6)."""
    kb = -(-k // block_k)
    tiles = -(-n // block_n) * -(-m // block_m(m, mode))
    if per_sm <= 0 or m > (GEMV_SPLIT_ROWS if mode == GEMV else SPLIT_MAX_ROWS):
        return 1, kb
    want = max(1, min(kb, round(per_sm * sms / tiles)))
    split = min((d for d in range(1, kb + 1) if kb % d == 0), key=lambda d: (abs(d - want), -d))
    return split, kb // split


def counter_slots(n: int, block_n: int, mode: int = DOT) -> int:
    """Tile counters a split kernel needs for the most rows it splits (SPLIT_MAX_ROWS, GEMV_SPLIT_ROWS)."""
    return -(-n // block_n) * (GEMV_SPLIT_ROWS if mode == GEMV else -(-SPLIT_MAX_ROWS // 16))


def wo_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  block_n: int, block_k: int, per_sm: int = 0, counters: torch.Tensor | None = None,
                  mode: int = DOT, stages: int = 4) -> torch.Tensor:
    """x (M, K) bf16/fp16 @ (weight (N, K) e4m3 * scale (N,) fp32)^T + bias -> (M, N) in x's dtype, the tile
    computed as `mode` says (DOT, SWAP, GEMV: see CONFIGS); per_sm > 0 splits K and needs `counters`: int32 zeros,
    counter_slots(N, block_n, mode) of them, which each call leaves at zero again; calls that share them must not
    run at the same time."""
    if mode not in (DOT, SWAP, GEMV):
        raise ValueError(f"wo_fp8_linear: mode {mode!r}; allowed: {DOT} (dot), {SWAP} (swapped), {GEMV} (gemv)")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"wo_fp8_linear: x must be bfloat16 or float16, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("wo_fp8_linear: weight (N, K) float8_e4m3fn and x (M, K), each row-contiguous")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm = block_m(m, mode)
    grid_n, grid_m = (n + block_n - 1) // block_n, (m + bm - 1) // bm
    split, per = split_plan(m, n, k, block_n, block_k, per_sm, multiprocessors(x.device), mode)
    ws = scale  # unused without a split
    if split > 1:
        if counters is None or counters.dtype != torch.int32 or counters.numel() < grid_n * grid_m:
            raise ValueError(f"wo_fp8_linear: a split-K call needs int32 counters, {grid_n * grid_m} at least")
        ws = torch.empty(split * grid_m * bm * grid_n * block_n, device=x.device, dtype=torch.float32)
    even = k % block_k == 0  # the slices are equal (split_plan): only a ragged last block of K needs masks
    _kernel()[(grid_m, grid_n, split) if mode == GEMV else (grid_n, grid_m, split)](
        x, weight, scale, bias if bias is not None else scale, y, ws, counters if split > 1 else scale, m, n,
        x.stride(0), weight.stride(0), y.stride(0), K=k, KB_SPLIT=per, SPLIT_K=split, EVEN_K=even,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, MODE=mode, UPCAST=_interpreting(),
        num_warps=4, num_stages=stages)
    return y


@torch.library.custom_op("shardserve::wo_fp8_linear", mutates_args=())
def wo_fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     block_n: int, block_k: int, per_sm: int, counters: torch.Tensor | None, mode: int,
                     stages: int) -> torch.Tensor:
    """wo_fp8_linear as one operator for a compiled decode step (fullgraph), which calls it as it is. The
    counters a split call uses are back at zero when it returns: no mutation is visible to the graph."""
    return wo_fp8_linear(x, weight, scale, bias, block_n, block_k, per_sm, counters, mode, stages)


@wo_fp8_linear_op.register_fake
def _(x, weight, scale, bias, block_n, block_k, per_sm, counters, mode, stages):
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
        self.block_n, self.block_k, self.per_sm, self.mode, self.stages = CONFIGS[config]
        self.weight = src.weight  # (N, K) e4m3, shared with the source: no copy
        self.register_buffer("scale", src.weight_scale.detach().float().reshape(-1).contiguous(), persistent=False)
        self.register_buffer("counters", torch.zeros(counter_slots(self.out_features, self.block_n, self.mode) if self.per_sm
                                                     else 1, dtype=torch.int32, device=src.weight.device),
                             persistent=False)
        self.bias, self.comm = src.bias, src.comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        fused_bias = self.bias if self.comm is None else None
        run = wo_fp8_linear_op if torch.compiler.is_compiling() else wo_fp8_linear  # eager skips the dispatch
        y = run(x2, self.weight, self.scale, fused_bias, self.block_n, self.block_k, self.per_sm, self.counters,
                self.mode, self.stages)
        if self.comm is not None:
            y = self.comm.all_reduce(y, "tp_layer")
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, e4m3 weight-only (Triton, {self.config})"
