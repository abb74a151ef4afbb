"""Workloads: what each request asks for (prompt, input tokens, max output tokens).

Three sources: synthetic prompts with length distributions (or a weighted mix of (input, output)
pairs), a JSONL prompt file, and a JSONL trace replayed at its own timestamps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.config import LengthDist, LengthPair, LoadTestConfig
from loadtest.errors import LoadTestError
from loadtest.prompts import PromptBuilder

_PROMPT_KEYS = ("prompt", "text", "messages", "conversations")
_OUTPUT_KEYS = ("output_len", "output_tokens", "output_length", "max_tokens")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request's content. `prompt` is always set (chat messages are also flattened into it);
    `messages` is set when the source gave a chat conversation."""

    prompt: str
    input_tokens: int  # exact with a tokenizer, else estimated
    output_tokens: int  # max_tokens asked for
    messages: tuple[dict, ...] | None = None


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    """n integer lengths (tokens) drawn from `dist`."""
    if dist.kind == "fixed":
        return np.full(n, dist.value, dtype=np.int64)
    if dist.kind == "uniform":
        return rng.integers(dist.low, dist.high + 1, size=n)
    # Truncated normal by resampling the out-of-bounds draws; clipping would pile mass on the bounds.
    out = np.rint(rng.normal(dist.value, dist.std, size=n))
    for _ in range(100):
        bad = (out < dist.low) | (out > dist.high)
        if not bad.any():
            break
        out[bad] = np.rint(rng.normal(dist.value, dist.std, size=int(bad.sum())))
    return np.clip(out, dist.low, dist.high).astype(np.int64)


def sample_pairs(
    mix: tuple[LengthPair, ...], n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """n (input, output) length pairs drawn from a weighted mix."""
    weights = np.array([p.weight for p in mix], dtype=float)
    weights /= weights.max()  # finite weights near float max would sum to inf (and p to NaN)
    pick = rng.choice(len(mix), size=n, p=weights / weights.sum())
    ins = np.array([p.input_len for p in mix], dtype=np.int64)[pick]
    outs = np.array([p.output_len for p in mix], dtype=np.int64)[pick]
    return ins, outs


def _lengths(config: LoadTestConfig, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if config.length_mix:
        return sample_pairs(config.length_mix, n, rng)
    ind = config.input_dist or LengthDist("fixed", config.random_input_len)
    outd = config.output_dist or LengthDist("fixed", config.random_output_len)
    return sample_lengths(ind, n, rng), sample_lengths(outd, n, rng)


def synthetic(config: LoadTestConfig, n: int, builder: PromptBuilder) -> list[RequestSpec]:
    """n synthetic requests, reproducible from config.seed."""
    rng = np.random.default_rng(config.seed)
    ins, outs = _lengths(config, n, rng)
    words = rng if config.content_seed is None else np.random.default_rng([config.content_seed, 1])
    specs = []
    for i, o in zip(ins.tolist(), outs.tolist()):
        # Exact with a tokenizer; without one the words are about one token each, so the target
        # is the best estimate we have.
        specs.append(RequestSpec(builder.build(i, words), i, o))
    return specs


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LoadTestError(f"{path}:{lineno}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LoadTestError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise LoadTestError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append((lineno, row))
    if not rows:
        raise LoadTestError(f"{path}: no requests in the file")
    return rows


def _prompt_of(path: Path, lineno: int, row: dict) -> tuple[str, tuple[dict, ...] | None]:
    if isinstance(row.get("prompt"), str):
        return row["prompt"], None
    if isinstance(row.get("text"), str):
        return row["text"], None
    if isinstance(row.get("messages"), list):
        msgs = tuple(row["messages"])
        if not all(isinstance(m, dict) for m in msgs):
            raise LoadTestError(f"{path}:{lineno}: messages must be a list of objects")
        return "\n".join(str(m.get("content", "")) for m in msgs), msgs
    if isinstance(row.get("conversations"), list):  # ShareGPT: the first human turn
        for turn in row["conversations"]:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                return str(turn.get("value", "")), None
    raise LoadTestError(f"{path}:{lineno}: needs one of {', '.join(_PROMPT_KEYS)} with a prompt")


def from_dataset(config: LoadTestConfig, n: int, builder: PromptBuilder) -> list[RequestSpec]:
    """n requests from a JSONL prompt file, in file order, wrapping around when n exceeds it.
    Output lengths come from the row (output_len / output_tokens / max_tokens) or the output
    distribution."""
    rows = _read_jsonl(config.dataset)
    _, default_outs = _lengths(config, len(rows), np.random.default_rng(config.seed))
    parsed = []
    for k, (lineno, row) in enumerate(rows):
        prompt, messages = _prompt_of(config.dataset, lineno, row)
        if not prompt:  # a server rejects it, or the run measures requests of no input at all
            raise LoadTestError(f"{config.dataset}:{lineno}: the prompt is empty")
        out = next((row[key] for key in _OUTPUT_KEYS if key in row), int(default_outs[k]))
        if not isinstance(out, int) or out < 1:
            raise LoadTestError(
                f"{config.dataset}:{lineno}: output length must be an integer >= 1, got {out!r}"
            )
        parsed.append(RequestSpec(prompt, builder.count(prompt), out, messages))
    return [parsed[i % len(parsed)] for i in range(n)]


def from_trace(
    config: LoadTestConfig, builder: PromptBuilder, limit: int | None
) -> tuple[np.ndarray, list[RequestSpec]]:
    """Due times (s from the first row, times time_scale) and requests of a JSONL trace, sorted by
    time; at most `limit` rows, all due before config.duration when it is given. Rows: `timestamp` (s) or `timestamp_ms`, `input_length`,
    `output_length`, and optionally `prompt` (else a synthetic prompt of input_length tokens)."""
    rows = _read_jsonl(config.trace)
    rng = np.random.default_rng(config.seed)
    items = []
    for lineno, row in rows:
        key = "timestamp" if "timestamp" in row else "timestamp_ms"
        t = row.get(key)
        # NaN would sort anywhere and schedule nonsense; bool is an int to Python but not a time
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise LoadTestError(f"{config.trace}:{lineno}: needs a finite numeric timestamp (s) or timestamp_ms, "
                                f"got {key} {t!r}")
        t = t / 1000.0 if key == "timestamp_ms" else t
        in_len = row.get("input_length", row.get("input_len"))
        out_len = row.get("output_length", row.get("output_len"))
        if not (isinstance(out_len, int) and out_len >= 1):
            raise LoadTestError(f"{config.trace}:{lineno}: output_length must be an integer >= 1")
        if isinstance(row.get("prompt"), str):
            if not row["prompt"]:
                raise LoadTestError(f"{config.trace}:{lineno}: prompt is empty")
            items.append((float(t), lineno, row["prompt"], None, out_len))
        elif isinstance(in_len, int) and in_len >= 1:
            items.append((float(t), lineno, None, in_len, out_len))
        else:
            raise LoadTestError(f"{config.trace}:{lineno}: needs a prompt or an input_length >= 1")
    items.sort(key=lambda it: (it[0], it[1]))
    t0 = items[0][0]
    if config.duration is not None:
        items = [it for it in items if (it[0] - t0) * config.time_scale < config.duration]
    items = items[:limit] if limit is not None else items
    times = np.array([(it[0] - t0) * config.time_scale for it in items])
    specs = []
    for _, _, prompt, in_len, out_len in items:
        if prompt is None:
            specs.append(RequestSpec(builder.build(in_len, rng), in_len, out_len))
        else:
            specs.append(RequestSpec(prompt, builder.count(prompt), out_len))
    return times, specs
