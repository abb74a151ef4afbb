"""Byte-level BPE training with the `tokenizers` library.

The tokenizer starts from the 256 byte symbols, so any text encodes; `<|endoftext|>` separates
documents in the token stream and is the model's BOS and EOS. Encoding a prompt with
`add_special_tokens=True` (what the engine does) prepends it, so a prompt starts the way every
training document does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from training.corpus import CorpusError

EOS_TOKEN = "<|endoftext|>"
BYTE_ALPHABET = 256


def min_vocab_size(special_tokens: tuple[str, ...] = (EOS_TOKEN,)) -> int:
    return BYTE_ALPHABET + len(special_tokens)


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...] = (EOS_TOKEN,),
              min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` with at most `vocab_size` entries.

    Deterministic for the same texts in the same order. A small corpus may stop short of
    `vocab_size` (no pair left to merge); the model's vocabulary follows the tokenizer's.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    lowest = min_vocab_size(special_tokens)
    if vocab_size < lowest:
        raise CorpusError(f"vocab_size: must be >= {lowest} ({BYTE_ALPHABET} byte symbols + "
                          f"{len(special_tokens)} special token(s)), got {vocab_size}")
    if vocab_size > 2**32:
        raise CorpusError(f"vocab_size: must be < 2**32, got {vocab_size}")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    bos = special_tokens[0]
    tk.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tk.token_to_id(bos))])
    return tk


def save_tokenizer(tk, out_dir: Path, model_max_length: int = 1024) -> None:
    """tokenizer.json plus the tokenizer_config.json that transformers and the engine read."""
    tk.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN,
              "unk_token": None, "model_max_length": model_max_length, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
