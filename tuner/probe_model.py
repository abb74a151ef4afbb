"""Random-weight checkpoints of a given shape, for timing (profiles, validation runs, benchmarks).

Timing does not depend on the weights' values: a checkpoint of the right shape with random
weights and a small byte-level BPE tokenizer is served and load-tested exactly like a trained
one when requests ask for a fixed number of tokens (ignore_eos).
"""

from __future__ import annotations

import json
from pathlib import Path

from engines.config import ModelConfig

_CORPUS = ("the quick brown fox jumps over the lazy dog while shardserve serves many requests at once; "
           "tokens stream back one step at a time and the tuner predicts how long each step takes. ") * 40


def write_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """A byte-level BPE tokenizer trained on a fixed text; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([_CORPUS], trainer)
    tk.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                               "bos_token": "<|endoftext|>"}))
    return tk.get_vocab_size()


def write_random_checkpoint(out_dir: str | Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """Write `cfg` with random weights (and a tokenizer whose ids fit the vocabulary) to out_dir."""
    import torch

    from engines.checkpoint import save_checkpoint
    from engines.model import GPT

    out = Path(out_dir)
    tok_dir = out.parent / f".{out.name}.tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(tok_dir, vocab_size=min(512, cfg.vocab_size))
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    save_checkpoint(model, cfg, out, tokenizer_dir=tok_dir)
    return out


def gpt2_shape(n_layer: int, n_head: int, n_embd: int, vocab_size: int = 512, positions: int = 512) -> ModelConfig:
    """A GPT-2-family config of the given shape (eos/bos 0, as the tokenizer's first token)."""
    return ModelConfig(model_type="gpt2", vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                       max_position_embeddings=positions, bos_token_id=0, eos_token_id=(0,))
