"""The model's shape: `ModelConfig`, and its conversion from and to transformers' `config.json`
(gpt2, llama, qwen2, qwen3, mistral).

The bottom of engines/' configuration: imports nothing of engines but engines.model.rope's tables (lazily),
so engines.core.config (the engine's options) and every reader of a checkpoint can import it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

MODEL_TYPES = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
"""gpt2, and the rotary families (llama and its relatives: one model file, small differences below)."""


class ConfigError(ValueError):
    """A configuration value is missing or out of range; the message names the field."""


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT model of the GPT-2 family or of the Llama family and its relatives."""

    model_type: Literal["gpt2", "llama", "qwen2", "qwen3", "mistral"]
    """gpt2: learned positions, LayerNorm, GELU(tanh), biases. llama (and qwen2, qwen3, mistral):
    RoPE, RMSNorm, SwiGLU, GQA; the relatives differ only by qkv_bias, qk_norm and rope_scaling."""
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int = 0
    """Key/value heads for grouped-query attention; 0 means n_head (plain multi-head)."""
    head_dim: int = 0
    """Per-head width; 0 means n_embd // n_head."""
    intermediate_size: int = 0
    """MLP hidden width; 0 means 4 * n_embd."""
    max_position_embeddings: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bias: bool = True
    """Biases in the attention and MLP projections (GPT-2 has them, Llama has not)."""
    activation: Literal["gelu_tanh", "gelu", "silu"] = "gelu_tanh"
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches (training only)."""
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    qkv_bias: bool = False
    """Biases on the q, k and v projections only (Qwen2), where `bias` is off."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before the rotary embedding (Qwen3)."""
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """Rope scaling as sorted (key, value) pairs of config.json's rope_scaling, rope_type included
    (engines/model/rope.py: linear, dynamic, llama3, yarn); empty for plain RoPE."""

    def __post_init__(self) -> None:
        _require(self.model_type in MODEL_TYPES, "model_type",
                 f"unsupported model_type {self.model_type!r}; supported: {', '.join(MODEL_TYPES)}")
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "max_position_embeddings"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, f"must be a positive integer, got {value!r}")
        _require(self.n_kv_head >= 0 and self.head_dim >= 0 and self.intermediate_size >= 0,
                 "n_kv_head/head_dim/intermediate_size", "must be >= 0 (0 selects the default)")
        if self.head_dim == 0:
            _require(self.n_embd % self.n_head == 0, "n_embd",
                     f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        _require(self.n_head % self.kv_heads == 0, "n_kv_head",
                 f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads})")
        _require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        _require(self.norm_eps > 0, "norm_eps", f"must be > 0, got {self.norm_eps}")
        if self.model_type == "gpt2":
            _require(self.kv_heads == self.n_head, "n_kv_head", "gpt2 has no grouped-query attention")
            _require(not (self.qkv_bias or self.qk_norm or self.rope_scaling), "model_type",
                     "gpt2 has no qkv_bias, qk_norm or rope_scaling")
        if self.rope_scaling:
            from engines.model.rope import REQUIRED, ROPE_TYPES

            kind = dict(self.rope_scaling).get("rope_type", "default")
            _require(kind in ROPE_TYPES, "rope_scaling.rope_type",
                     f"unsupported rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
            missing = [k for k in REQUIRED.get(kind, ()) if dict(self.rope_scaling).get(k) is None]
            _require(not missing, "rope_scaling", f"rope type {kind!r} needs {', '.join(missing)}")

    # derived values
    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def ffn_dim(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    @property
    def uses_rope(self) -> bool:
        return self.model_type != "gpt2"

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count from the shapes alone (no model needs to be built)."""
        c, hd = self.n_embd, self.hd
        qkv = c * (self.n_head + 2 * self.kv_heads) * hd
        proj = self.n_head * hd * c
        mlp = c * self.ffn_dim * (3 if self.activation == "silu" else 2)
        norms = (4 if self.model_type == "gpt2" else 2) * c
        biases = ((self.n_head + 2 * self.kv_heads) * hd + c + self.ffn_dim + c) if self.bias else 0
        if self.qkv_bias and not self.bias:
            biases = (self.n_head + 2 * self.kv_heads) * hd
        per_layer = qkv + proj + mlp + norms + biases + (2 * hd if self.qk_norm else 0)
        emb = self.vocab_size * c + (self.max_position_embeddings * c if self.model_type == "gpt2" else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * c
        total = self.n_layer * per_layer + (2 if self.model_type == "gpt2" else 1) * c + head
        return total + (emb if include_embeddings else 0)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # HF config.json conversion
    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dictionary (model_type one of MODEL_TYPES)."""
        return model_config_from_hf(d)

    def to_hf(self) -> dict[str, Any]:
        return model_config_to_hf(self)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
        cfg = cls.from_hf(read_json_object(path))
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():  # its EOS ids (Llama 3's <|eot_id|>, chat models' end of turn) end generation too
            extra = read_json_object(gen).get("eos_token_id")
            extra = [extra] if isinstance(extra, int) else (extra or [])
            if not all(isinstance(e, int) and not isinstance(e, bool) for e in extra):
                raise ConfigError(f"generation_config.json: eos_token_id must be an int or a list of ints, got {extra!r}")
            eos = tuple(dict.fromkeys((*cfg.eos_token_id, *extra)))
            if eos != cfg.eos_token_id:
                cfg = cfg.replace(eos_token_id=eos)
        return cfg


def read_json_object(path: Path) -> dict[str, Any]:
    """A model directory's JSON file (config.json, generation_config.json) as a dict; ConfigError
    naming the file when it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path.name}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}: must hold a JSON object")
    return data


# transformers' config.json

_GPT2_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _get(d: dict[str, Any], key: str, *, default: Any = ..., kind: type | tuple = int) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"config.json: missing required field {key!r}")
        return default
    value = d[key]
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"config.json: field {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind):
        raise ConfigError(f"config.json: field {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _eos(d: dict[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def model_config_from_hf(d: dict[str, Any]) -> ModelConfig:
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json: unsupported model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    if model_type == "gpt2":
        act = d.get("activation_function", "gelu_new")
        if act not in _GPT2_ACT:
            raise ConfigError(f"config.json: activation_function {act!r} unsupported; "
                              f"supported: {', '.join(_GPT2_ACT)}")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if d.get(flag):
                raise ConfigError(f"config.json: {flag}=true is not supported")
        if d.get("scale_attn_weights") is False:
            raise ConfigError("config.json: scale_attn_weights=false is not supported")
        n_embd = _get(d, "n_embd")
        return ModelConfig(
            model_type="gpt2",
            vocab_size=_get(d, "vocab_size"),
            n_layer=_get(d, "n_layer"),
            n_head=_get(d, "n_head"),
            n_embd=n_embd,
            intermediate_size=_get(d, "n_inner", default=0) or 4 * n_embd,
            max_position_embeddings=_get(d, "n_positions", default=1024),
            norm_eps=_get(d, "layer_norm_epsilon", default=1e-5, kind=float),
            tie_word_embeddings=_get(d, "tie_word_embeddings", default=True, kind=bool),
            bias=True,
            activation=_GPT2_ACT[act],
            dropout=_get(d, "resid_pdrop", default=0.0, kind=float),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=_eos(d),
        )
    return _rotary_from_hf(d, model_type)


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}


def _rope_scaling(d: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...]]:
    """(rope theta, sorted rope-scaling pairs) from config.json's rope_parameters (transformers 5)
    or rope_scaling + rope_theta (earlier writers); ConfigError names an unknown rope type."""
    from engines.model.rope import ROPE_TYPES

    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError("config.json: rope_parameters / rope_scaling must be objects")
    merged = {**scaling, **params}
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json: rope_scaling.rope_type {kind!r} unsupported; supported: {', '.join(ROPE_TYPES)}")
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    if kind == "default":
        return float(theta), ()
    keep = {k: v for k, v in merged.items() if k not in ("type", "rope_theta", "rope_type") and v is not None}
    return float(theta), tuple(sorted({**keep, "rope_type": kind}.items()))


def _rotary_from_hf(d: dict[str, Any], model_type: str) -> ModelConfig:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json: hidden_act {act!r} unsupported for {model_type}; supported: silu")
    if d.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=true is not supported")
    theta, scaling = _rope_scaling(d)
    n_embd, n_head = _get(d, "hidden_size"), _get(d, "num_attention_heads")
    head_dim = _get(d, "head_dim", default=0) or n_embd // n_head
    max_pos = _get(d, "max_position_embeddings", default=2048)
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", model_type == "mistral")  # Qwen2/3 name it; off by default there
    if uses_window and window is not None and window < max_pos:
        raise ConfigError(
            f"config.json: sliding_window={window} is shorter than max_position_embeddings={max_pos}; "
            "sliding-window attention is not implemented (set sliding_window to null, or "
            "max_position_embeddings to at most the window)")
    qkv_bias = model_type == "qwen2" and d.get("attention_bias") is not False  # Qwen2's q/k/v have biases
    return ModelConfig(
        model_type=model_type,
        vocab_size=_get(d, "vocab_size"),
        n_layer=_get(d, "num_hidden_layers"),
        n_head=n_head,
        n_embd=n_embd,
        n_kv_head=_get(d, "num_key_value_heads", default=n_head),
        head_dim=head_dim if head_dim * n_head != n_embd else 0,
        intermediate_size=_get(d, "intermediate_size"),
        max_position_embeddings=max_pos,
        norm_eps=_get(d, "rms_norm_eps", default=1e-6, kind=float),
        rope_theta=theta,
        tie_word_embeddings=_get(d, "tie_word_embeddings", default=False, kind=bool),
        bias=model_type in ("llama", "qwen3", "mistral") and _get(d, "attention_bias", default=False, kind=bool),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        activation="silu",
        dropout=_get(d, "attention_dropout", default=0.0, kind=float),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=_eos(d),
    )


def model_config_to_hf(c: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    eos: Any = list(c.eos_token_id) if len(c.eos_token_id) > 1 else (c.eos_token_id[0] if c.eos_token_id else None)
    if c.model_type == "gpt2":
        if c.activation not in ("gelu_tanh", "gelu") or not c.bias:
            raise ConfigError("gpt2 checkpoints need bias=true and a gelu activation")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": c.vocab_size,
            "n_positions": c.max_position_embeddings,
            "n_embd": c.n_embd,
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_inner": c.ffn_dim,
            "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
            "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": c.dropout,
            "embd_pdrop": c.dropout,
            "attn_pdrop": c.dropout,
            "tie_word_embeddings": c.tie_word_embeddings,
            "bos_token_id": c.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": torch_dtype,
        }
    out = {
        "architectures": [_ARCH[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.hd,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "hidden_act": "silu",
        "attention_dropout": c.dropout,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": torch_dtype,
    }
    if c.model_type == "qwen2":
        if c.bias or not c.qkv_bias:
            raise ConfigError("qwen2 checkpoints have biases on q, k and v only (qkv_bias=true, bias=false)")
        out.update(use_sliding_window=False, sliding_window=None)
    else:
        if c.qkv_bias and not c.bias:
            raise ConfigError(f"{c.model_type} checkpoints have no q/k/v-only biases (qkv_bias is Qwen2's)")
        out.update(attention_bias=c.bias, mlp_bias=False)
    if c.model_type == "mistral":
        out["sliding_window"] = None
    if c.model_type == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None)
    if c.qk_norm != (c.model_type == "qwen3"):
        raise ConfigError("qk_norm is Qwen3's (model_type qwen3) and only Qwen3's")
    if c.rope_scaling:
        out["rope_scaling"] = dict(c.rope_scaling)
    return out
