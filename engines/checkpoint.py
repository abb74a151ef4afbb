"""Read and write HF-compatible checkpoint directories.

    model_dir/config.json                  transformers config (model_type gpt2 | llama)
    model_dir/model.safetensors            or model-0000i-of-0000n.safetensors + index json
    model_dir/tokenizer.json               optional; tokenizer_config.json with a chat template

Our parameter names differ from transformers' (fused qkv, fused gate/up); the mapping is a
plan of `Source`s per parameter, so a sharded loader can read only its slice of each source.
Nothing is ever unpickled: legacy `.bin` files go through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.config import ConfigError, ModelConfig
from engines.hf_config import model_config_to_hf


class CheckpointError(ValueError):
    """The checkpoint directory is missing, malformed or does not match its config."""


@dataclass(frozen=True)
class Source:
    """One tensor in the HF checkpoint; `transpose` for GPT-2's Conv1D (in, out) layout."""

    name: str
    transpose: bool = False


def weight_plan(cfg: ModelConfig) -> dict[str, tuple[Source, ...]]:
    """Our parameter name -> the HF tensors concatenated (along dim 0) to build it."""
    plan: dict[str, tuple[Source, ...]] = {}
    if cfg.model_type == "gpt2":
        plan["wte.weight"] = (Source("transformer.wte.weight"),)
        plan["wpe.weight"] = (Source("transformer.wpe.weight"),)
        for i in range(cfg.n_layer):
            h, b = f"transformer.h.{i}", f"blocks.{i}"
            for ours, theirs, conv in (("norm1", "ln_1", False), ("norm2", "ln_2", False),
                                       ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
                                       ("mlp.up", "mlp.c_fc", True), ("mlp.down", "mlp.c_proj", True)):
                plan[f"{b}.{ours}.weight"] = (Source(f"{h}.{theirs}.weight", transpose=conv),)
                plan[f"{b}.{ours}.bias"] = (Source(f"{h}.{theirs}.bias"),)
        plan["norm_f.weight"] = (Source("transformer.ln_f.weight"),)
        plan["norm_f.bias"] = (Source("transformer.ln_f.bias"),)
    else:
        plan["wte.weight"] = (Source("model.embed_tokens.weight"),)
        for i in range(cfg.n_layer):
            h, b = f"model.layers.{i}", f"blocks.{i}"
            plan[f"{b}.norm1.weight"] = (Source(f"{h}.input_layernorm.weight"),)
            plan[f"{b}.norm2.weight"] = (Source(f"{h}.post_attention_layernorm.weight"),)
            plan[f"{b}.attn.qkv.weight"] = tuple(Source(f"{h}.self_attn.{p}_proj.weight") for p in "qkv")
            plan[f"{b}.attn.proj.weight"] = (Source(f"{h}.self_attn.o_proj.weight"),)
            if cfg.bias:
                plan[f"{b}.attn.qkv.bias"] = tuple(Source(f"{h}.self_attn.{p}_proj.bias") for p in "qkv")
                plan[f"{b}.attn.proj.bias"] = (Source(f"{h}.self_attn.o_proj.bias"),)
            plan[f"{b}.mlp.up.weight"] = (Source(f"{h}.mlp.gate_proj.weight"), Source(f"{h}.mlp.up_proj.weight"))
            plan[f"{b}.mlp.down.weight"] = (Source(f"{h}.mlp.down_proj.weight"),)
        plan["norm_f.weight"] = (Source("model.norm.weight"),)
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (Source("lm_head.weight"),)
    return plan


class TensorReader:
    """Lazy access by name to the tensors of a checkpoint directory (safetensors or legacy .bin)."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        self._where: dict[str, Path] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        self._handles: dict[Path, object] = {}
        files = self._weight_files()
        for f in files:
            if f.suffix == ".safetensors":
                try:
                    with safe_open(f, framework="pt") as h:
                        for k in h.keys():
                            self._where[k] = f
                except Exception as exc:  # safetensors raises its own error types
                    raise CheckpointError(f"{f.name}: not a readable safetensors file ({exc})") from exc
            else:
                if self._bin is None:
                    self._bin = {}
                try:
                    state = torch.load(f, map_location="cpu", weights_only=True)
                except Exception as exc:
                    raise CheckpointError(f"{f.name}: not a loadable weights-only torch file ({exc})") from exc
                self._bin.update(state)
                for k in state:
                    self._where[k] = f

    def _weight_files(self) -> list[Path]:
        d = self.dir
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = d / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise CheckpointError(f"{index_name}: malformed index ({exc})") from exc
                files = sorted({d / name for name in weight_map.values()})
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise CheckpointError(f"{index_name} names missing files: {', '.join(missing)}")
                return files
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (d / single).is_file():
                return [d / single]
        raise CheckpointError(f"{str(d)!r} has no weights: expected model.safetensors, sharded "
                              "model-*.safetensors with model.safetensors.index.json, or pytorch_model.bin")

    def keys(self) -> set[str]:
        return set(self._where)

    def _normalise(self, name: str) -> str:
        if name in self._where:
            return name
        # original GPT-2 checkpoints drop the "transformer." prefix
        short = name.removeprefix("transformer.")
        if short in self._where:
            return short
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")

    def get(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """The tensor `name`, or only `rows` of its first dimension and/or `cols` of its second
        (read from disk as a slice: a sharded loader reads only its part)."""
        key = self._normalise(name)
        if self._bin is not None and key in self._bin:
            t = self._bin[key]
        else:
            path = self._where[key]
            handle = self._handles.get(path)
            if handle is None:
                handle = self._handles[path] = safe_open(path, framework="pt")
            if rows is None and cols is None:
                return handle.get_tensor(key)
            t = handle.get_slice(key)
            if cols is None:
                return t[rows]
        if rows is None and cols is None:
            return t
        return t[rows if rows is not None else slice(None), cols if cols is not None else slice(None)]

    def has(self, name: str) -> bool:
        try:
            self._normalise(name)
            return True
        except CheckpointError:
            return False


def load_state_dict(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                    select: Callable[[str, Source, TensorReader], torch.Tensor] | None = None,
                    ) -> dict[str, torch.Tensor]:
    """Our state dict from an HF directory. `select` lets a sharded loader read a slice of a source."""
    reader = TensorReader(model_dir)
    out: dict[str, torch.Tensor] = {}
    for ours, sources in weight_plan(cfg).items():
        if ours == "lm_head.weight" and not reader.has(sources[0].name):
            raise CheckpointError("checkpoint has tie_word_embeddings=false but no lm_head.weight")
        parts = []
        for src in sources:
            t = select(ours, src, reader) if select is not None else reader.get(src.name)
            parts.append(t.t() if src.transpose else t)
        out[ours] = (torch.cat(parts, 0) if len(parts) > 1 else parts[0]).to(dtype).contiguous()
    return out


def check_shapes(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = dict(model.state_dict())
    for name, t in state.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                  f"{tuple(expected[name].shape)}")


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelConfig]:
    """Build engines.model.GPT from an HF directory; returns (model in eval mode, config)."""
    from engines.model import GPT

    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"model directory {str(d)!r} does not exist or is not a directory")
    try:
        cfg = ModelConfig.from_dir(d)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    state = load_state_dict(d, cfg, dtype)
    with torch.device("meta"):
        model = GPT(cfg)
    check_shapes(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.wte.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"checkpoint lacks parameters: {', '.join(missing[:5])}")
    return model.to(device).eval(), cfg


def _hf_state(model: torch.nn.Module, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    ours = dict(model.state_dict())
    for name, sources in weight_plan(cfg).items():
        t = ours[name].detach().cpu()
        if len(sources) == 1:
            parts = [t]
        else:  # split along dim 0 by the sizes the config implies
            if name.endswith(("qkv.weight", "qkv.bias")):
                sizes = [cfg.n_head * cfg.hd, cfg.kv_heads * cfg.hd, cfg.kv_heads * cfg.hd]
            else:
                sizes = [cfg.ffn_dim, cfg.ffn_dim]
            parts = list(t.split(sizes, 0))
        for src, part in zip(sources, parts):
            yield src.name, (part.t() if src.transpose else part).contiguous().clone()


def save_checkpoint(model: torch.nn.Module, cfg: ModelConfig, out_dir: str | Path,
                    dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 2**30,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write an HF-compatible directory that transformers' AutoModelForCausalLM can load.

    Files are written to a temporary directory beside `out_dir` and renamed into place, so a
    crash never leaves a half-written checkpoint.
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tensors = {k: (v.to(dtype) if dtype is not None else v) for k, v in _hf_state(model, cfg)}
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], tmp / "model.safetensors", metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, tmp / fname, metadata=meta)
            weight_map.update({k: fname for k in shard})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf = model_config_to_hf(cfg)
    hf.pop("torch_dtype", None)
    hf["dtype"] = dtype_name
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    gen = {k: v for k, v in (("bos_token_id", hf["bos_token_id"]), ("eos_token_id", hf["eos_token_id"]))
           if v is not None}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_dir) / name
            if src.is_file():
                (tmp / name).write_bytes(src.read_bytes())
    old = out.with_name(f".{out.name}.old")
    _rmtree(old)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    _rmtree(old)
    return out


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
