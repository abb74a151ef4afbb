"""Build one shard of a model, reading only its slices from the checkpoint.

The model is built on the meta device, cut to the stage's layers (pp.py) and sharded (tp.py), so
no full-size tensor is ever allocated; then every parameter of the shard is read from the
safetensors files as exactly the slice `tp.shard_spec` names: rows of an HF tensor, or columns
of GPT-2's transposed Conv1D weights (a column of ours is a row of theirs and vice versa).

FP8 block Linears (engines/transforms/fp8.py) load as e4m3 slices with their per-channel scales: a
column-parallel shard keeps the scales of its rows, a row-parallel shard all of them (its output
channels are whole). With weight_dtype "fp8" on a float checkpoint the shard quantizes as it
loads, a row-parallel layer with the absmax of its full rows, so every layout holds the same
FP8 values as TP=1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engines.core.config import ConfigError, ModelConfig
from engines.loading.checkpoint import (
    QUANTIZABLE,
    CheckpointError,
    Source,
    TensorReader,
    fp8_scheme,
    meta_device,
    quantized_params,
    read_float,
    scale_name,
    weight_plan,
)
from engines.parallel.comm import Comm
from engines.parallel.pp import StageModel, split_stage
from engines.parallel.tp import ShardSpec, apply_tp, shard_spec
from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, Fp8FormatError, check_scale, quantize_rows


def _source_rows(name: str, cfg: ModelConfig, n_sources: int, full_rows: int) -> list[int]:
    """Rows (in our orientation) contributed by each source of a parameter concatenated on dim 0."""
    if n_sources == 1:
        return [full_rows]
    if ".attn.qkv." in name:
        return [cfg.n_head * cfg.hd, cfg.kv_heads * cfg.hd, cfg.kv_heads * cfg.hd]
    return [cfg.ffn_dim, cfg.ffn_dim]  # llama's fused [gate; up]


def _read(reader: TensorReader, src: Source, dim: int, a: int, b: int) -> torch.Tensor:
    """Our-orientation slice [a, b) along `dim` of one source tensor."""
    theirs_dim = (1 - dim) if src.transpose else dim
    sl = slice(a, b)
    t = reader.get(src.name, rows=sl) if theirs_dim == 0 else reader.get(src.name, cols=sl)
    return t.t() if src.transpose else t


def read_sharded(reader: TensorReader, name: str, sources: tuple[Source, ...], cfg: ModelConfig,
                 spec: ShardSpec | None, full_shape: tuple[int, ...]) -> torch.Tensor:
    if spec is None:
        parts = [(reader.get(s.name).t() if s.transpose else reader.get(s.name)) for s in sources]
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]
    pieces = []
    if spec.dim == 0:
        offsets, off = [], 0
        for n in _source_rows(name, cfg, len(sources), full_shape[0]):
            offsets.append((off, off + n))
            off += n
        for a, b in spec.ranges:
            for src, (lo, hi) in zip(sources, offsets):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    pieces.append(_read(reader, src, 0, s - lo, e - lo))
    else:
        if len(sources) != 1:
            raise CheckpointError(f"{name}: a column-sharded parameter must come from one tensor")
        for a, b in spec.ranges:
            pieces.append(_read(reader, sources[0], 1, a, b))
    out = torch.cat(pieces, spec.dim) if len(pieces) > 1 else pieces[0]
    if spec.pad_to and out.shape[0] < spec.pad_to:
        out = torch.cat([out, out.new_zeros((spec.pad_to - out.shape[0], *out.shape[1:]))], 0)
    return out


def _read_scales(reader: TensorReader, name: str, sources: tuple[Source, ...], cfg: ModelConfig,
                 spec: ShardSpec | None, full_rows: int) -> torch.Tensor:
    """fp32 (rows, 1) scales of FP8 weight `name` for this shard: the rows of a column-parallel
    slice, all of them otherwise (scales are tiny: each source's is read whole and checked)."""
    parts = []
    for src, rows in zip(sources, _source_rows(name, cfg, len(sources), full_rows)):
        try:
            parts.append(check_scale(scale_name(src.name), reader.get(scale_name(src.name)), rows))
        except Fp8FormatError as exc:
            raise CheckpointError(str(exc)) from exc
    full = torch.cat(parts, 0) if len(parts) > 1 else parts[0]  # (out, 1)
    return spec.take(full) if spec is not None and spec.dim == 0 else full


def _quantize_slice(reader: TensorReader, name: str, sources: tuple[Source, ...], cfg: ModelConfig,
                    spec: ShardSpec | None, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online FP8 of a float slice: per-row scales of the full rows. A column-parallel slice has
    full rows already; a row-parallel one takes each row's absmax from the whole tensor."""
    if spec is None or spec.dim == 0:
        return quantize_rows(t, name)
    full = read_sharded(reader, name, sources, cfg, None, _full_shape(name, cfg)).float()  # (out, in)
    scale = (full.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).eps)
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def load_shard(model_dir: str | Path, cfg: ModelConfig, start: int, end: int, comm: Comm,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               weight_dtype: str = "auto") -> StageModel:
    """The shard of layers [start, end) for TP rank comm.tp_rank, its weights read as slices.

    FP8 block Linears load as engines.transforms.fp8.Fp8Linear (weight_dtype "fp8" quantizes a float
    checkpoint's as they load); engines.transforms.fp8.apply_fp8 then picks their kernel.
    """
    from engines.model.transformer import GPT
    from engines.transforms.fp8 import convert_to_storage

    with meta_device():
        stage = apply_tp(split_stage(GPT(cfg), start, end), cfg, comm)
    plan = weight_plan(cfg)
    if cfg.tie_word_embeddings and stage.lm_head is not None:
        plan["lm_head.weight"] = plan["wte.weight"]  # a last stage without the embedding reads it too
    reader = TensorReader(model_dir)
    if "lm_head.weight" in plan and not reader.has(plan["lm_head.weight"][0].name):
        raise CheckpointError("checkpoint has tie_word_embeddings=false but no lm_head.weight")
    scheme = fp8_scheme(model_dir)
    quantized = quantized_params(cfg, reader, scheme)
    online = weight_dtype == "fp8" and not quantized
    modules = dict(stage.named_modules())
    fp8_layers = {n.removesuffix(".weight") for n in plan if n.endswith(QUANTIZABLE)
                  and (n in quantized or online)} & set(modules)
    convert_to_storage(stage, fp8_layers, scheme.dynamic_activations if scheme else True)
    state: dict[str, torch.Tensor] = {}
    for name, param in stage.named_parameters():  # a tied head is listed once, as wte.weight
        if name.endswith(".weight_scale"):
            continue  # read with its weight
        sources = plan.get(name)
        if sources is None:
            raise CheckpointError(f"no checkpoint source for parameter {name!r}")
        full_shape = _full_shape(name, cfg)
        spec = shard_spec(name, cfg, comm.tp_size, comm.tp_rank)
        t = read_sharded(reader, name, sources, cfg, spec, full_shape)
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name!r}: read shape {tuple(t.shape)}, the shard expects "
                                  f"{tuple(param.shape)}")
        target = dtype
        if name.removesuffix(".weight") in fp8_layers:
            if online:
                t, state[scale_name(name)] = _quantize_slice(reader, name, sources, cfg, spec, t)
            else:
                if t.dtype != FP8_DTYPE:
                    raise CheckpointError(f"tensor {sources[0].name!r}: has a weight_scale but dtype {t.dtype}; "
                                          "expected F8_E4M3 (float8_e4m3fn)")
                state[scale_name(name)] = _read_scales(reader, name, sources, cfg, spec, full_shape[0])
            target = FP8_DTYPE
        elif t.dtype == FP8_DTYPE:  # an FP8 tensor kept in float (say a quantized LM head): dequantized
            parts = [read_float(reader, s, dtype) for s in sources]
            parts = [p.t() if s.transpose else p for s, p in zip(sources, parts)]
            full = torch.cat(parts, 0)
            t = spec.take(full) if spec is not None else full
        # an owned copy: a tensor read whole may share the file's mmap, which would keep every page
        # of the checkpoint this rank touched mapped (and counted) for the life of the shard
        state[name] = torch.empty(t.shape, dtype=target).copy_(t)
    del reader
    stage.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings and stage.wte is not None and stage.lm_head is not None:
        stage.lm_head.weight = stage.wte.weight
    missing = [n for n, p in stage.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"shard lacks parameters: {', '.join(missing[:5])}")
    return stage.to(device).eval()


def _full_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Unsharded shape of a parameter, from the config (dim 0 is all the loader needs)."""
    c = cfg.n_embd
    if name in ("wte.weight", "lm_head.weight"):
        return (cfg.vocab_size, c)
    if ".attn.qkv." in name:
        return ((cfg.n_head + 2 * cfg.kv_heads) * cfg.hd, c)
    if ".mlp.up." in name:
        return (cfg.ffn_dim * (2 if cfg.activation == "silu" else 1), c)
    if ".attn.proj.weight" in name or ".mlp.down.weight" in name:
        return (c, 0)
    return (0,)


def shard_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights a shard holds (shared tensors counted once): its parameters, and the (out, in) weight of
    a CPU FastLinear that kept only its panel copy (engines/cpu/fast_linear.py, dense=False, chosen by kernel timings,
    so per host and per run: counted as its Parameter was, else the count would depend on the timings)."""
    seen, total = set(), 0
    for p in module.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    for m in module.modules():
        panels = getattr(m, "panels", None)
        if getattr(m, "weight", 0) is None and panels is not None:
            total += m.out_features * m.in_features * panels.element_size()
    return total


def expected_shard_bytes(cfg: ModelConfig, tp: int, start: int, end: int, itemsize: int = 4) -> int:
    """What a shard should hold: its layers' 1/tp share of the big matrices plus the replicated
    parts (norms, row-parallel biases, positions), and its vocabulary slice of the embedding/head."""
    from engines.model.transformer import GPT
    from engines.parallel.comm import LocalComm

    fake = LocalComm()  # only shapes are built: the collectives are never called
    fake.tp_size, fake.tp_rank = tp, 0
    with meta_device():
        stage = apply_tp(split_stage(GPT(cfg), start, end), cfg, fake)
    seen, total = set(), 0
    for p in stage.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel() * itemsize
    return total


__all__ = ["ConfigError", "expected_shard_bytes", "load_shard", "read_sharded", "shard_bytes"]
