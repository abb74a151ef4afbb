"""Synthetic prompts of a given length in tokens, and token counting.

With a `tokenizer.json` (the `tokenizers` library, no transformers) lengths are exact: random
vocabulary tokens are decoded to text, the text is re-encoded, and tokens are trimmed or added until
the re-encoded length is exactly the target. Lengths count the prompt's own tokens
(`add_special_tokens=False`); a BOS the server adds, or a chat template, comes on top.

Without a tokenizer lengths are approximate: prompts are common short English words, about one
token each in GPT-2 / LLaMA style BPE vocabularies, and counts are estimated as characters / 4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loadtest.errors import LoadTestError

# Short, frequent words: each is a single token (with its leading space) in common BPE vocabularies.
_WORDS = (  # noqa: SIM905 (a word list reads best as text)
    "the of and to in is was for on that with as by at from his it an were are which be this had not "
    "or but her one all she there been they have has their who its first new after would more two "
    "time also when into only some other year can out may over such most made many used these then "
    "them city him about world where film during under known well game since last three being part "
    "between school both same each high early much life both work while area back city good name way"
).split()
_ATTEMPTS = 8  # fresh random starts before giving up on an exact length
_ROUNDS = 64  # trim/extend rounds per start; BPE merges at the seams usually settle in 1-3


class PromptBuilder:
    """Builds prompts of a target token length and counts tokens; `exact` says which mode."""

    def __init__(self, tokenizer_path: Path | None = None) -> None:
        self.exact = tokenizer_path is not None
        self._tok = None
        self._candidates = np.array([], dtype=np.int64)
        self.tokenizer_path = tokenizer_path
        if tokenizer_path is not None:
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_file(str(tokenizer_path))
            except Exception as exc:  # the library raises a bare Exception on a malformed file
                raise LoadTestError(f"cannot load tokenizer {tokenizer_path}: {exc}") from exc
            self._candidates = self._single_token_ids()

    def _single_token_ids(self) -> np.ndarray:
        """Vocabulary ids whose text is printable and re-encodes to exactly that one id."""
        tok = self._tok
        special = {t.content for t in tok.get_added_tokens_decoder().values()}
        ids = [i for t, i in tok.get_vocab().items() if t not in special]
        rng = np.random.default_rng(0)
        rng.shuffle(ids)
        keep = []
        for i in ids[:8000]:  # a random sample is plenty and keeps start-up fast on 100k+ vocabularies
            text = tok.decode([i])
            if text.strip() and text.isprintable() and tok.encode(text, add_special_tokens=False).ids == [i]:
                keep.append(i)
        if len(keep) < 16:
            raise LoadTestError(
                f"tokenizer {self.tokenizer_path} has too few plain-text tokens to build prompts"
            )
        return np.array(keep, dtype=np.int64)

    def count(self, text: str) -> int:
        """Tokens in `text`: exact with a tokenizer, else characters / 4 (at least 1 for non-empty)."""
        if self._tok is not None:
            return len(self._tok.encode(text, add_special_tokens=False).ids)
        return max(1, round(len(text) / 4)) if text else 0

    def build(self, n_tokens: int, rng: np.random.Generator) -> str:
        """A random prompt of `n_tokens` tokens (exactly, with a tokenizer)."""
        if self._tok is None:
            return " ".join(rng.choice(_WORDS, size=n_tokens))
        for _ in range(_ATTEMPTS):
            text = self._exact(n_tokens, rng)
            if text is not None:
                return text
        raise LoadTestError(
            f"could not build a prompt of exactly {n_tokens} tokens with {self.tokenizer_path}"
        )

    def _exact(self, n: int, rng: np.random.Generator) -> str | None:
        tok = self._tok
        ids = rng.choice(self._candidates, size=n).tolist()
        for _ in range(_ROUNDS):
            text = tok.decode(ids)
            got = tok.encode(text, add_special_tokens=False).ids
            if len(got) == n:
                return text
            # Decoding then encoding can merge or split tokens at the seams: trim the re-encoded ids,
            # or add fresh tokens, and try again.
            ids = got[:n] if len(got) > n else got + rng.choice(self._candidates, size=n - len(got)).tolist()
        return None
