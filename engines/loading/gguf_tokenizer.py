"""A `tokenizers` tokenizer (and its tokenizer_config.json) from a GGUF file's metadata.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, merges, token types and
special-token ids as metadata. This module rebuilds the tokenizer that transformers builds from
the same metadata (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so token ids agree:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The pre-tokenizer is GPT-2's byte-level
  regex, or for the vocabularies llama.cpp names in `tokenizer.ggml.pre` (llama3, qwen2, ...)
  that family's split regex followed by the byte-level mapping.
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE with byte fallback, `▁` for spaces,
  a `▁` prepended to the first word, merges from the file or derived from the token scores.

Tokens of type CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens.
Only `tokenizers` is imported here; the metadata dict comes from engines/loading/gguf_import.py.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex (the names llama.cpp writes); others use GPT-2's regex.
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


class GGUFTokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing a field or names an unsupported tokenizer."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _field(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFTokenizerError(f"GGUF metadata: missing tokenizer field {key!r}")
    return meta[key]


def _merges(meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        return [tuple(m.split(" ", 1)) for m in merges]
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise GGUFTokenizerError("GGUF metadata: tokenizer has neither 'tokenizer.ggml.merges' nor "
                                 "'tokenizer.ggml.scores'")
    # SentencePiece BPE: every split of a token into two vocabulary pieces is a merge, ranked by
    # the token's score (higher first), as transformers' generate_merges does.
    ranked = []
    for tok, score in zip(meta["tokenizer.ggml.tokens"], scores):
        local = [(tok[:i], tok[i:], score) for i in range(1, len(tok)) if tok[:i] in vocab and tok[i:] in vocab]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        ranked.extend(local)
    ranked.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in ranked]


def _byte_level(meta: dict[str, Any]) -> Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(_field(meta, "tokenizer.ggml.tokens")):
        # tokens outside the byte alphabet (mislabelled specials) are respelled byte by byte
        key = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab[key] = i
    tk = Tokenizer(BPE(vocab=vocab, merges=_merges(meta, vocab), dropout=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    return tk


def _sentencepiece(meta: dict[str, Any]) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(_field(meta, "tokenizer.ggml.tokens"))}
    tk = Tokenizer(BPE(vocab=vocab, merges=_merges(meta, vocab), fuse_unk=True, byte_fallback=True, dropout=None))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(content=" ", left=1)])
    return tk


def _token(tokens: list[str], meta: dict[str, Any], key: str) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}")
    if idx is None:
        return None
    if not 0 <= int(idx) < len(tokens):
        raise GGUFTokenizerError(f"GGUF metadata: tokenizer.ggml.{key}={idx} is outside the vocabulary "
                                 f"(0..{len(tokens) - 1})")
    return tokens[int(idx)]


def build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(tokenizer, tokenizer_config dict) from GGUF metadata (key -> decoded value).

    The config holds the special tokens by text, `add_bos_token` and the chat template, in
    transformers' tokenizer_config.json format.
    """
    kind = _field(meta, "tokenizer.ggml.model")
    if kind == "gpt2":
        tk = _byte_level(meta)
        add_bos_default = False
    elif kind == "llama":
        tk = _sentencepiece(meta)
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise
    else:
        raise GGUFTokenizerError(f"GGUF metadata: tokenizer.ggml.model {kind!r} unsupported; "
                                 "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or ()
    alphabet = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
    specials = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    if specials:
        tk.add_special_tokens(specials)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        tk.add_tokens(user)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = _token(tokens, meta, "bos_token_id"), _token(tokens, meta, "eos_token_id")
    single, special_ids = ["$A"], []
    if add_bos and bos is not None:
        single = [bos, *single]
        special_ids.append((bos, tokens.index(bos)))
    if add_eos and eos is not None:
        single = [*single, eos]
        special_ids.append((eos, tokens.index(eos)))
    tk.post_processor = processors.TemplateProcessing(
        single=single, pair=[*single, *[s if s != "$A" else "$B:1" for s in single]], special_tokens=special_ids)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": _token(tokens, meta, "unknown_token_id"),
        "pad_token": _token(tokens, meta, "padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("context_length") or 0) or 1 << 30,
    }
    if template := meta.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return tk, {k: v for k, v in config.items() if v is not None}
