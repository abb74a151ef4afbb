"""Read and write HF-compatible checkpoint directories.

    model_dir/config.json                  transformers config (model_type gpt2 | llama | qwen2 | qwen3 | mistral)
    model_dir/model.safetensors            or model-0000i-of-0000n.safetensors + index json
    model_dir/tokenizer.json               optional; tokenizer_config.json with a chat template

Our parameter names differ from transformers' (fused qkv, fused gate/up); the mapping is a
plan of `Source`s per parameter, so a sharded loader can read only its slice of each source.
Nothing is ever unpickled: legacy `.bin` files go through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.core.config import ConfigError, ModelConfig
from engines.loading.output_dir import check_output_dir
from engines.model.model_config import model_config_to_hf
from engines.transforms.fp8_format import (
    FP8_DTYPE,
    Fp8FormatError,
    Fp8Scheme,
    check_scale,
    check_weight,
    dequantize,
    quantization_config,
    quantize_rows,
    scheme_from_hf,
)


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
            if cfg.bias or cfg.qkv_bias:
                plan[f"{b}.attn.qkv.bias"] = tuple(Source(f"{h}.self_attn.{p}_proj.bias") for p in "qkv")
            if cfg.bias:
                plan[f"{b}.attn.proj.bias"] = (Source(f"{h}.self_attn.o_proj.bias"),)
            if cfg.qk_norm:
                plan[f"{b}.attn.q_norm.weight"] = (Source(f"{h}.self_attn.q_norm.weight"),)
                plan[f"{b}.attn.k_norm.weight"] = (Source(f"{h}.self_attn.k_norm.weight"),)
            plan[f"{b}.mlp.up.weight"] = (Source(f"{h}.mlp.gate_proj.weight"), Source(f"{h}.mlp.up_proj.weight"))
            plan[f"{b}.mlp.down.weight"] = (Source(f"{h}.mlp.down_proj.weight"),)
        plan["norm_f.weight"] = (Source("model.norm.weight"),)
    if not cfg.tie_word_embeddings:
        plan["lm_head.weight"] = (Source("lm_head.weight"),)
    return plan


QUANTIZABLE = (".attn.qkv.weight", ".attn.proj.weight", ".mlp.up.weight", ".mlp.down.weight")
"""Our block Linear weights: the ones an FP8 checkpoint stores as F8_E4M3 + weight_scale."""


def scale_name(weight_name: str) -> str:
    """HF name of a weight's per-channel scale: "<...>.weight" -> "<...>.weight_scale"."""
    return weight_name + "_scale"


def fp8_scheme(model_dir: str | Path) -> Fp8Scheme | None:
    """The FP8 scheme of a checkpoint's config.json (None: not quantized); CheckpointError if unsupported."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
        return scheme_from_hf(data) if isinstance(data, dict) else None
    except (OSError, json.JSONDecodeError):
        return None  # ModelConfig.from_dir reports a missing or malformed config.json
    except Fp8FormatError as exc:
        raise CheckpointError(f"{path.name}: {exc}") from exc


def served_weight_dtype(model_dir, weight_dtype: str, dtype: str) -> str:
    """The weight storage a model is served with, for metadata: "fp8" when weight_dtype is fp8 or the
    checkpoint is an FP8 one, else the compute dtype `dtype` (a resolved EngineConfig.dtype)."""
    if weight_dtype == "fp8":
        return "fp8"
    return "fp8" if fp8_scheme(model_dir) is not None else dtype


def quantized_params(cfg: ModelConfig, reader: TensorReader, scheme: Fp8Scheme | None) -> set[str]:
    """Our block Linear weights stored as FP8 (their sources have weight_scale companions).

    Every source of a fused parameter must agree; an F8 tensor without a scale, or a scale
    without a quantization_config, is an error naming the tensor.
    """
    out: set[str] = set()
    for ours, sources in weight_plan(cfg).items():
        has = [reader.has(scale_name(s.name)) for s in sources]
        if any(has) and scheme is None:
            raise CheckpointError(f"tensor {scale_name(sources[0].name)!r} is present but config.json has no "
                                  "quantization_config")
        if any(has) and not all(has):
            missing = [scale_name(s.name) for s, h in zip(sources, has) if not h]
            raise CheckpointError(f"{ours}: fused from {', '.join(s.name for s in sources)}, but "
                                  f"{', '.join(missing)} is missing (all parts must be FP8 or none)")
        if all(has) and ours.endswith(QUANTIZABLE):
            out.add(ours)
    return out


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


def read_float(reader: TensorReader, src: Source, dtype: torch.dtype, rows: slice | None = None,
               cols: slice | None = None) -> torch.Tensor:
    """A source tensor (or its slice) as `dtype`; an F8 one with a weight_scale (say a quantized
    tensor we keep in float, such as an FP8 LM head) is dequantized, one without is an error."""
    t = reader.get(src.name, rows=rows, cols=cols)
    if t.dtype != FP8_DTYPE:
        return t.to(dtype)
    if not reader.has(scale_name(src.name)):
        raise CheckpointError(f"tensor {src.name!r} is F8_E4M3 but the checkpoint has no "
                              f"{scale_name(src.name)!r} to dequantize it with")
    full = reader.get(src.name)
    out_dim = 1 if src.transpose else 0
    try:
        scale = check_scale(scale_name(src.name), reader.get(scale_name(src.name)), full.shape[out_dim])
    except Fp8FormatError as exc:
        raise CheckpointError(str(exc)) from exc
    w = dequantize(full.t() if src.transpose else full, scale, dtype)
    w = w.t() if src.transpose else w
    r = rows if rows is not None else slice(None)
    return w[r, cols] if cols is not None else w[r]


def read_fp8(reader: TensorReader, src: Source, rows: slice | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 source in our orientation: (e4m3 weight (out, in), fp32 scale (out, 1)), optionally
    only output channels `rows` (a column-parallel shard's part)."""
    full = reader.get(src.name)
    try:
        check_weight(src.name, full)
        w = full.t() if src.transpose else full  # GPT-2's Conv1D stores (in, out)
        scale = check_scale(scale_name(src.name), reader.get(scale_name(src.name)), w.shape[0])
    except Fp8FormatError as exc:
        raise CheckpointError(str(exc)) from exc
    if rows is not None:
        w, scale = w[rows], scale[rows]
    return w.contiguous(), scale


def load_state_dict(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                    quantized: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Our state dict from an HF directory, in `dtype`. Parameters in `quantized` (FP8 block
    weights, see quantized_params) stay e4m3 and bring "<name>_scale" (out, 1) fp32 entries,
    the scales of a fused parameter concatenated like its rows."""
    reader = TensorReader(model_dir)
    out: dict[str, torch.Tensor] = {}
    for ours, sources in weight_plan(cfg).items():
        if ours == "lm_head.weight" and not reader.has(sources[0].name):
            raise CheckpointError("checkpoint has tie_word_embeddings=false but no lm_head.weight")
        if quantized and ours in quantized:
            pairs = [read_fp8(reader, src) for src in sources]
            out[ours] = torch.cat([w for w, _ in pairs], 0) if len(pairs) > 1 else pairs[0][0]
            out[scale_name(ours)] = torch.cat([s for _, s in pairs], 0)
            continue
        parts = []
        for src in sources:
            t = reader.get(src.name)  # a view of the file's pages (safetensors maps it): nothing read yet
            if t.dtype == FP8_DTYPE:  # a quantized tensor kept in float: dequantized (its scale checked)
                t = read_float(reader, src, dtype)
            parts.append(t.t() if src.transpose else t)
        out[ours] = assemble(parts, dtype)
    return out


def assemble(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """`parts` stacked along dim 0 as one contiguous `dtype` tensor, converted and copied in one pass:
    a fused qkv or gate-up weight of an fp32 file served in bf16 is read once and written once (not
    converted, then concatenated). One part already in `dtype` and contiguous is returned as it is."""
    if len(parts) == 1:
        p = parts[0]
        return p if p.dtype == dtype and p.is_contiguous() else torch.empty(p.shape, dtype=dtype).copy_(p)
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype)
    return torch.cat(parts, 0, out=out)


def check_shapes(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    expected = dict(model.state_dict())
    for name, t in state.items():
        if name not in expected:
            raise CheckpointError(f"unexpected tensor {name!r}")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, the config implies "
                                  f"{tuple(expected[name].shape)}")


@contextmanager
def meta_device():
    """Build modules on the meta device, skipping nn.Embedding's normal_ init there: on meta it has
    no values to fill, yet torch computes it through a Python decomposition whose first call imports
    torch._dynamo (~3.5 s of a 2-core host's engine start, in every process that loads a model; nothing
    else the engine runs needs it). Tensors off the meta device are initialised as before, so the
    replaced function is harmless to any other thread that builds a module meanwhile."""
    orig = torch.nn.init.normal_

    def normal_(t, *args, **kwargs):
        return t if t.is_meta else orig(t, *args, **kwargs)

    torch.nn.init.normal_ = normal_
    try:
        with torch.device("meta"):
            yield
    finally:
        torch.nn.init.normal_ = orig


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelConfig]:
    """Build engines.model.transformer.GPT from an HF directory; returns (model in eval mode, config)."""
    from engines.model.transformer import GPT

    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"model directory {str(d)!r} does not exist or is not a directory")
    try:
        cfg = ModelConfig.from_dir(d)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    scheme = fp8_scheme(d)
    quantized = quantized_params(cfg, TensorReader(d), scheme)
    state = load_state_dict(d, cfg, dtype, quantized)
    with meta_device():  # every parameter is assigned from the checkpoint below
        model = GPT(cfg)
    if quantized:  # FP8 block Linears load as engines.transforms.fp8.Fp8Linear; apply_fp8 picks their kernel
        from engines.transforms.fp8 import convert_to_storage

        convert_to_storage(model, {n.removesuffix(".weight") for n in quantized}, scheme.dynamic_activations)
    check_shapes(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.wte.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"checkpoint lacks parameters: {', '.join(missing[:5])}")
    return model.to(device).eval(), cfg


def _split_sizes(name: str, cfg: ModelConfig) -> list[int]:
    """Rows of each HF source of a fused parameter (q, k, v or gate, up)."""
    if name.endswith(("qkv.weight", "qkv.bias")):
        return [cfg.n_head * cfg.hd, cfg.kv_heads * cfg.hd, cfg.kv_heads * cfg.hd]
    return [cfg.ffn_dim, cfg.ffn_dim]


def _hf_state(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype | None = None, fp8: bool = False
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of our model; with fp8 the block Linears are quantized per output
    channel (a fused weight is quantized as a whole: per-row scales are the same either way) and
    each weight is followed by its "<name>_scale" (rows, 1) fp32."""
    from engines.transforms.fp8 import Fp8Linear

    ours = dict(model.state_dict())
    modules = dict(model.named_modules())
    for name, sources in weight_plan(cfg).items():
        module = modules.get(name.rpartition(".")[0])
        if isinstance(module, Fp8Linear) and name.endswith(".weight"):  # already FP8: keep its values
            t, scale = module.weight.detach().cpu(), module.weight_scale.detach().float().cpu()
        elif fp8 and name.endswith(QUANTIZABLE):
            t, scale = quantize_rows(ours[name].detach().cpu(), name)
        else:
            t, scale = ours[name].detach().cpu(), None
            t = t.to(dtype) if dtype is not None else t
        if len(sources) == 1:
            parts, scales = [t], [scale]
        else:  # split along dim 0 by the sizes the config implies
            sizes = _split_sizes(name, cfg)
            parts = list(t.split(sizes, 0))
            scales = list(scale.split(sizes, 0)) if scale is not None else [None] * len(parts)
        for src, part, sc in zip(sources, parts, scales):
            yield src.name, (part.t() if src.transpose else part).contiguous().clone()
            if sc is not None:
                yield scale_name(src.name), sc.contiguous().clone()


def save_checkpoint(model: torch.nn.Module, cfg: ModelConfig, out_dir: str | Path,
                    dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 2**30,
                    tokenizer_dir: str | Path | None = None, fp8: bool = False, overwrite: bool = False,
                    generation_config: str | Path | None = None) -> Path:
    """Write an HF-compatible directory that transformers' AutoModelForCausalLM can load.

    fp8 (or a model holding engines.transforms.fp8.Fp8Linear layers) writes the block Linears as FP8 in the
    compressed-tensors scheme (engines/transforms/fp8_format.py); everything else is written in `dtype`, and
    block Linears left in float next to FP8 ones are named in the config's `ignore` list.
    Files are written to a temporary directory beside `out_dir` and renamed into place, so a
    crash never leaves a half-written checkpoint. An existing `out_dir` is replaced only when it is
    empty, or holds a checkpoint of this project's files alone and `overwrite` is true (else
    engines.loading.output_dir.OutputDirError): nothing else in it is ever deleted. Folders and
    files get the modes a plain mkdir / open would (0777 / 0666 less the umask), so a server running
    as another user can read them. `generation_config`: a generation_config.json to copy (the source
    model's: extra EOS ids, pad id, sampling defaults); without it one is built from bos/eos alone.
    """
    out = Path(out_dir)
    check_output_dir(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(6)}.tmp"
    tmp.mkdir()  # not mkdtemp: its 0700 would make the model private to this user
    tensors = dict(_hf_state(model, cfg, dtype, fp8))
    quantized = any(v.dtype == FP8_DTYPE for v in tensors.values())
    dtype_name = str(next(iter(tensors.values())).dtype).removeprefix("torch.")  # the embedding's
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
    if quantized:  # block Linears kept in float (a per-layer choice) are named in `ignore`, as vLLM needs
        kept = sorted({src.name.removesuffix(".weight") for ours, sources in weight_plan(cfg).items()
                       if ours.endswith(QUANTIZABLE) for src in sources if tensors[src.name].dtype != FP8_DTYPE})
        hf["quantization_config"] = quantization_config(ignore=("lm_head", *kept))
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    if generation_config is not None and Path(generation_config).is_file():
        (tmp / "generation_config.json").write_bytes(Path(generation_config).read_bytes())
    else:
        gen = {k: v for k, v in (("bos_token_id", hf["bos_token_id"]), ("eos_token_id", hf["eos_token_id"]))
               if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            src = Path(tokenizer_dir) / name
            if src.is_file():
                (tmp / name).write_bytes(src.read_bytes())
    file_mode = tmp.stat().st_mode & 0o666  # the umask's file mode (safetensors writes 0600)
    for f in tmp.iterdir():
        f.chmod(file_mode)
    old = out.with_name(f".{out.name}.{secrets.token_hex(6)}.old")  # a fresh name: never someone else's folder
    if out.exists():
        check_output_dir(out, overwrite=overwrite)  # again: it may have changed while the weights were written
        os.replace(out, old)
    os.replace(tmp, out)
    _rmtree(old)
    return out


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
