"""P-tuned tasks in the engine: N virtual tokens, as input embeddings or as keys/values of every layer.

A request of a task runs as `[V, V+1, ..., V+N-1] + prompt` where V is the vocabulary size: the
N virtual ids take positions 0..N-1 (as PEFT prepends its prompt embeddings), count against the
context window and the KV blocks, and during prefill the worker replaces their embedding rows by
the table's rows. Decode never sees them (they are all prompt positions), and the LM head only
reads rows of real tokens' successors, so virtual ids never reach the sampler or detokenizer.

A task of every layer (P-tuning v2, PEFT's PREFIX_TUNING) carries, per virtual token, the keys and
values of every layer instead: an (N, layers * 2 * kv_width) table laid out as PEFT saves it (layer 0's
key, layer 0's value, layer 1's key, ...; kv_width = KV heads x head size). The same virtual ids hold
the positions; during prefill the attention backend writes the table's keys/values into those
positions of every layer's cache (engines/transforms/prompt_inject.py), so the prompt's tokens attend to them in
every layer, not only through the first layer's input. Keys are taken as they are (after rotary
embedding, as PEFT injects them into the cache).

On disk a task is a PEFT prompt-learning adapter directory (`adapter_config.json` +
`adapter_model.safetensors` with the tensor `prompt_embeddings`, (N, hidden) or (N, layers * 2 *
kv_width)) plus our
`task.json`. Nothing here unpickles: tensors come from safetensors only.

This module imports no torch (the gateway validates task names with it); the worker-side
injection lives in engines/transforms/prompt_inject.py.

The registry hands out a read-only numpy snapshot per request; replacing or unloading a task
swaps the registry entry and never touches a snapshot a running request holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from engines.core.sampling_params import RequestError

TASK_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_VIRTUAL_TOKENS = 512
PEFT_TYPES = ("P_TUNING", "PROMPT_TUNING", "PREFIX_TUNING")
TENSOR_NAME = "prompt_embeddings"


class TaskError(RequestError):
    """A task name, directory or table is unusable; the message names the field and the rule."""

    def __init__(self, message: str, param: str = "task", code: str = "invalid_task"):
        super().__init__(message, param=param, code=code)


class UnknownTaskError(TaskError):
    def __init__(self, name: str, known: list[str]):
        super().__init__(f"task: {name!r} is not loaded (loaded: {', '.join(known) or 'none'})",
                         code="task_not_found")


def check_task_name(name: object) -> str:
    """A task name is a single path component: 1-64 of [A-Za-z0-9_.-], starting alphanumeric, no `..`."""
    if not isinstance(name, str) or not TASK_NAME_RE.match(name) or ".." in name:
        raise TaskError(f"task: {name!r} is not a valid task name; use 1-64 characters of letters, digits, "
                        "'_', '-', '.', starting with a letter or digit, with no '..' or path separators",
                        param="task", code="invalid_task_name")
    return name


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def base_model_hashes(model_dir: str | Path) -> dict[str, str]:
    """sha256 of the model's config.json and tokenizer.json (what a task was trained against).

    Weights are not hashed (GBs); config + tokenizer identify the base well enough to refuse a
    table trained for another model, and the hidden size is checked separately."""
    d = Path(model_dir)
    out = {}
    for key, fname in (("base_model_sha256", "config.json"), ("tokenizer_sha256", "tokenizer.json")):
        if (d / fname).is_file():
            out[key] = file_sha256(d / fname)
    return out


@dataclass(frozen=True)
class ModelShape:
    """What a task's table must fit: the hidden size (input tasks) and layers x KV width (every layer)."""

    hidden: int
    n_layer: int
    kv_heads: int
    head_dim: int

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def prefix_width(self) -> int:
        return self.n_layer * 2 * self.kv_width

    @classmethod
    def of(cls, cfg) -> ModelShape:
        return cls(cfg.n_embd, cfg.n_layer, cfg.kv_heads, cfg.hd)


@dataclass(frozen=True)
class Task:
    name: str
    table: np.ndarray
    """(N, hidden) float32, or (N, layers * 2 * kv_width) for a task of every layer; read-only: the
    snapshot every request of this task carries."""
    meta: dict = dataclasses.field(default_factory=dict, compare=False)
    """task.json contents (template, metrics, hashes); empty for a bare PEFT adapter."""
    every_layer: bool = False
    """PREFIX_TUNING: the table holds every layer's keys/values, not input embeddings."""

    @property
    def num_virtual_tokens(self) -> int:
        return int(self.table.shape[0])


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    a.setflags(write=False)
    return a


def read_task_dir(path: str | Path, shape: ModelShape | None = None, expect: dict[str, str] | None = None,
                  name: str | None = None) -> Task:
    """Load and validate a task directory (PEFT adapter files, optional task.json) against `shape`."""
    d = Path(path)
    if not d.is_dir():
        raise TaskError(f"path: {str(d)!r} is not a directory", param="path", code="task_path_not_found")
    cfg_path, st_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not cfg_path.is_file() or not st_path.is_file():
        raise TaskError(f"path: {str(d)!r} must hold adapter_config.json and adapter_model.safetensors "
                        "(a PEFT P_TUNING, PROMPT_TUNING or PREFIX_TUNING adapter; .bin files are refused: never "
                        "unpickled)",
                        param="path", code="invalid_task_files")
    try:
        cfg = json.loads(cfg_path.read_text())
        tensors = load_file(st_path)
    except Exception as exc:  # malformed JSON or safetensors: reported, never crashes
        raise TaskError(f"path: cannot read the adapter in {str(d)!r}: {exc}", param="path",
                        code="invalid_task_files") from exc
    if cfg.get("peft_type") not in PEFT_TYPES:
        raise TaskError(f"adapter_config.json: peft_type {cfg.get('peft_type')!r} is not one of {PEFT_TYPES}",
                        param="path", code="invalid_task_files")
    if cfg.get("num_transformer_submodules", 1) != 1:
        raise TaskError("adapter_config.json: num_transformer_submodules must be 1 (a decoder-only model)",
                        param="path", code="invalid_task_files")
    if TENSOR_NAME not in tensors:
        raise TaskError(f"adapter_model.safetensors: no tensor {TENSOR_NAME!r} (found {sorted(tensors)})",
                        param="path", code="invalid_task_files")
    table = tensors[TENSOR_NAME]
    if table.ndim != 2 or not 1 <= table.shape[0] <= MAX_VIRTUAL_TOKENS:
        raise TaskError(f"adapter_model.safetensors: {TENSOR_NAME} must be (N, hidden) with 1 <= N <= "
                        f"{MAX_VIRTUAL_TOKENS}, got shape {tuple(table.shape)}", param="path",
                        code="invalid_task_files")
    every_layer = cfg["peft_type"] == "PREFIX_TUNING"
    if every_layer and shape is not None:
        check_prefix_config(cfg, shape)
    want = (shape.prefix_width if every_layer else shape.hidden) if shape is not None else None
    if want is not None and table.shape[1] != want:
        what = (f"layers x 2 x KV width is {shape.n_layer} x 2 x {shape.kv_width} = {want}" if every_layer
                else f"hidden size is {want}")
        raise TaskError(f"adapter_model.safetensors: {TENSOR_NAME} is {table.shape[1]} wide but this model's "
                        f"{what}", param="path", code="task_model_mismatch")
    if not np.isfinite(table).all():
        raise TaskError(f"adapter_model.safetensors: {TENSOR_NAME} holds NaN or inf", param="path",
                        code="invalid_task_files")
    meta: dict = {}
    if (d / "task.json").is_file():
        try:
            meta = json.loads((d / "task.json").read_text())
        except json.JSONDecodeError as exc:
            raise TaskError(f"task.json: not JSON: {exc}", param="path", code="invalid_task_files") from exc
        for key, want in (expect or {}).items():
            have = meta.get(key)
            if have is not None and have != want:
                raise TaskError(f"task.json: {key} {have[:12]}... does not match this model's {want[:12]}...: "
                                "the task was trained for another base model", param="path",
                                code="task_model_mismatch")
    name = check_task_name(name or meta.get("name") or d.name)
    return Task(name, _readonly(table), meta, every_layer)


def check_prefix_config(cfg: dict, shape: ModelShape) -> None:
    """A PREFIX_TUNING adapter_config.json must describe this model's layers and KV heads. (With
    prefix_projection PEFT saves the projected keys/values, the same (N, layers x 2 x KV width).)"""
    for key, want in (("num_layers", shape.n_layer), ("num_attention_heads", shape.kv_heads),
                      ("token_dim", shape.kv_width)):
        have = cfg.get(key)
        if have is not None and have != want:
            raise TaskError(f"adapter_config.json: {key} is {have} but this model has {want} (PREFIX_TUNING "
                            "needs one key and value per layer and KV head)", param="path",
                            code="task_model_mismatch")


def write_task_dir(path: str | Path, name: str, table, *, base_model: str = "",
                   peft_type: str = "P_TUNING", meta: dict | None = None, encoder_hidden_size: int | None = None,
                   shape: ModelShape | None = None) -> Path:
    """Write a task as PEFT writes an inference adapter, plus task.json. Returns the directory."""
    check_task_name(name)
    if peft_type not in PEFT_TYPES:
        raise TaskError(f"peft_type: {peft_type!r} is not one of {PEFT_TYPES}", param="peft_type")
    arr = table.detach().float().cpu().numpy() if hasattr(table, "detach") else np.asarray(table, np.float32)
    n, hidden = arr.shape
    if peft_type == "PREFIX_TUNING" and (shape is None or hidden != shape.prefix_width):
        raise TaskError(f"table: a PREFIX_TUNING table is (N, layers x 2 x KV width), got {arr.shape} for {shape}",
                        param="table")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": peft_type, "task_type": "CAUSAL_LM", "inference_mode": True, "num_virtual_tokens": n,
           "token_dim": hidden, "num_transformer_submodules": 1, "num_attention_heads": None, "num_layers": None,
           "base_model_name_or_path": base_model, "revision": None, "auto_mapping": None}
    if peft_type == "P_TUNING":
        cfg.update(encoder_reparameterization_type="MLP", encoder_hidden_size=encoder_hidden_size or hidden,
                   encoder_num_layers=2, encoder_dropout=0.0)
    elif peft_type == "PREFIX_TUNING":  # PEFT's layout: token_dim and heads are the KV heads' (GQA too)
        cfg.update(num_layers=shape.n_layer, num_attention_heads=shape.kv_heads, token_dim=shape.kv_width,
                   prefix_projection=False, encoder_hidden_size=shape.hidden)
    else:
        cfg.update(prompt_tuning_init="RANDOM", prompt_tuning_init_text=None, tokenizer_name_or_path=None,
                   tokenizer_kwargs=None)
    save_file({TENSOR_NAME: np.ascontiguousarray(arr)}, str(d / "adapter_model.safetensors.tmp"))
    (d / "adapter_model.safetensors.tmp").replace(d / "adapter_model.safetensors")
    (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    (d / "task.json").write_text(json.dumps({"name": name, "num_virtual_tokens": n, "hidden_size": hidden,
                                             "every_layer": peft_type == "PREFIX_TUNING", **(meta or {})}, indent=2))
    return d


class TaskRegistry:
    """The engine's loaded tasks by name. Thread-safe: the server loads tasks while steps run."""

    def __init__(self, model_dir: str | Path, shape: ModelShape):
        self.model_dir, self.shape = Path(model_dir), shape
        self.hashes = base_model_hashes(model_dir)
        self._tasks: dict[str, Task] = {}
        self._lock = threading.Lock()

    def load(self, name: str, path: str | Path | None = None) -> Task:
        """Load (or replace) a task from `path`, by default `<model>/ptuning/<name>`."""
        check_task_name(name)
        task = self.read(path if path is not None else self.model_dir / "ptuning" / name, name)
        with self._lock:
            self._tasks[name] = task
        return task

    def read(self, path: str | Path, name: str | None = None) -> Task:
        """Validate a task directory against this model without loading it."""
        return read_task_dir(path, shape=self.shape, expect=self.hashes, name=name)

    def add(self, task: Task) -> None:
        want = self.shape.prefix_width if task.every_layer else self.shape.hidden
        if task.table.shape[1] != want:
            raise TaskError(f"task: table width {task.table.shape[1]} != the model's {want}", code="task_model_mismatch")
        with self._lock:
            self._tasks[check_task_name(task.name)] = dataclasses.replace(task, table=_readonly(task.table))

    def unload(self, name: str) -> bool:
        with self._lock:
            return self._tasks.pop(name, None) is not None

    def get(self, name: str) -> Task:
        with self._lock:
            task = self._tasks.get(name)
            if task is None:
                raise UnknownTaskError(name, sorted(self._tasks))
            return task

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._tasks)

    def load_dir(self) -> list[str]:
        """Load every valid task under `<model>/ptuning/` (server start); returns their names."""
        root = self.model_dir / "ptuning"
        loaded = []
        if root.is_dir():
            for d in sorted(root.iterdir()):
                if d.is_dir() and TASK_NAME_RE.match(d.name) and (d / "adapter_model.safetensors").is_file():
                    self.load(d.name, d)
                    loaded.append(d.name)
        return loaded


def virtual_ids(vocab_size: int, n: int) -> list[int]:
    """The ids that stand for a task's N virtual tokens: V .. V+N-1."""
    return list(range(vocab_size, vocab_size + n))


def attach_tables(plan, task_of) -> None:
    """Give each new sequence of a task its table snapshot (the scheduler knows no tasks).

    task_of(seq_id) -> Task | None. The table crosses to the workers once, in SeqInit."""
    if any(task_of(init.seq_id) is not None for init in plan.new_seqs):
        plan.new_seqs = [init if (t := task_of(init.seq_id)) is None
                         else dataclasses.replace(init, prompt_table=t.table, prompt_every_layer=t.every_layer)
                         for init in plan.new_seqs]


MAX_DATASET_BYTES = 64 * 2**20


class DatasetError(RequestError):
    """A p-tuning dataset is malformed or too large; the message names the line and the field."""

    def __init__(self, message: str):
        super().__init__(message, param="data", code="invalid_dataset")


def read_dataset(source: str | Path, max_examples: int, max_bytes: int = MAX_DATASET_BYTES) -> list[dict]:
    """Records {"input", "output"} of a JSONL file, or of inline JSONL text (a str holding a newline
    or starting with '{'). Shared by training and the REST job API (which checks before it starts)."""
    if isinstance(source, str) and (source.lstrip().startswith("{") or "\n" in source):
        text = source
        if len(text.encode()) > max_bytes:
            raise DatasetError(f"data: more than the {max_bytes} bytes allowed")
    else:
        p = Path(source)
        if not p.is_file():
            raise DatasetError(f"data: {str(p)!r} is not a file")
        if p.stat().st_size > max_bytes:
            raise DatasetError(f"data: {p.stat().st_size} bytes is more than the {max_bytes} allowed")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"data: not UTF-8 text ({exc})") from None
    records = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(records) >= max_examples:
            raise DatasetError(f"data: more than max_examples={max_examples} examples; raise max_examples "
                               "or send fewer")
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"data line {no}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("input"), str) or not isinstance(rec.get("output"), str):
            raise DatasetError(f"data line {no}: needs string fields 'input' and 'output'")
        if not rec["output"]:
            raise DatasetError(f"data line {no}: 'output' is empty (it is what the loss is computed on)")
        records.append(rec)
    if len(records) < 2:
        raise DatasetError(f"data: {len(records)} example(s); at least 2 are needed (train + validation)")
    return records
