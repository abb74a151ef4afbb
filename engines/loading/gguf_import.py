"""Import a GGUF file (llama.cpp's format) into an HF-compatible checkpoint directory.

GGUF is an input format, like an HF directory: `import_gguf(src, out)` turns it into config.json,
model.safetensors, tokenizer.json, tokenizer_config.json and generation_config.json once, and
everything downstream (our engine, transformers, vLLM) reads that directory.

- Tensors are dequantized with the `gguf` package's reference dequantizers (F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) to float32, then cast to the requested dtype.
- llama.cpp's converter permutes the rows of llama/mistral q and k weights (it interleaves the two
  rotary halves of each head); `_unpermute` undoes that so HF's rotate-half RoPE applies again.
- The output appears atomically: it is written to a temporary sibling directory and renamed.

`gguf` is imported lazily: engines/ must import without it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from engines.loading.gguf_tokenizer import build_tokenizer

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# GGUF general.architecture -> (HF model_type, HF architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
_PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp permutes q/k rows only for these
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_SKIPPED = ("rope_freqs.weight",)  # llama3 rope factors: a function of the config, not a weight
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message names the field or tensor."""


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata (key -> decoded value) and its tensors (gguf ReaderTensor)."""

    path: Path
    meta: dict[str, Any]
    tensors: list[Any]

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))


def read_gguf(path: str | Path) -> GGUFFile:
    """Open and validate a GGUF file's header and tensor table (data is memory-mapped, not read)."""
    import gguf  # lazily: only a GGUF import needs it

    p = Path(path)
    if not p.is_file():
        raise GGUFImportError(f"{str(p)!r}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as exc:  # the reader raises ValueError/struct/IndexError on a corrupt header
        raise GGUFImportError(f"{p.name}: not a readable GGUF file, truncated or corrupt "
                              f"({p.stat().st_size} bytes; {type(exc).__name__}: {exc})") from exc
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as exc:
            raise GGUFImportError(f"{p.name}: metadata field {key!r} cannot be decoded ({exc})") from exc
    size = p.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFImportError(f"{p.name}: tensor {t.name!r} ends at byte {end} but the file has "
                                  f"{size} bytes (truncated file)")
    return GGUFFile(p, meta, list(reader.tensors))


def _req(g: GGUFFile, key: str, kind: type = int) -> Any:
    full = f"{g.arch}.{key}"
    if full not in g.meta:
        raise GGUFImportError(f"{g.path.name}: missing metadata field {full!r}")
    value = g.meta[full]
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise GGUFImportError(f"{g.path.name}: metadata field {full!r} must be {kind.__name__}, "
                              f"got {value!r}") from exc


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """transformers' config.json for the GGUF's architecture (llama, mistral, qwen2, qwen3)."""
    if g.arch not in ARCHITECTURES:
        raise GGUFImportError(f"{g.path.name}: general.architecture {g.arch!r} unsupported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    model_type, hf_arch = ARCHITECTURES[g.arch]
    n_embd, n_head = _req(g, "embedding_length"), _req(g, "attention.head_count")
    n_kv = int(g.meta.get(f"{g.arch}.attention.head_count_kv", n_head))
    head_dim = int(g.meta.get(f"{g.arch}.attention.key_length",
                              g.meta.get(f"{g.arch}.rope.dimension_count", n_embd // n_head)))
    names = {t.name for t in g.tensors}
    tokens = g.meta.get("tokenizer.ggml.tokens")
    embd = next((t for t in g.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFImportError(f"{g.path.name}: missing tensor 'token_embd.weight'")
    vocab = int(g.meta.get(f"{g.arch}.vocab_size", int(embd.shape[-1])))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": n_embd,
        "intermediate_size": _req(g, "feed_forward_length"),
        "num_hidden_layers": _req(g, "block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": _req(g, "context_length"),
        "rms_norm_eps": _req(g, "attention.layer_norm_rms_epsilon", float),
        "rope_theta": float(g.meta.get(f"{g.arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_dropout": 0.0,
    }
    if model_type in ("llama", "mistral"):
        cfg.update(attention_bias="blk.0.attn_q.bias" in names, mlp_bias=False)
    if model_type == "qwen3":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type == "mistral":
        cfg["sliding_window"] = g.meta.get(f"{g.arch}.attention.sliding_window")
    scaling = g.meta.get(f"{g.arch}.rope.scaling.type")
    if scaling and scaling != "none":
        if scaling not in ("linear", "yarn"):
            raise GGUFImportError(f"{g.path.name}: {g.arch}.rope.scaling.type {scaling!r} unsupported; "
                                  "supported: none, linear, yarn")
        rs = {"rope_type": scaling, "factor": float(g.meta.get(f"{g.arch}.rope.scaling.factor", 1.0))}
        if scaling == "yarn":
            rs["original_max_position_embeddings"] = int(
                g.meta.get(f"{g.arch}.rope.scaling.original_context_length", cfg["max_position_embeddings"]))
        cfg["rope_scaling"] = rs
    for key, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                    ("padding_token_id", "pad_token_id")):
        if (v := g.meta.get(f"tokenizer.ggml.{key}")) is not None:
            cfg[hf] = int(v)
    if tokens is not None and len(tokens) != vocab:
        raise GGUFImportError(f"{g.path.name}: tokenizer.ggml.tokens has {len(tokens)} tokens but "
                              f"{g.arch}.vocab_size is {vocab}")
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (n_head, hd/2, 2) interleaved back to (n_head, 2, hd/2)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(t: Any) -> np.ndarray:
    """One GGUF tensor as float32 in PyTorch's (out, in) order; names the tensor on failure."""
    from gguf import quants

    kind = t.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFImportError(f"tensor {t.name!r}: type {kind} unsupported; supported: {', '.join(SUPPORTED_TYPES)}")
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    try:
        data = np.asarray(t.data)
        out = quants.dequantize(data if kind in ("F32", "F16") else data.view(np.uint8), t.tensor_type)
        out = np.ascontiguousarray(out, dtype=np.float32).reshape(shape)
        return out if out.flags.writeable else out.copy()  # F32 data is a view of the read-only memmap
    except Exception as exc:
        raise GGUFImportError(f"tensor {t.name!r} ({kind}, shape {shape}): cannot be dequantized ({exc})") from exc


def hf_state_dict(g: GGUFFile, cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The GGUF's tensors under transformers' parameter names, dequantized and cast to `dtype`."""
    out: dict[str, torch.Tensor] = {}
    n_layer = cfg["num_hidden_layers"]
    for t in g.tensors:
        if t.name in _SKIPPED:
            continue
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        elif (m := _LAYER_RE.fullmatch(t.name)) and m.group(2) in _LAYER_NAMES and int(m.group(1)) < n_layer:
            name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        else:
            raise GGUFImportError(f"{g.path.name}: tensor {t.name!r} has no place in a {g.arch} model")
        w = dequantize_tensor(t)
        if g.arch in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif g.arch in _PERMUTED_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = torch.from_numpy(w).to(dtype)
    for i in range(n_layer):
        for part in ("input_layernorm.weight", "self_attn.q_proj.weight", "mlp.down_proj.weight"):
            if f"model.layers.{i}.{part}" not in out:
                raise GGUFImportError(f"{g.path.name}: missing tensor for model.layers.{i}.{part}")
    return out


def _generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    return {**gen, "_from_model_config": True}


def import_gguf(src: str | Path, out: str | Path, dtype: str = "bf16") -> Path:
    """Write `src` (a .gguf) as an HF checkpoint directory at `out` (which must not exist).

    dtype: "bf16" or "fp32", the dtype of the written weights.
    """
    if dtype not in _DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} unsupported; supported: {', '.join(_DTYPES)}")
    out = Path(out)
    if out.exists():
        raise GGUFImportError(f"output directory {str(out)!r} already exists")
    g = read_gguf(src)
    cfg = hf_config(g)
    cfg["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    tk, tk_cfg = build_tokenizer({**g.meta, "context_length": cfg["max_position_embeddings"]})
    state = hf_state_dict(g, cfg, _DTYPES[dtype])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(cfg), indent=2) + "\n")
        tk.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tk_cfg, indent=2) + "\n")
        special = {k: tk_cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in tk_cfg}
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
