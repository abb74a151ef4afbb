"""FP8 weights at run time: a load-time transformation of the blocks' Linear layers.

A checkpoint in the compressed-tensors FP8 scheme (engines/transforms/fp8_format.py) loads into
`Fp8Linear` modules: e4m3 weight (out, in), fp32 weight_scale (out, 1), bias in the compute
dtype. `apply_fp8` then picks, once per model at load (never inside a captured or compiled
step), how each layer runs:

- "w8a8" (CUDA, compute capability >= 8.9, the file's scheme has dynamic activations):
  `ScaledMMLinear`, x quantized per token on the fly (absmax / 448 per row, fp32), then
  torch._scaled_mm(x_fp8 (M, K) row-major, W_fp8^T (K, N) column-major, scale_a (M, 1),
  scale_b (1, N)) with a bf16 result: half the weight bytes of bf16 and the FP8 tensor cores.
  Layers whose K or N is not a multiple of 16 (a _scaled_mm rule) run "dequant" instead.
  engines/transforms/fp8_choice.py times that, a tensor-wise variant, the weight-only Triton kernels
  (engines/transforms/fp8_triton.py) and plain bf16 for each layer shape, and keeps the fastest per decode
  row count.
- "dequant" (CPU, pre-8.9 GPUs, weight-only files): the weight is dequantized once to the compute
  dtype and the layer becomes a plain nn.Linear (or RowParallelLinear). CPUs have no FP8 matmul
  fast path, and on a GPU without FP8 tensor cores a per-step dequantize reads 1 byte and writes
  and re-reads 2 per weight, so it is always slower than reading the 2 bytes once.

`weight_dtype="fp8"` on a checkpoint that is not quantized quantizes the same layers at load
(per-channel absmax / 448, as `shardserve quantize` does by default), so a bf16 file can be served as
FP8.
Tensor parallel shards carry their slices: a column-parallel layer keeps the scales of its rows,
a row-parallel one keeps all its output channels' scales and all-reduces after the matmul.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.core.config import WEIGHT_DTYPES
from engines.parallel.comm import Comm
from engines.parallel.tp import RowParallelLinear, ShardSpec
from engines.transforms.fp8_choice import TIMING_ROWS, Fp8ByRows, TensorwiseScaledMMLinear, choose_kernels
from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, SCALE_EPS, dequantize, quantize_rows
from engines.transforms.fp8_triton import CONFIGS as WO_CONFIGS
from engines.transforms.fp8_triton import WeightOnlyFp8Linear, triton_available

log = logging.getLogger(__name__)

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
"""Our names of the Linear layers of a block: the ones FP8 quantizes."""


class Fp8Linear(nn.Module):
    """Storage form of an FP8 Linear; its forward dequantizes per call (correct on any device).

    comm set: a row-parallel shard (input features split), all-reduced before the bias is added.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, comm=None,
                 bias_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 dynamic_activations: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.comm = comm
        self.dynamic_activations = dynamic_activations

    @classmethod
    def quantize(cls, linear: nn.Module, comm=None, dynamic_activations: bool = True) -> Fp8Linear:
        """From a float nn.Linear / RowParallelLinear (online quantization at load)."""
        w = linear.weight.detach()
        out = cls(w.shape[1], w.shape[0], linear.bias is not None, comm,
                  linear.bias.dtype if linear.bias is not None else w.dtype, w.device, dynamic_activations)
        q, s = quantize_rows(w)
        out.weight.data, out.weight_scale.data = q, s
        if linear.bias is not None:
            out.bias.data = linear.bias.detach()
        return out

    def shard_columns(self, spec: ShardSpec) -> Fp8Linear:
        """Tensor parallel (engines.parallel.tp.ShardableLinear): the shard keeps the scales of its rows."""
        out = Fp8Linear(self.in_features, spec.size, self.bias is not None, device=self.weight.device,
                        dynamic_activations=self.dynamic_activations)
        out.weight.data, out.weight_scale.data = spec.take(self.weight.detach()), spec.take(self.weight_scale.detach())
        out.bias = nn.Parameter(spec.take(self.bias.detach()), requires_grad=False) if self.bias is not None else None
        return out

    def shard_rows(self, spec: ShardSpec, comm: Comm) -> Fp8Linear:
        """Tensor parallel, row-parallel: output channels stay whole, so do their scales."""
        bias = self.bias.detach() if self.bias is not None else None
        out = Fp8Linear(spec.size, self.out_features, bias is not None, comm, device=self.weight.device,
                        dynamic_activations=self.dynamic_activations)
        out.weight.data, out.weight_scale.data = spec.take(self.weight.detach()), self.weight_scale.detach()
        out.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        return out

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        if self.comm is not None:
            y = self.comm.all_reduce(y, "tp_layer")
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(F.linear(x, dequantize(self.weight, self.weight_scale, x.dtype)))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, row_parallel={self.comm is not None}")


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), fp32 scales (M, 1)): one dynamic scale per token (row).

    Six kernels (a CUDA decode step is launch-bound: this runs before every W8A8 Linear): the
    row max of |x| in fp32 in one reduction, the scale in place, and x / scale (fp32, as
    x.float() / scale) clamped in place and cast."""
    amax = torch.linalg.vector_norm(x.detach(), float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # (M, 1)
    scale = amax.div_(FP8_MAX).clamp_min_(SCALE_EPS)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_shape_ok(in_features: int, out_features: int) -> bool:
    """_scaled_mm needs K (in) and N (out) to be multiples of 16."""
    return in_features % 16 == 0 and out_features % 16 == 0


class ScaledMMLinear(nn.Module):
    """W8A8: y = (x_q W_q^T) * (s_x s_w^T), one torch._scaled_mm per call, bf16 out."""

    def __init__(self, src: Fp8Linear):
        super().__init__()
        self.in_features, self.out_features = src.in_features, src.out_features
        # (out, in) row-major transposed is (in, out) column-major: the layout _scaled_mm's
        # second operand must have, with no copy
        self.weight = src.weight
        self.weight_scale_row = nn.Parameter(src.weight_scale.detach().float().reshape(1, -1),
                                             requires_grad=False)  # (1, N) fp32
        self.bias, self.comm = src.bias, src.comm
        # a bf16 bias of a layer without a reduction after it is added in _scaled_mm's epilogue (one
        # kernel less a call) where this torch build supports it with row-wise scales (tried once)
        self.fuse_bias = self.bias is not None and self.comm is None and self.bias.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        xq, xs = quantize_tokens(x2)
        y = None
        if self.fuse_bias:
            try:
                y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale_row, bias=self.bias,
                                     out_dtype=torch.bfloat16)  # (M, N), bias added
            except RuntimeError as exc:  # a build without the fused bias: add it after, from now on
                log.info("W8A8 bias not fused into _scaled_mm (%s); added after the product", exc)
                self.fuse_bias = False
        if y is None:
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale_row,
                                 out_dtype=torch.bfloat16)  # (M, N)
            if self.comm is not None:
                y = self.comm.all_reduce(y, "tp_layer")
            y = y + self.bias if self.bias is not None else y
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def w8a8_supported(device: torch.device | str) -> bool:
    """FP8 tensor-core matmul: CUDA with compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class Fp8Report:
    """What apply_fp8 did: layers quantized at load, layers run by an FP8 kernel on the device (w8a8: _scaled_mm or
    the weight-only Triton kernel), layers dequantized or run by the CPU's e4m3 kernel, and the kernel rule."""

    quantized_at_load: int
    w8a8: int
    dequant: int
    backend: str

    @property
    def fp8(self) -> bool:
        return self.w8a8 + self.dequant > 0


def _block_linears(model: nn.Module):
    """(parent, attribute, module) of each Linear-like layer of the blocks."""
    blocks = model.blocks.values() if isinstance(model.blocks, nn.ModuleDict) else model.blocks
    for block in blocks:
        for path in BLOCK_LINEARS:
            owner_name, attr = path.split(".")
            parent = getattr(block, owner_name)
            yield parent, attr, getattr(parent, attr)


def convert_to_storage(model: nn.Module, quantized: set[str], dynamic_activations: bool = True) -> nn.Module:
    """Swap the block Linears named in `quantized` (e.g. "blocks.0.attn.qkv") for empty Fp8Linear
    modules of the same shape (and the same row-parallel comm), on the layer's device: a loader
    builds the model on the meta device, calls this, then assigns the tensors read from the file."""
    for name, module in list(model.named_modules()):
        if name not in quantized:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        w = module.weight
        fp8 = Fp8Linear(w.shape[1], w.shape[0], module.bias is not None, getattr(module, "comm", None),
                        module.bias.dtype if module.bias is not None else torch.float32, w.device,
                        dynamic_activations)
        setattr(parent, attr, fp8)
    return model


def apply_fp8(model: nn.Module, weight_dtype: str, device: torch.device | str, dtype: torch.dtype,
              force_w8a8: bool = False) -> Fp8Report:
    """Make the model's FP8 layers run on `device` in compute `dtype` (see the module docstring).

    weight_dtype "auto" runs what the checkpoint holds; "fp8" also quantizes float block Linears.
    force_w8a8 takes the W8A8 path where the hardware rule would not (torch 2.13 has a CPU
    _scaled_mm: slow, but it lets a CPU check the W8A8 numerics). Returns what was done; a model
    without FP8 layers and weight_dtype "auto" is left as it is.
    """
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype: must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    at_load = 0
    if weight_dtype == "fp8":
        for parent, attr, mod in _block_linears(model):
            if type(mod) in (nn.Linear, RowParallelLinear):
                setattr(parent, attr, Fp8Linear.quantize(mod, getattr(mod, "comm", None)))
                at_load += 1
    fast = force_w8a8 or w8a8_supported(device)
    panels = 0
    if torch.device(device).type == "cpu" and not force_w8a8:
        from engines.cpu.fp8_linear import Fp8PanelLinear
        from engines.cpu.panel_kernel import load_fp8

        if load_fp8()[0] is not None:  # one byte a weight, widened in the kernel's registers
            for parent, attr, mod in list(_block_linears(model)):
                if isinstance(mod, Fp8Linear) and mod.comm is None and mod.weight.device.type == "cpu":
                    setattr(parent, attr, Fp8PanelLinear.from_fp8(mod, dtype))
                    panels += 1
    fp8_layers = [mod for _, _, mod in _block_linears(model) if isinstance(mod, Fp8Linear)]
    make = kernel_builders(dtype, device, triton=fast and not force_w8a8)
    choice: dict = {}
    if fast and not force_w8a8 and fp8_layers:  # a real FP8 device: measure the kernels once here
        timed = [m for m in fp8_layers if m.dynamic_activations and scaled_mm_shape_ok(m.in_features, m.out_features)]
        choice = choose_kernels(timed, dtype, {("bf16" if k == "dequant" else k): v for k, v in make.items()})
    plans: Counter[tuple[str, ...]] = Counter()
    for parent, attr, mod in _block_linears(model):
        if not isinstance(mod, Fp8Linear):
            continue
        plan: tuple[str, ...] = ("dequant",)
        if fast and mod.dynamic_activations and scaled_mm_shape_ok(mod.in_features, mod.out_features):
            picked = choice.get((mod.in_features, mod.out_features, mod.comm is not None), ("rowwise",))
            plan = tuple("dequant" if k == "bf16" else k for k in picked)
        kinds = tuple(dict.fromkeys(plan))  # the plan's distinct kernels
        if len(kinds) == 1:
            setattr(parent, attr, make[kinds[0]](mod))
        else:  # a kernel per row count, all on the one e4m3 weight
            setattr(parent, attr, Fp8ByRows({k: make[k](mod) for k in kinds}, plan, TIMING_ROWS))
        plans[kinds if len(kinds) == 1 else plan] += 1
    dequant = plans[("dequant",)]
    if fast:
        names = {"rowwise": "_scaled_mm row-wise", "tensorwise": "_scaled_mm tensor-wise + per-channel epilogue",
                 "dequant": "bf16 where measured faster"}
        rows = "/".join(map(str, TIMING_ROWS))
        backend = "w8a8, Linears per kernel (Triton wo-*: weight-only, e4m3 widened in registers): " + "; ".join(
            f"{n} {names.get(p[0], p[0])}" if len(p) == 1 else f"{n} {' / '.join(p)} at {rows} rows"
            for p, n in plans.most_common())
    elif panels:
        backend = (f"weight-only: {panels} Linears e4m3 in memory, widened in the CPU kernel"
                   + (f"; {dequant} dequantized at load" if dequant else ""))
    else:
        backend = "weight-only (dequantized at load)"
    return Fp8Report(quantized_at_load=at_load, w8a8=sum(plans.values()) - dequant, dequant=dequant + panels,
                     backend=backend)


def kernel_builders(dtype: torch.dtype, device: torch.device | str, triton: bool = True) -> dict:
    """How each kind of layer is built from an Fp8Linear: kind -> builder (rowwise, tensorwise, dequant, and the
    weight-only Triton configs where `triton` is asked for and runs here for this dtype)."""
    make = {"rowwise": ScaledMMLinear, "tensorwise": TensorwiseScaledMMLinear,
            "dequant": lambda m: _dequantized(m, dtype)}
    if triton and dtype in (torch.bfloat16, torch.float16) and triton_available(device):
        make.update({name: functools.partial(WeightOnlyFp8Linear, config=name) for name in WO_CONFIGS})
    return make


def _dequantized(mod: Fp8Linear, dtype: torch.dtype) -> nn.Module:
    """The layer's weight dequantized once to `dtype`: a plain nn.Linear (or RowParallelLinear)."""
    w = dequantize(mod.weight, mod.weight_scale, dtype)  # (out, in)
    bias = mod.bias.detach().to(dtype) if mod.bias is not None else None
    if mod.comm is not None:
        return RowParallelLinear(w, bias, mod.comm)
    new = nn.Linear(mod.in_features, mod.out_features, bias=bias is not None, device=w.device, dtype=dtype)
    new.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        new.bias = nn.Parameter(bias, requires_grad=False)
    return new


def apply_fp8_head(model: nn.Module, dtype: torch.dtype, model_dir=None) -> str:
    """EngineConfig.lm_head_dtype "fp8": the logits through a per-row-scaled e4m3 copy of the LM head.

    Each vocabulary row has its own scale (absmax / 448, as quantize_rows gives the block Linears' output
    channels); the codes are the GPTQ ones `shardserve quantize --calibration` wrote in model_dir's
    fp8_head/ folder (fp8_format.HEAD_FILE) where there is one, else rounded to nearest here (which costs
    more perplexity: BENCHMARKS.md). The head is kept one byte a weight in an engines.cpu.fp8_linear.Fp8PanelLinear,
    whose CPU kernel widens it in registers: a batch-1 decode token reads the head's 1 byte a weight
    instead of 2 (bf16) or 4. A tied head is untied first: the embedding keeps its `dtype` weight for the
    lookups (one row a token), only the logits read the e4m3 copy. Returns what it did, for the log;
    a head that is already FP8, absent (an earlier pipeline stage) or a tensor-parallel vocabulary shard
    is left as it is (said in the return)."""
    from engines.cpu.fp8_linear import Fp8PanelLinear
    from engines.cpu.panel_kernel import load_fp8

    head = getattr(model, "lm_head", None)
    if head is None:
        return "no LM head on this stage"
    if isinstance(head, Fp8PanelLinear):
        return "the LM head is already FP8"
    if type(head) is not nn.Linear:
        return f"the LM head is a {type(head).__name__} (a tensor-parallel shard?): kept in {dtype}"
    if head.weight.device.type != "cpu":
        raise ValueError(f"lm_head_dtype: fp8 is a CPU kernel, the head is on {head.weight.device}")
    mod, why = load_fp8()
    if mod is None:
        raise RuntimeError(f"lm_head_dtype: fp8 needs the CPU FP8 kernel: {why}")
    from engines.transforms.fp8_format import read_fp8_head

    shape = tuple(head.weight.shape)  # (V, C)
    stored = read_fp8_head(model_dir, shape) if model_dir is not None else None
    q, s = stored if stored is not None else quantize_rows(head.weight.detach(), "lm_head.weight")
    bias = head.bias.detach().to(dtype) if head.bias is not None else None
    model.lm_head = Fp8PanelLinear(q, s, bias)
    how = "GPTQ codes from the checkpoint's fp8_head/" if stored is not None else "rounded to nearest at load"
    return f"LM head {shape} e4m3 per row for the logits, {how} ({q.numel() / 1e6:.1f} MB a token)"
