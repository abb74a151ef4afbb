"""Tokenizer of a checkpoint directory (`tokenizer.json`, in the `tokenizers` format)."""

from __future__ import annotations

import json
import os
import re
from collections import deque
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, tk: HFTokenizer, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self._is_byte_level: bool | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it has no tokenizer.json."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ValueError(f"tokenizer.json: cannot be read ({exc})") from exc
        template = bos = eos = None
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                tc = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"tokenizer_config.json: not valid JSON ({exc})") from exc
            template = tc.get("chat_template")
            bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        jinja = d / "chat_template.jinja"  # transformers >= 4.43 writes the template beside the config
        if jinja.is_file():
            template = jinja.read_text()
        return cls(tk, template, bos, eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, which clients join to rebuild text (OpenAI's logprob `bytes`).

        A token holding part of a UTF-8 character decodes alone to U+FFFD; its bytes come from the
        vocabulary instead: `<0xE2>` pieces (byte fallback) or the byte-to-character table of
        byte-level BPE (GPT-2's `Ġ` for a space).
        """
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.id_to_token(token_id) or ""
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if self._byte_level() and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode()

    def _byte_level(self) -> bool:
        if self._is_byte_level is None:
            decoder = json.loads(self.tk.to_str()).get("decoder") or {}
            kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
            self._is_byte_level = "ByteLevel" in kinds
        return self._is_byte_level

    def token_id(self, text: str | None) -> int | None:
        return self.tk.token_to_id(text) if text else None

    def detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self, prompt_ids, skip_special_tokens)


class Detokenizer:
    """Text of generated tokens, emitted only as whole UTF-8 characters.

    The decode stream is primed with the prompt's tail so that tokenizers whose decoding depends
    on the left context (SentencePiece's leading space) produce the right text. Tokens that end in
    an incomplete UTF-8 character are held back until a later token completes it; `flush` gives
    what is still held when the sequence ends (a stray byte becomes U+FFFD, as `decode` gives it).
    """

    CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._held: list[int] = []
        self._prime(prompt_ids)

    def _prime(self, ids: list[int]) -> None:
        # Text ending inside a UTF-8 character would prime the stream with a trailing U+FFFD, and
        # DecodeStream then repeats the whole primer in its first piece: leave those ids out.
        primer = list(ids[-2 * self.CONTEXT:])
        while primer and self.tokenizer.decode(primer, self.skip_special_tokens).endswith("\ufffd"):
            primer.pop()
        self._context = deque(primer[-self.CONTEXT:], maxlen=self.CONTEXT)  # ids before the held-back ones
        self.stream = DecodeStream(ids=list(self._context), skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        piece = self.stream.step(self.tokenizer.tk, token_id)
        self._held.append(token_id)
        if not piece:
            return ""
        self._context.extend(self._held)
        self._held.clear()
        return piece

    def flush(self) -> str:
        """The text of the held-back tokens, incomplete characters and all; "" if none are held."""
        if not self._held:
            return ""
        ids = [*self._context, *self._held]
        before = self.tokenizer.decode(list(self._context), self.skip_special_tokens)
        after = self.tokenizer.decode(ids, self.skip_special_tokens)
        self._prime(ids)
        self._held.clear()
        return after[len(os.path.commonprefix([before, after])):]


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's table (GPT-2): printable bytes stand for themselves, the other 68 for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF_CHAR = _byte_of_char()


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
