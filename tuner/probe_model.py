"""Random-weight checkpoints of a given shape, for timing (profiles, validation runs, benchmarks).

Timing does not depend on the weights' values: a checkpoint of the right shape with random
weights and a small byte-level BPE tokenizer is served and load-tested exactly like a trained
one when requests ask for a fixed number of tokens (ignore_eos).
"""

from __future__ import annotations

from pathlib import Path

from engines.core.config import ModelConfig

_CORPUS = ("the quick brown fox jumps over the lazy dog while shardserve serves many requests at once; "
           "tokens stream back one step at a time and the tuner predicts how long each step takes. ") * 40


def write_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """The project's byte-level BPE tokenizer (training.tokenizer) trained on a fixed text; returns
    its vocabulary size. Like every shardserve tokenizer it prepends <|endoftext|> as BOS to an
    encoded prompt, so the engine sees one token more than a load test's `random_input_len`
    (prompt_extra_tokens)."""
    from training.tokenizer import save_tokenizer, train_bpe

    tk = train_bpe([_CORPUS], vocab_size=vocab_size)
    save_tokenizer(tk, out_dir)
    return tk.get_vocab_size()


def prompt_extra_tokens(tokenizer_path: str | Path) -> int:
    """Tokens the engine adds to an encoded prompt (a BOS post-processor: 1; none: 0), which a
    load tester that counts prompts with add_special_tokens=False does not see."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tokenizer_path))
    return len(tk.encode("a", add_special_tokens=True).ids) - len(tk.encode("a", add_special_tokens=False).ids)


def text_token_share(tokenizer_path: str | Path, vocab_size: int) -> float:
    """The share of a model's `vocab_size` token ids that decode alone to text (neither empty nor
    part of a UTF-8 character): 1.0 for a tokenizer that covers the vocabulary, 231 / 8,192 for a
    random-weight probe of the default model's shape (its tokenizer has 360 entries; ids past them
    decode to nothing). The simulator needs it for TPOT as the load tester measures it
    (tuner.simulate.seen_last_times)."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tokenizer_path))
    ids = range(min(tk.get_vocab_size(), vocab_size))
    texts = (tk.decode([i], skip_special_tokens=True) for i in ids)
    return sum(1 for t in texts if t and "\ufffd" not in t) / max(vocab_size, 1)


def write_random_checkpoint(out_dir: str | Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """Write `cfg` with random weights (and a tokenizer whose ids fit the vocabulary) to out_dir."""
    import torch

    from engines.loading.checkpoint import save_checkpoint
    from engines.model.transformer import GPT
    from training.tokenizer import min_vocab_size

    if cfg.vocab_size < min_vocab_size():
        raise ValueError(f"vocab_size: a probe checkpoint needs >= {min_vocab_size()} (the byte-level tokenizer's "
                         f"256 byte symbols and <|endoftext|>), got {cfg.vocab_size}")
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
