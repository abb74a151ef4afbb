"""Structured output: a per-request grammar (JSON, or JSON constrained by a schema) compiled with
xgrammar, a matcher per sequence, and the batch's token bitmask.

xgrammar is imported lazily, only when a request has a grammar, so engines/ still runs with torch
alone and unconstrained requests pay nothing. JSON is generated compact (no free whitespace
between tokens): with free whitespace a weak model may emit spaces until max_tokens, which vLLM
allows by default and we do not (the text is still valid JSON either way). json_object is the
schema {"type": "object"} (OpenAI: "a JSON object"), not any JSON value.

xgrammar 0.2.8 lets a string with minLength / maxLength hold raw control characters (U+0000 to
U+001F), which JSON forbids (json.loads refuses them): the converted grammar's character class is
narrowed here (`_ebnf`) before it is compiled.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

KINDS = ("json_object", "json_schema")
JSON_OBJECT = '{"type": "object"}'
_LOOSE_CHAR = r'[^\"\\\r\n]'  # a length-bounded string's character, as xgrammar writes it
_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'  # the same without the control characters JSON forbids
CACHE_SIZE = 64
"""Compiled grammars kept per worker (least recently used dropped first)."""


def _xgr():
    import xgrammar  # lazily: only a request with a grammar needs it

    return xgrammar


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be: any JSON object (json_object), or JSON valid against
    `schema` (json_schema; a compact JSON text, so equal schemas share a grammar). Its keys keep the caller's order:
    the grammar writes an object's properties in the order the schema lists them, as OpenAI's and vLLM's do, and
    callers rely on it (a "reasoning" field before the "answer" it leads to)."""

    kind: str
    schema: str | None = None
    param: str = field(default="structured_output", compare=False)
    """The request field the constraint came from, named in errors (response_format.json_schema...)."""

    @staticmethod
    def json_schema(schema: dict[str, Any], param: str) -> StructuredOutput:
        return StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)

    @property
    def key(self) -> tuple[str, str | None]:
        return self.kind, self.schema


def check(spec: Any) -> str | None:
    """None when `spec` is a StructuredOutput that xgrammar can compile, else why not (a sentence)."""
    if not isinstance(spec, StructuredOutput):
        return "must be an engines.runner.grammar.StructuredOutput"
    if spec.kind not in KINDS:
        return f"kind must be one of {', '.join(KINDS)}, got {spec.kind!r}"
    if spec.kind == "json_object":
        return None if spec.schema is None else "json_object takes no schema"
    if not isinstance(spec.schema, str):
        return "json_schema needs a schema (a JSON text)"
    return _schema_problem(spec.schema)


@lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str | None:
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(parsed, (dict, bool)):
        return f"a JSON schema is an object (or true / false), got {type(parsed).__name__}"
    try:
        _xgr().Grammar.from_ebnf(_ebnf(schema))
    except RecursionError:
        return "the grammar compiler refused it: nested too deeply"
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own types
        why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())  # drop xgrammar's "[time] file.cc:N: "
        return f"the grammar compiler refused it: {why or type(exc).__name__}"
    return None


def _ebnf(schema: str) -> str:
    """The EBNF grammar of JSON valid against `schema`, compact, strings free of control characters."""
    text = str(_xgr().Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_LOOSE_CHAR, _JSON_CHAR)


class Grammars:
    """A worker's grammar compiler (built on first use from the model's tokenizer) and its cache
    of compiled grammars, keyed by the constraint."""

    def __init__(self, token_bytes: Callable[[], list[bytes]], vocab_size: int):
        """token_bytes: called once, on first use: each token id's bytes (b"" for special tokens,
        which a grammar never allows; ids past the tokenizer's, up to vocab_size, are special too)."""
        self._token_bytes = token_bytes
        self.vocab_size = vocab_size
        self._compiler = None
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()  # the mask thread and the step thread both may compile

    def _compiler_for(self):
        if self._compiler is None:
            xgr = _xgr()
            vocab = self._token_bytes()
            vocab = vocab + [b""] * (self.vocab_size - len(vocab))
            info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compiled(self, spec: StructuredOutput):
        with self._lock:
            hit = self._compiled.get(spec.key)
            if hit is not None:
                self._compiled.move_to_end(spec.key)
                return hit
            comp = self._compiler_for()
            grammar = comp.compile_grammar(_ebnf(JSON_OBJECT if spec.kind == "json_object" else spec.schema))
            self._compiled[spec.key] = grammar
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return grammar

    def matcher(self, spec: StructuredOutput, stop_token_ids: tuple[int, ...]):
        """A fresh matcher for one sequence; the grammar ends only with one of stop_token_ids."""
        return _xgr().GrammarMatcher(self.compiled(spec), override_stop_tokens=list(stop_token_ids) or None)

    def bitmask(self, rows: int):
        """(rows, ceil(vocab / 32)) int32, every token allowed."""
        return _xgr().allocate_token_bitmask(rows, self.vocab_size)


def apply_bitmask(logits, bitmask, rows: list[int]) -> None:
    """Set to -inf, in place, the logits (S, V) of tokens the bitmask (S, V/32) forbids, in `rows` only."""
    _xgr().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1],
                                       indices=rows)


def tokenizer_bytes(model_dir) -> Callable[[], list[bytes]]:
    """A loader of the vocabulary's token bytes from the checkpoint's tokenizer.json (for Grammars)."""

    def load() -> list[bytes]:
        from engines.loading.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(model_dir)
        if tok is None:
            raise ValueError("structured output needs the model's tokenizer.json")
        special = {i for i, t in tok.tk.get_added_tokens_decoder().items() if t.special}
        return [b"" if i in special else tok.token_bytes(i) for i in range(tok.vocab_size)]

    return load
