"""Is the keyword-classification label in the frozen base at all? A linear probe (diagnostic only).

For every labelled validation line (love/heart vs war/sword/blood, the classes of bench_ptune.py),
runs the frozen MODEL once on the keyword task's prompt and fits an L2-regularised logistic
regression, with stratified k-fold cross-validation (every line is scored by a probe that never saw
it), on three features:

- last: the final hidden state (after the final norm) at the prompt's last position, the one that
  predicts the label token; what p-tuning has to turn into " love" / " war";
- mean: the final hidden states averaged over the prompt (is the keyword anywhere in the output?);
- embed: the input token embeddings averaged (a bag of words; the lexical ceiling).

Prints per-class and balanced accuracy with a 95% Wilson interval. Not the deliverable: p-tuning can
only move the prompt's last position through attention to its virtual tokens.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ptune_keyword_probe.py --model models/default
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch

from benchmarks.bench_ptune import LOVE, TEMPLATE, WAR, val_lines
from engines.checkpoint import load_model
from engines.tokenizer import Tokenizer


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


@torch.no_grad()
def features(model, tok: Tokenizer, lines: list[str], template: str) -> dict[str, torch.Tensor]:
    last, mean, emb = [], [], []
    for ln in lines:
        ids = torch.tensor([tok.encode(template.replace("{input}", ln))])
        h = model(ids)[0].float()  # (T, C) after the final norm
        last.append(h[-1])
        mean.append(h.mean(0))
        emb.append(model.wte(ids)[0].float().mean(0))
    return {"last": torch.stack(last), "mean": torch.stack(mean), "embed": torch.stack(emb)}


def fit_predict(x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor, l2: float) -> torch.Tensor:
    """Class-balanced logistic regression on standardised features; predicted labels of xt."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    x, xt = (x - mu) / sd, (xt - mu) / sd
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    pos = y.float().mean()
    weight = torch.where(y == 1, 0.5 / pos, 0.5 / (1 - pos))  # each class counts half
    opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, y.float(), weight=weight)
                + l2 * w.square().sum())
        loss.backward()
        return loss

    opt.step(closure)
    return ((xt @ w + b) > 0).long()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--data", default="data/shakespeare")
    ap.add_argument("--template", default=TEMPLATE)
    ap.add_argument("--folds", type=int, default=6)
    ap.add_argument("--l2", type=float, default=1e-2)
    ap.add_argument("--fit-on", choices=("val", "train"), default="val",
                    help="val: k-fold CV within the validation lines; train: fit on the TRAIN split's labelled "
                         "lines (many more; the base has seen them) and score every validation line")
    ap.add_argument("--max-fit", type=int, default=400, help="--fit-on train: at most this many lines per class")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, _ = load_model(Path(args.model))
    model.eval()
    tok = Tokenizer.from_dir(Path(args.model))
    lines = val_lines(Path(args.data), tok)
    love = [ln for ln in lines if LOVE.search(ln) and not WAR.search(ln)]
    war = [ln for ln in lines if WAR.search(ln) and not LOVE.search(ln)]
    items = [(ln, 0) for ln in love] + [(ln, 1) for ln in war]
    if args.fit_on == "train":
        tr_lines = val_lines(Path(args.data), tok, split="train")
        tr_items = ([(ln, 0) for ln in tr_lines if LOVE.search(ln) and not WAR.search(ln)][:args.max_fit]
                    + [(ln, 1) for ln in tr_lines if WAR.search(ln) and not LOVE.search(ln)][:args.max_fit])
        tr_feats = features(model, tok, [ln for ln, _ in tr_items], args.template)
        tr_y = torch.tensor([c for _, c in tr_items])
    feats = features(model, tok, [ln for ln, _ in items], args.template)
    y = torch.tensor([c for _, c in items])
    # stratified folds: each class dealt round-robin after a seeded shuffle
    fold = torch.zeros(len(items), dtype=torch.long)
    for c in (0, 1):
        idx = [i for i, (_, k) in enumerate(items) if k == c]
        random.Random(c).shuffle(idx)
        for j, i in enumerate(idx):
            fold[i] = j % args.folds
    how = (f"fit on {int((tr_y == 0).sum())} love + {int(tr_y.sum())} war train-split lines" if args.fit_on == "train"
           else f"{args.folds}-fold CV")
    print(f"model {args.model}; {len(love)} love + {len(war)} war validation lines; {how}; l2 {args.l2}; "
          f"template {args.template!r}")
    print("| feature | love acc. | war acc. | balanced acc. (95% interval per class) |")
    print("|---|---|---|---|")
    for name, x in feats.items():
        pred = torch.zeros_like(y)
        if args.fit_on == "train":
            pred = fit_predict(tr_feats[name], tr_y, x, args.l2)
        for f in range(args.folds if args.fit_on == "val" else 0):
            tr, te = fold != f, fold == f
            pred[te] = fit_predict(x[tr], y[tr], x[te], args.l2)
        accs = []
        for c in (0, 1):
            m = y == c
            k = int((pred[m] == c).sum())
            accs.append((k, int(m.sum())))
        (kl, nl), (kw, nw) = accs
        lo_l, hi_l = wilson(kl, nl)
        lo_w, hi_w = wilson(kw, nw)
        print(f"| {name} | {kl / nl:.1%} ({kl}/{nl}) | {kw / nw:.1%} ({kw}/{nw}) | {(kl / nl + kw / nw) / 2:.1%} "
              f"(love {lo_l:.0%}-{hi_l:.0%}, war {lo_w:.0%}-{hi_w:.0%}) |")


if __name__ == "__main__":
    main()
