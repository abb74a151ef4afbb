"""Can a free prefix steer this base model at all? An independent check of p-tuning quality.

Trains 16 free prefix vectors (no encoder, not our trainer: transformers' own GPT-2 forward with
inputs_embeds, Adam lr 0.1, 100 steps of 16 examples) so that a frozen MODEL answers a constant
`--answer` after random word inputs, and prints the answer loss per token. A base that cannot be
steered to a constant answer cannot meet the p-tuning quality targets, whatever the recipe.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ptune_prefix_probe.py --model models/default
"""

from __future__ import annotations

import argparse
import random

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

WORDS = ["king", "queen", "love", "war", "sword", "heart", "night", "fair", "lord", "lady", "death", "blood"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--answer", default=" HAMLET.")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    m = AutoModelForCausalLM.from_pretrained(args.model).eval()
    m.requires_grad_(False)
    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    ans = tok.encode(args.answer, add_special_tokens=False).ids
    emb = m.get_input_embeddings().weight
    n = 16
    prefix = torch.nn.Parameter(emb[torch.randint(100, 5000, (n,))].clone())
    opt = torch.optim.Adam([prefix], lr=0.1)
    for step in range(args.steps):
        loss = 0.0
        for _ in range(16):
            ids = tok.encode(" ".join(rng.choices(WORDS, k=6))).ids + ans
            x = torch.cat([prefix, emb[torch.tensor(ids)]], 0)[None]
            logits = m(inputs_embeds=x).logits[0]
            pred = logits[n + len(ids) - len(ans) - 1: n + len(ids) - 1]  # the positions that predict the answer
            loss = loss + torch.nn.functional.cross_entropy(pred, torch.tensor(ans)) / 16
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step}: answer loss {loss.item():.3f} nats/token ({len(ans)} answer tokens)", flush=True)


if __name__ == "__main__":
    main()
