"""FP8 (e4m3) weights on disk: the quantizer and the compressed-tensors checkpoint format.

The scheme is the one transformers (with the `compressed-tensors` package) and vLLM read as
"FP8 dynamic": every Linear of the blocks stores `<name>.weight` as F8_E4M3 (out, in) and
`<name>.weight_scale` as fp32 (out, 1), one scale per output channel, with
    weight ~= weight_fp8.float() * weight_scale,   weight_scale = absmax(row) / 448 (quantize_rows)
or, with `shardserve quantize --scales search`, the scale in absmax(row) / 448 x [1, 2) whose nearest codes
reconstruct the row best (engines/transforms/fp8_scales.py); readers take any positive fp32 scale.
Activations are quantized on the fly, one scale per token, by the engine that runs the file.
Embeddings, norms and the LM head stay in the source dtype (`ignore: ["lm_head"]`, plus any block
Linear a model keeps in float). `shardserve quantize --calibration TEXT` keeps these scales and this
layout and only chooses the e4m3 codes differently (GPTQ, engines/transforms/fp8_gptq.py).

This module holds what both sides of a checkpoint need: the quantizer, the config that is
written, and the parsing of a config that is read. The schemes we read are this one, per-tensor
weight scales (expanded to per-channel at load, which is exact), and weight-only files (no
input activations). Anything else is refused with an error naming the scheme.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn value; a weight at the row's absmax maps to exactly +-448."""
SCALE_EPS = torch.finfo(torch.float32).eps
"""Scale of an all-zero row (its weights quantize to 0): never 0, so nothing divides by zero."""
COMPRESSED_TENSORS_VERSION = "0.20.0"
"""The compressed-tensors release whose config layout we write and test against."""


class Fp8FormatError(ValueError):
    """A quantization config or tensor we cannot read; the message names the field or tensor."""


def quantize_rows(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) float -> (e4m3 weight (out, in), fp32 scale (out, 1)), one scale per row.

    The division is done in fp32 and clamped to [-448, 448] before the cast: e4m3fn has no
    infinity, and what an out-of-range cast gives is the kernel's choice (torch 2.13's CPU cast
    saturates; a non-saturating conversion gives NaN), so nothing out of range reaches it.
    """
    if w.dim() != 2:
        raise Fp8FormatError(f"{name}: only 2-D Linear weights are quantized, got shape {tuple(w.shape)}")
    w32 = w.detach().float()
    if not torch.isfinite(w32).all():
        raise Fp8FormatError(f"{name}: holds NaN or infinite values; refusing to quantize it")
    amax = w32.abs().amax(dim=1, keepdim=True)  # (out, 1)
    scale = (amax / FP8_MAX).clamp_min(SCALE_EPS)
    q = (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 (out, in) x fp32 (out, 1) -> (out, in) in `dtype` (the product is taken in fp32)."""
    return (q.float() * scale.float()).to(dtype)


@dataclass(frozen=True)
class Fp8Scheme:
    """What a checkpoint's quantization_config says about its FP8 Linear layers."""

    weight_strategy: Literal["channel", "tensor"]
    """channel: weight_scale (out, 1); tensor: one scale per tensor (read as per-channel)."""
    dynamic_activations: bool
    """True: input activations quantized per token at run time (W8A8 where the GPU can);
    False: the file is weight-only (W8A16), and the engine keeps activations in bf16."""
    ignore: tuple[str, ...] = ()


def quantization_config(ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """The config.json `quantization_config` we write (compressed-tensors FP8 dynamic layout)."""
    def args(strategy: str, dynamic: bool) -> dict[str, Any]:
        # the keys compressed-tensors 0.20 itself writes for this scheme (its unset fields are left out)
        return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                "strategy": strategy, "dynamic": dynamic}

    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "version": COMPRESSED_TENSORS_VERSION,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": args("channel", False),
            "input_activations": args("token", True),
            "output_activations": None,
            "format": "float-quantized",
        }},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "moe_sparsity_config": None,
    }


_READ_FORMATS = ("float-quantized", "naive-quantized")


def _check_args(where: str, a: Any, *, weights: bool) -> str:
    """Validate one QuantizationArgs dict; returns its strategy."""
    if not isinstance(a, dict):
        raise Fp8FormatError(f"quantization_config.{where}: expected an object, got {a!r}")
    kind, bits = a.get("type", "int"), a.get("num_bits")
    if kind != "float" or bits != 8:
        raise Fp8FormatError(f"quantization_config.{where}: scheme type={kind!r} num_bits={bits!r} is not "
                             "supported; supported: FP8 e4m3 (type 'float', num_bits 8)")
    if a.get("symmetric", True) is not True:
        raise Fp8FormatError(f"quantization_config.{where}: asymmetric FP8 (zero points) is not supported")
    strategy = a.get("strategy") or "tensor"
    if weights:
        if strategy not in ("channel", "tensor"):
            label = {"block": "block-wise", "group": "group-wise", "tensor_group": "tensor-group (NVFP4-style)"
                     }.get(strategy, strategy)
            raise Fp8FormatError(f"quantization_config.{where}.strategy: {strategy!r} ({label} scales) is not "
                                 "supported; supported: 'channel', 'tensor'")
        if a.get("dynamic") not in (False, None):
            raise Fp8FormatError(f"quantization_config.{where}.dynamic: dynamic weight scales are not supported")
        if a.get("actorder"):
            raise Fp8FormatError(f"quantization_config.{where}.actorder: {a['actorder']!r} is not supported")
    else:
        if a.get("dynamic") is not True:
            raise Fp8FormatError(f"quantization_config.{where}: static activation scales (dynamic=false, "
                                 "input_scale tensors) are not supported; supported: dynamic per-token")
        if strategy != "token":
            raise Fp8FormatError(f"quantization_config.{where}.strategy: dynamic {strategy!r} activation "
                                 "scales are not supported; supported: 'token'")
    return strategy


def scheme_from_hf(hf: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a transformers config.json dict; None when it is not quantized.

    Raises Fp8FormatError naming the field for any scheme we cannot run exactly.
    """
    qc = hf.get("quantization_config", hf.get("compression_config"))
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise Fp8FormatError(f"quantization_config: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        hint = " (block-wise weight_scale_inv)" if method == "fp8" else ""
        raise Fp8FormatError(f"quantization_config.quant_method: {method!r}{hint} is not supported; "
                             "supported: 'compressed-tensors' FP8 (format 'float-quantized')")
    fmt = qc.get("format")
    if fmt not in _READ_FORMATS:
        raise Fp8FormatError(f"quantization_config.format: {fmt!r} is not supported; supported: "
                             f"{', '.join(_READ_FORMATS)}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise Fp8FormatError(f"quantization_config.quantization_status: {status!r} is not supported; "
                             "supported: 'compressed' (weights stored as F8_E4M3)")
    for key, what in (("kv_cache_scheme", "an FP8 KV cache"), ("sparsity_config", "sparsity"),
                      ("transform_config", "weight transforms")):
        if qc.get(key) and (key != "sparsity_config" or qc[key].get("format", "dense") != "dense"):
            raise Fp8FormatError(f"quantization_config.{key}: {what} is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise Fp8FormatError("quantization_config.config_groups: missing or empty")
    found: set[tuple[str, bool]] = set()
    for gname, g in groups.items():
        if not isinstance(g, dict):
            raise Fp8FormatError(f"quantization_config.config_groups.{gname}: expected an object")
        if g.get("format") not in (None, *_READ_FORMATS):
            raise Fp8FormatError(f"quantization_config.config_groups.{gname}.format: {g['format']!r} is not "
                                 f"supported; supported: {', '.join(_READ_FORMATS)}")
        if g.get("weights") is None:
            raise Fp8FormatError(f"quantization_config.config_groups.{gname}.weights: activation-only "
                                 "quantization is not supported")
        strategy = _check_args(f"config_groups.{gname}.weights", g["weights"], weights=True)
        acts = g.get("input_activations")
        if acts is not None:
            _check_args(f"config_groups.{gname}.input_activations", acts, weights=False)
        if g.get("output_activations") is not None:
            raise Fp8FormatError(f"quantization_config.config_groups.{gname}.output_activations: "
                                 "output quantization is not supported")
        found.add((strategy, acts is not None))
    if len({dyn for _, dyn in found}) > 1:
        raise Fp8FormatError("quantization_config.config_groups: groups mix weight-only and W8A8 schemes; "
                             "one activation scheme per model is supported")
    strategies = {s for s, _ in found}
    ignore = qc.get("ignore") or []
    return Fp8Scheme(weight_strategy="tensor" if strategies == {"tensor"} else "channel",
                     dynamic_activations=next(iter(found))[1], ignore=tuple(str(i) for i in ignore))


def check_scale(name: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A weight_scale tensor read from a file, as fp32 (rows, 1) per-channel scales.

    Accepts (rows, 1), (rows,), and per-tensor (), (1,), (1, 1) (broadcast to every row: exact).
    Raises Fp8FormatError naming the tensor for a wrong shape or dtype, or a value that is not a
    finite positive number (a corrupt scale would silently scale a whole channel).
    """
    if not scale.dtype.is_floating_point or scale.dtype == FP8_DTYPE:
        raise Fp8FormatError(f"tensor {name!r}: scale dtype {scale.dtype} is not supported; expected "
                             "float32, bfloat16 or float16")
    shape = tuple(scale.shape)
    if shape in ((rows, 1), (rows,)):
        s = scale.reshape(rows, 1)
    elif scale.numel() == 1 and len(shape) <= 2:
        s = scale.reshape(1, 1).expand(rows, 1)
    else:
        raise Fp8FormatError(f"tensor {name!r}: shape {shape} does not match its weight's {rows} output "
                             f"channels; expected ({rows}, 1) per channel or (1,) per tensor")
    s = s.float()
    if not torch.isfinite(s).all() or not (s > 0).all():
        bad = int((~torch.isfinite(s) | (s <= 0)).sum())
        raise Fp8FormatError(f"tensor {name!r}: {bad} scale(s) are not finite positive numbers "
                             "(corrupt scale tensor)")
    return s.contiguous()


def check_weight(name: str, w: torch.Tensor, shape: tuple[int, int] | None = None) -> None:
    """An F8_E4M3 weight as read: the right dtype and (when known) shape, no NaN bit patterns."""
    if w.dtype != FP8_DTYPE:
        raise Fp8FormatError(f"tensor {name!r}: has a weight_scale but dtype {w.dtype}; expected F8_E4M3 "
                             "(float8_e4m3fn)")
    if shape is not None and tuple(w.shape) != tuple(shape):
        raise Fp8FormatError(f"tensor {name!r}: shape {tuple(w.shape)}, the config implies {tuple(shape)}")
    if torch.isnan(w.float()).any():
        raise Fp8FormatError(f"tensor {name!r}: holds NaN (e4m3 0x7f/0xff) values")


HEAD_FILE = "fp8_head/lm_head.safetensors"
"""Where `shardserve quantize --calibration` keeps GPTQ e4m3 codes of the LM head (per-row scales), relative to
the checkpoint directory: read only by EngineConfig.lm_head_dtype "fp8". A sub-folder, so that transformers and
vLLM, which read the directory's top-level *.safetensors (and whose configs keep `ignore: ["lm_head"]`), never
see it: the file stays an ordinary compressed-tensors checkpoint for them."""


def save_fp8_head(model_dir, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Write the head's e4m3 codes (V, C) and fp32 per-row scales (V, 1) to model_dir / HEAD_FILE."""
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(model_dir) / HEAD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"weight": q.contiguous(), "weight_scale": scale.float().reshape(-1, 1).contiguous()}, str(path),
              metadata={"format": "pt", "scheme": "e4m3 per row (absmax / 448), GPTQ codes"})


def read_fp8_head(model_dir, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 (V, C), fp32 (V, 1)) from model_dir / HEAD_FILE, None when the directory has none; a file whose
    tensors do not fit the head's `shape` raises Fp8FormatError naming it."""
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(model_dir) / HEAD_FILE
    if not path.is_file():
        return None
    t = load_file(str(path))
    if "weight" not in t or "weight_scale" not in t:
        raise Fp8FormatError(f"{path}: needs tensors 'weight' and 'weight_scale', has {sorted(t)}")
    check_weight(f"{HEAD_FILE}:weight", t["weight"], shape)
    return t["weight"], check_scale(f"{HEAD_FILE}:weight_scale", t["weight_scale"], shape[0])
