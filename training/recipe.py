"""A training recipe: YAML parsed into frozen dataclasses.

    init:   a model directory to continue training from (any directory the engine loads); the
            model section then comes from its config.json (only model.dropout may be changed)
    model:  engines.ModelConfig fields (vocab_size, bos/eos default to the data folder's tokenizer)
    data:   DataSpec      where the token files are, window length
    optim:  OptimSpec     AdamW and the warmup + cosine schedule
    train:  TrainSpec     batch, steps, precision, evaluation and checkpoint cadence
    out:    OutSpec       run folder (metrics, checkpoint) and the exported model folder

Unknown keys, wrong types and inconsistent sizes raise `ConfigError` naming the key, e.g.
`optim.lrr: unknown key`. Values derived from a recipe (gradient-accumulation steps for a world
size, the fingerprint a resume is checked against) are pure functions below; a recipe is never
changed after it is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engines.core.config import ConfigError, ModelConfig


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


@dataclass(frozen=True)
class DataSpec:
    dir: str = "data/shakespeare"
    """Folder written by `shardserve data` (relative paths are from the working directory)."""
    seq_len: int = 256
    """Tokens per training window (the context length trained)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.seq_len, int) and self.seq_len > 0, "data.seq_len",
                 f"must be a positive integer, got {self.seq_len!r}")


@dataclass(frozen=True)
class OptimSpec:
    lr: float = 1e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices and embeddings; never on biases or norm scales."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 100
    """Linear warmup from lr / warmup_steps to lr."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, "optim.min_lr", f"must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        _require(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            _require(0 <= v < 1, f"optim.{name}", f"must be in [0, 1), got {v}")
        _require(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps}")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(self.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0 disables), got {self.grad_clip}")


@dataclass(frozen=True)
class TrainSpec:
    seed: int = 0
    """Seeds the weights, the data order and dropout."""
    max_steps: int = 1000
    """Optimizer steps; the cosine schedule ends here."""
    batch_size: int = 32
    """Global batch: sequences per optimizer step, summed over ranks and accumulation steps."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward; accumulation = batch_size / (micro * world)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16: autocast matmuls to bfloat16 (CPU and GPU), fp32 master weights and optimizer; fp32.
    auto: on CPU, time a forward + backward of this recipe's shapes in both and train in the faster
    (bf16 is ~30x slower than fp32 on CPUs without AMX / AVX512-BF16); on CUDA, bf16 where the GPU
    has it (training/precision.py)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    time_budget_s: float = 0.0
    """If > 0, seconds for the training loop and the final evaluation (train.final_eval): the schedule runs on
    max(step / max_steps, (elapsed + expected final-evaluation time) / budget) and training stops
    when that reaches 1, so the run fits the budget on a slower or busier machine, its learning
    rate annealed (not bitwise reproducible then: the step count depends on the machine)."""
    eval_every: int = 100
    """Steps between validation evaluations; 0: only the final one (which covers the whole val split)."""
    eval_windows: int = 64
    """Validation windows of seq_len tokens per periodic evaluation (spread evenly over the val split)."""
    final_eval: bool = True
    """Evaluate once more after the last step (its expected time is kept inside time_budget_s). False:
    no final evaluation, the run reports no validation loss and a time budget covers training alone
    (a benchmark that scores the exported model itself, benchmarks/bench_train_init.py --finetune)."""
    final_eval_windows: int = 0
    """Windows of the final evaluation, spread evenly over the val split (the same ones every run);
    0: the whole split (75k tokens of Shakespeare: minutes for a 135M model on a CPU)."""
    ckpt_every: int = 0
    """Steps between checkpoints (one is always written at the end and on SIGTERM / Ctrl-C); 0: none."""
    log_every: int = 1
    """Steps between metrics lines."""
    num_threads: int = 0
    """torch intra-op threads per rank; 0 keeps torch's default (CPU cores / ranks when launched)."""
    # Megatron layout (training/parallel/): data parallel = ranks / (tensor x pipeline)
    tensor_parallel_size: int = 1
    """Ranks that split each layer's heads, MLP width and vocabulary (Megatron TP)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages, each a contiguous range of layers (micro-batches of micro_batch_size)."""
    sequence_parallel: bool = False
    """With TP: norms and dropouts on a 1/TP shard of the sequence (activations / TP); needs seq_len % TP == 0."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation: selective = core attention only; full = keep only each block's input."""
    recompute_layers: int = 0
    """Recompute only the first k layers of each stage; 0: all."""
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """1f1b: at most stages micro-batches in flight per stage; gpipe: all forwards, then all backwards."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "micro_batch_size", "eval_windows", "log_every"):
            v = getattr(self, name)
            _require(v > 0, f"train.{name}", f"must be a positive integer, got {v}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            _require(getattr(self, name) >= 1, f"train.{name}", f"must be an integer >= 1, got {getattr(self, name)}")
        _require(not self.sequence_parallel or self.tensor_parallel_size > 1, "train.sequence_parallel",
                 "needs train.tensor_parallel_size > 1 (it splits the sequence across the TP group)")
        megatron = self.tensor_parallel_size * self.pipeline_parallel_size > 1 or self.recompute != "none"
        _require(not (megatron and self.time_budget_s), "train.time_budget_s",
                 "is not supported on a Megatron layout (tensor / pipeline parallel or recompute) yet; set it to 0 "
                 "and bound the run with train.max_steps")
        for name in ("eval_every", "ckpt_every", "num_threads", "seed", "recompute_layers", "final_eval_windows"):
            v = getattr(self, name)
            _require(v >= 0, f"train.{name}", f"must be >= 0, got {v}")
        _require(self.batch_size % self.micro_batch_size == 0, "train.batch_size",
                 f"must be a multiple of train.micro_batch_size ({self.micro_batch_size}), got {self.batch_size}")
        _require(self.time_budget_s >= 0, "train.time_budget_s", f"must be >= 0 (0: none), got {self.time_budget_s}")


@dataclass(frozen=True)
class OutSpec:
    dir: str = "runs/default"
    """Run folder: metrics.jsonl, loss_curve.png, checkpoint.safetensors."""
    export_dir: str = ""
    """If set, the final model is exported here as an HF-compatible directory (tokenizer included)."""


@dataclass(frozen=True)
class Recipe:
    model: ModelConfig
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    out: OutSpec = field(default_factory=OutSpec)
    init: str = ""
    """A model directory to start from (continued training / fine-tuning): its weights replace the
    seeded initialisation on every layout, and its tokenizer files, chat template and generation
    config travel to the export. Empty: train from scratch."""

    def __post_init__(self) -> None:
        m = self.model
        _require(bool(m.head_dim) or m.n_embd % m.n_head == 0, "model.n_embd",
                 f"must be divisible by model.n_head ({m.n_head}), got {m.n_embd}")
        _require(self.data.seq_len <= m.max_position_embeddings, "data.seq_len",
                 f"must be <= model.max_position_embeddings ({m.max_position_embeddings}), got {self.data.seq_len}")
        _require(self.optim.warmup_steps <= self.train.max_steps, "optim.warmup_steps",
                 f"must be <= train.max_steps ({self.train.max_steps}), got {self.optim.warmup_steps}")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.data.seq_len


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataSpec, "optim": OptimSpec, "train": TrainSpec,
                             "out": OutSpec}
INIT_OVERRIDABLE = ("dropout",)
"""Model keys a recipe may set beside `init` (the rest is the checkpoint's shape)."""
# fields that do not change what is computed: a resume may differ in these
RESUMABLE = {"train.eval_every", "train.eval_windows", "train.final_eval", "train.final_eval_windows", "train.ckpt_every", "train.log_every", "train.num_threads",
             "train.device", "out.dir", "out.export_dir", "data.dir"}


def grad_accum_steps(train: TrainSpec, world_size: int) -> int:
    """Micro-steps (pipeline micro-batches) per optimizer step on each data-parallel rank of a
    world of `world_size` ranks: data parallel = world / (tensor_parallel_size x pipeline_parallel_size)."""
    mp = train.tensor_parallel_size * train.pipeline_parallel_size
    _require(world_size % mp == 0, "--num-workers",
             f"{world_size} ranks are not divisible by train.tensor_parallel_size x train.pipeline_parallel_size "
             f"= {train.tensor_parallel_size} x {train.pipeline_parallel_size}")
    dp = world_size // mp
    per_step = train.micro_batch_size * dp
    _require(train.batch_size % per_step == 0, "train.batch_size",
             f"must be a multiple of train.micro_batch_size x ranks ({train.micro_batch_size} x {dp}), "
             f"got {train.batch_size}" + (f" (data-parallel ranks: {world_size} / (TP x PP = {mp}))" if mp > 1 else ""))
    return train.batch_size // per_step


def fingerprint(recipe: Recipe) -> dict[str, Any]:
    """The flattened fields that determine the training trajectory (what a resume must match)."""
    flat = _flatten(recipe.to_dict())
    return {k: v for k, v in flat.items() if k not in RESUMABLE}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """`value` converted to `hint` (int, float, str, bool, Literal, Optional, tuple[int, ...])."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        _require(value in allowed, key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        return _check_type(key, value, next(a for a in args if a is not type(None)))
    if origin is tuple:
        _require(isinstance(value, (list, tuple)), key, f"must be a list, got {value!r}")
        item = typing.get_args(hint)[0]
        return tuple(_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if hint is bool:
        _require(isinstance(value, bool), key, f"must be true or false, got {value!r}")
    elif hint is int:
        _require(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
    elif hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), key,
                 f"must be a number, got {value!r}")
        return float(value)
    elif hint is str:
        _require(isinstance(value, str), key, f"must be a string, got {value!r}")
    return value


def _build(section: str, cls: type, values: Any) -> Any:
    if values is None:
        values = {}
    _require(isinstance(values, dict), section, f"must be a mapping of keys to values, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in values.items():
        _require(key in names, f"{section}.{key}", f"unknown key; {section} accepts: {', '.join(names)}")
        kwargs[key] = _check_type(f"{section}.{key}", value, hints[key])
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg if msg.startswith(f"{section}.") else f"{section}.{msg}") from None
    except TypeError as exc:  # a required field is missing
        missing = [n for n in names if n not in kwargs and
                   next(f for f in dataclasses.fields(cls) if f.name == n).default is dataclasses.MISSING]
        raise ConfigError(f"{section}.{missing[0] if missing else '?'}: required key is missing ({exc})") from None


def init_model_config(init: str, model: dict[str, Any]) -> ModelConfig:
    """The model section of a recipe with `init`: the directory's config.json, with the keys of
    INIT_OVERRIDABLE taken from `model`; any other key must equal the checkpoint's value (so a
    recipe written out by to_dict() reads back) or it is refused by name."""
    _require(isinstance(init, str) and bool(init), "init", f"must be a model directory path, got {init!r}")
    d = Path(init)
    _require(d.is_dir() and (d / "config.json").is_file(), "init",
             f"{init!r} is not a model directory (no config.json); give a directory the engine loads "
             "(`shardserve import` turns a GGUF file into one)")
    try:
        cfg = ModelConfig.from_dir(d)
    except ConfigError as exc:
        raise ConfigError(f"init: {init}: {exc}") from None
    base = json.loads(json.dumps(dataclasses.asdict(cfg)))
    hints = typing.get_type_hints(ModelConfig)
    changes = {}
    for key, value in model.items():
        _require(key in base, f"model.{key}", f"unknown key; model accepts: {', '.join(base)}")
        if key in INIT_OVERRIDABLE:
            changes[key] = _check_type(f"model.{key}", value, hints[key])
        else:
            same = value == base[key] or (isinstance(value, (list, tuple)) and list(value) == base[key])
            _require(same, f"model.{key}", f"is set by init ({init}: {base[key]!r}); only "
                     f"{', '.join('model.' + k for k in INIT_OVERRIDABLE)} may change, got {value!r}")
    try:
        return cfg.replace(**changes)
    except ConfigError as exc:
        raise ConfigError(f"model.{exc}") from None


def recipe_from_dict(d: Any, data_meta: dict[str, Any] | None = None) -> Recipe:
    """Build a Recipe; `data_meta` (the data folder's meta.json) fills model.vocab_size / bos / eos.
    With `init` (a model directory) the model section comes from its config.json."""
    _require(isinstance(d, dict), "recipe", f"must be a mapping with sections {', '.join(SECTIONS)}, got {d!r}")
    for key in d:
        _require(key in SECTIONS or key == "init", str(key),
                 f"unknown section; a recipe has: init, {', '.join(SECTIONS)}")
    init = d.get("init") or ""
    if init:
        model_d = d.get("model") or {}
        _require(isinstance(model_d, dict), "model", f"must be a mapping of keys to values, got {model_d!r}")
        cfg = init_model_config(str(init), model_d)
        if data_meta is not None:
            _require(cfg.vocab_size >= data_meta["vocab_size"], "data.dir",
                     f"its tokenizer has {data_meta['vocab_size']} tokens, more than init's vocabulary "
                     f"({cfg.vocab_size}); prepare the data with the model's own tokenizer "
                     f"(`shardserve data --tokenizer {init}`)")
            tok = Path(str(init)) / "tokenizer.json"
            want = data_meta.get("sha256", {}).get("tokenizer.json")
            if tok.is_file() and want:
                import hashlib

                _require(hashlib.sha256(tok.read_bytes()).hexdigest() == want, "data.dir",
                         f"was tokenized with another tokenizer than init's ({tok}); prepare it with "
                         f"`shardserve data --tokenizer {init} --out DIR`")
        parts = {name: _build(name, cls, d.get(name)) for name, cls in SECTIONS.items() if name != "model"}
        return Recipe(model=cfg, init=str(init), **parts)
    _require("model" in d, "model", "required section is missing (or give init: a model directory)")
    model = dict(d["model"] or {})
    if data_meta is not None:
        model.setdefault("vocab_size", data_meta["vocab_size"])
        model.setdefault("bos_token_id", data_meta.get("bos_token_id"))
        model.setdefault("eos_token_id", [data_meta["eos_token_id"]])
    elif "vocab_size" not in model:
        raise ConfigError("model.vocab_size: missing; set it, or prepare the data folder (data.dir) first so "
                          "it is read from its meta.json")
    parts = {name: _build(name, cls, model if name == "model" else d.get(name)) for name, cls in SECTIONS.items()}
    recipe = Recipe(**parts)
    if data_meta is not None:
        _require(recipe.model.vocab_size >= data_meta["vocab_size"], "model.vocab_size",
                 f"must be >= the tokenizer's vocabulary ({data_meta['vocab_size']}), got {recipe.model.vocab_size}")
    return recipe


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` strings (values in YAML syntax) applied to a recipe dictionary."""
    import yaml

    out = {k: dict(v or {}) if isinstance(v, dict) or v is None else v for k, v in d.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if key.strip() == "init" and sep:
            out["init"] = raw.strip()
            continue
        section, dot, name = key.strip().partition(".")
        _require(bool(sep and dot and name), item, "an override is written section.key=value")
        out.setdefault(section, {})
        _require(isinstance(out[section], dict), section, "must be a mapping")
        out[section][name] = yaml.safe_load(raw)
    return out


def load_recipe(path: str | Path, overrides: list[str] | None = None, init: str | Path | None = None) -> Recipe:
    """Read a YAML recipe; model.vocab_size and bos/eos default to those of data.dir's tokenizer.
    `init` (the CLI's --init) replaces the recipe's init key."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"recipe: no such file {str(p)!r}")
    try:
        d = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"recipe: {p} is not valid YAML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe: {p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"recipe: {p}: cannot read it ({exc.strerror or exc})") from None
    d = apply_overrides(d if isinstance(d, dict) else {}, overrides or []) if overrides else d
    if init is not None:
        d = {**(d if isinstance(d, dict) else {}), "init": str(init)}
    meta = None
    if isinstance(d, dict) and isinstance(d.get("data") or {}, dict):
        data_dir = Path((d.get("data") or {}).get("dir", DataSpec.dir))
        if (data_dir / "meta.json").is_file():
            meta = json.loads((data_dir / "meta.json").read_text())
        elif "vocab_size" not in (d.get("model") or {}) and not d.get("init"):
            raise ConfigError(f"data.dir: {str(data_dir)!r} holds no prepared data (no meta.json), so the "
                              f"vocabulary is unknown; run `shardserve data --out {data_dir}` first "
                              "(or set model.vocab_size)")
    return recipe_from_dict(d, meta)
