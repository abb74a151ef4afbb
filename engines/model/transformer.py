"""The GPT model: one plain definition for the GPT-2 family and the Llama family with its relatives
(Qwen2: qkv biases; Qwen3: per-head q/k RMSNorm; Mistral; rope scaling in engines/model/rope.py).

Training calls `model(idx)` on a (B, T) batch with causal attention. The engine calls it on one
flattened "varlen" row of tokens from many sequences, passing an attention backend that reads
and writes the paged KV cache (engines/model/attention.py). Parallelism and quantization are
transformations applied to a built model elsewhere; nothing of them lives here.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engines.core.config import ModelConfig
from engines.cpu import module_ops
from engines.model.dense_attention import causal_attention
from engines.model.rope import inv_freq as rope_frequencies


def _dropout(p: float) -> nn.Module:
    """Dropout, or nothing at all when p is 0 (an inference step then skips ~4 calls per layer)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class AttentionBackend(Protocol):
    """Attention over cached context: q (N, nh, hd), k/v (N, nkv, hd) -> (N, nh, hd)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if module_ops.applies(x) and x.dtype == self.weight.dtype:  # the same steps in one pass a row
            return module_ops.rms_norm(x, self.weight, self.eps)
        # normalise in fp32 as the reference does, then scale in the model dtype
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * y


def rope_cache(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (*positions.shape, hd/2) in fp32, for the rotate-half convention (scaled as
    the config's rope type asks: engines/model/rope.py)."""
    inv_freq, scale = rope_frequencies(cfg, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., hd/2)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """x (B, T, h, hd); cos/sin (B, T, hd/2). Rotate-half form, as in transformers' Llama. inplace: x may be
    rotated in place (on CPU at inference through engines/cpu/module_ops.py, the same bits)."""
    if inplace and module_ops.rope_(x, cos, sin):
        return x
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_head, self.n_kv_head, self.hd = cfg.n_head, cfg.kv_heads, cfg.hd
        self.uses_rope = cfg.uses_rope
        self.dropout = cfg.dropout
        # fused q, k, v: rows [0, nh*hd) are q, then nkv*hd of k, then nkv*hd of v
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.hd, bias=cfg.bias or cfg.qkv_bias)
        # Qwen3: each head's q and k RMS-normalised over hd before the rotary embedding
        self.q_norm = RMSNorm(cfg.hd, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.hd, cfg.norm_eps) if cfg.qk_norm else None
        self.proj = nn.Linear(cfg.n_head * cfg.hd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = _dropout(cfg.dropout)
        self.kv_hook = None
        """Training of p-tuned tasks of every layer (training/ptune.py): (layer, k, v) -> (k, v), with
        k/v (B, T, nkv, hd) after rotary embedding, as the engine's backend sees them. None here."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                backend: AttentionBackend | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output (B, T, C), plus residual when given (at inference in the projection's kernel)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.hd, self.n_kv_head * self.hd, self.n_kv_head * self.hd], dim=-1)
        q = q.view(B, T, self.n_head, self.hd)  # (B, T, nh, hd)
        k = k.view(B, T, self.n_kv_head, self.hd)  # (B, T, nkv, hd)
        v = v.view(B, T, self.n_kv_head, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            # in place: q and k are views of this call's own qkv output (or the norms' fresh tensors)
            q, k = apply_rope(q, *rope, inplace=True), apply_rope(k, *rope, inplace=True)
        if self.kv_hook is not None:
            k, v = self.kv_hook(self.layer, k, v)
        if backend is None:
            y = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hd)
            y = y.transpose(1, 2)  # (B, T, nh, hd)
        else:
            y = backend(self.layer, q.view(T, self.n_head, self.hd), k.view(T, self.n_kv_head, self.hd),
                        v.view(T, self.n_kv_head, self.hd))  # (T, nh, hd); the engine runs B == 1
        return _project(self.proj, self.resid_drop, y.reshape(B, T, self.n_head * self.hd), residual, self.training)


def _project(layer: nn.Module, drop: nn.Module, y: torch.Tensor, residual: torch.Tensor | None,
             training: bool) -> torch.Tensor:
    """drop(layer(y)), plus residual when given: at inference on CPU the sum in the Linear's kernel
    (module_ops.linear_add, the same bits as the add)."""
    if residual is None:
        return drop(layer(y))
    if not training and module_ops.applies(y):
        return module_ops.linear_add(layer, y, residual)
    return residual + drop(layer(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.activation == "silu"
        # SwiGLU fuses gate and up: rows [0, ffn) are the gate, [ffn, 2*ffn) the up projection
        self.up = nn.Linear(cfg.n_embd, cfg.ffn_dim * (2 if self.gated else 1), bias=cfg.bias and not self.gated)
        self.down = nn.Linear(cfg.ffn_dim, cfg.n_embd, bias=cfg.bias and not self.gated)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.drop = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output (..., C), plus residual when given (at inference in the down projection's kernel)."""
        if self.gated and module_ops.applies(x):  # the same steps in one pass a row (in the Linear's store)
            h = module_ops.linear_swiglu(self.up, x)
        elif self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.approximate == "tanh" and module_ops.applies(x):  # csrc/mlp_rows.cpp's GELU (in the Linear's store)
            h = module_ops.linear_gelu(self.up, x)
        else:
            h = F.gelu(self.up(x), approximate=self.approximate)
        return _project(self.down, self.drop, h, residual, self.training)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        norm = (lambda: RMSNorm(cfg.n_embd, cfg.norm_eps)) if cfg.uses_rope else (
            lambda: nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps))
        self.norm1, self.attn = norm(), Attention(cfg, layer)
        self.norm2, self.mlp = norm(), MLP(cfg)

    def forward(self, x, rope, backend):
        x = self.attn(self.norm1(x), rope, backend, residual=x)  # x + attn(norm1(x))
        return self.mlp(self.norm2(x), residual=x)  # x + mlp(norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.n_embd) if not cfg.uses_rope else None
        self.drop = _dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.n_embd, cfg.norm_eps) if cfg.uses_rope else nn.LayerNorm(
            cfg.n_embd, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def init_weights(self, seed: int | None = None) -> GPT:
        """GPT-2 style initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if p.dim() == 1:  # norm scales to 1, biases to 0
                nn.init.ones_(p) if "norm" in name.split(".")[-2] and name.endswith("weight") else nn.init.zeros_(p)
            else:
                std = 0.02 / (2 * self.cfg.n_layer) ** 0.5 if name.endswith(("proj.weight", "down.weight")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                backend: AttentionBackend | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> hidden states (B, T, C) after the final norm.

        positions (B, T) default to 0..T-1; the engine passes the tokens' absolute positions
        together with a paged-attention backend. inputs_embeds (B, T, C), when given, replaces
        the token-embedding lookup (p-tuning's virtual tokens).
        """
        B, T = idx.shape
        if positions is None:
            positions = torch.arange(T, device=idx.device).expand(B, T)
        x = self.wte(idx) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(positions)
        else:
            rope = rope_cache(self.cfg, positions)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope, backend)
        return self.norm_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., C) -> logits (..., vocab) in fp32 (unrounded where the head computes them so: a CPU inference
        head's forward_float, engines/cpu/fast_linear.py)."""
        return head_logits(self.lm_head, hidden)


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A vocabulary head's logits of hidden in fp32: its forward_float where it has one, else its output widened."""
    f = getattr(head, "forward_float", None)
    return f(hidden) if f is not None else head(hidden).float()
