"""The trained prompts of p-tuning: PEFT's PromptEncoder layouts (input embeddings) and a prefix of
every layer's keys/values (P-tuning v2), plus the hook that injects that prefix into the model."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class PromptEncoder(nn.Module):
    """N learned inputs -> (N, hidden) virtual-token embeddings (PEFT's PromptEncoder layouts).

    residual=True adds the input to the mlp/lstm output and zero-initialises the last layer, so
    training starts exactly at the init embeddings (a text init then means its text) and the
    reparameterisation learns a correction; PEFT's layout (residual=False) starts from the
    encoder's random output whatever the init."""

    def __init__(self, kind: str, n: int, hidden: int, enc_hidden: int, init: torch.Tensor | None = None,
                 residual: bool = False):
        super().__init__()
        self.kind, self.residual = kind, residual and kind != "embedding"
        self.embedding = nn.Embedding(n, hidden)
        if init is not None:
            with torch.no_grad():
                self.embedding.weight.copy_(init)
        h = enc_hidden or hidden
        if kind == "mlp":
            self.mlp = nn.Sequential(nn.Linear(hidden, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, hidden))
        elif kind == "lstm":
            self.lstm = nn.LSTM(hidden, h, num_layers=2, bidirectional=True, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(2 * h, 2 * h), nn.ReLU(), nn.Linear(2 * h, hidden))
        if self.residual:
            nn.init.zeros_(self.mlp[-1].weight)
            nn.init.zeros_(self.mlp[-1].bias)

    def forward(self) -> torch.Tensor:
        e = self.embedding.weight  # (N, C)
        if self.kind == "lstm":
            x = self.mlp(self.lstm(e[None])[0][0])  # (1, N, 2h) -> (N, C)
        elif self.kind == "mlp":
            x = self.mlp(e)
        else:
            return e
        return e + x if self.residual else x


class LayerPrefix(nn.Module):
    """A task of every layer (P-tuning v2): each layer's keys/values of the N virtual tokens,
    (layers, N, 2, KV heads, head_dim), trained directly.

    Inside `hooked(model, prefix.hook)`, every attention layer of the model prepends these to its
    keys/values as those of positions 0..N-1 (after rotary embedding, as the engine's backend
    injects them), so the prompt's tokens attend to them in every layer. The model then runs on the
    real tokens alone, at positions N.. (`model(ids, positions=N + arange(T))`): the virtual
    positions' hidden states would never be read, and skipping them halves a step at N ~ T."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.kv = nn.Parameter(init.clone())

    @classmethod
    def from_text(cls, model, ids: torch.Tensor) -> LayerPrefix:
        """Start from the keys/values the frozen model computes for these N tokens at positions 0..N-1."""
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(layer, k, v):
            got[layer] = (k[0].detach().float(), v[0].detach().float())
            return k, v

        with hooked(model, keep), torch.no_grad():
            model(ids[None])
        return cls(torch.stack([torch.stack(got[i]) for i in range(len(got))]).transpose(1, 2).contiguous())

    def hook(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, T, nkv, hd) of the real tokens -> (B, N + T, nkv, hd) with the prefix in front."""
        B = k.shape[0]
        pk, pv = (self.kv[layer, :, j].to(k.dtype)[None].expand(B, -1, -1, -1) for j in (0, 1))
        return torch.cat([pk, k], 1), torch.cat([pv, v], 1)

    def peft_table(self) -> torch.Tensor:
        """(N, layers * 2 * kv_width) in PEFT's PREFIX_TUNING row layout (layer 0 key, layer 0 value, ...)."""
        return self.kv.detach().permute(1, 0, 2, 3, 4).reshape(self.kv.shape[1], -1).clone()


@contextlib.contextmanager
def hooked(model, fn):
    """While open, every attention layer of `model` calls fn(layer, k, v) -> (k, v)."""
    attns = [b.attn for b in model.blocks]
    for a in attns:
        a.kv_hook = fn
    try:
        yield
    finally:
        for a in attns:
            a.kv_hook = None
