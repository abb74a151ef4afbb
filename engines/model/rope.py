"""Rotary position embeddings: inverse frequencies and the cos/sin scale, as pure functions of the
model config (the rope types real checkpoints use; formulas as transformers' modeling_rope_utils).

- default: inv_freq[i] = theta^(-2i/hd).
- linear: positions interpolated by `factor` (inv_freq / factor).
- dynamic (NTK): transformers rescales theta only once a sequence is longer than
  max_position_embeddings; the engine serves at most max_position_embeddings positions, where
  dynamic equals default (so tokens equal transformers' for every sequence the engine accepts).
- llama3: Llama 3.1's piecewise rescaling of low / medium / high frequencies.
- yarn: NTK-by-parts blend of interpolated and extrapolated frequencies, with cos/sin scaled by
  an attention factor (0.1 ln(factor) + 1 unless the config gives one).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _base_inv_freq(theta: float, hd: int, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))  # (hd/2,)


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)  # long wavelengths: interpolated
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, hd: int, p: dict[str, Any], max_pos: int, device) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (hd * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(hd // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by factor
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


def inv_freq(cfg, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (hd/2,) fp32, cos/sin scale) of a rotary model config."""
    p = dict(cfg.rope_scaling)
    kind = p.get("rope_type", "default")
    if kind == "yarn":
        return _yarn(cfg.rope_theta, cfg.hd, p, cfg.max_position_embeddings, device)
    inv = _base_inv_freq(cfg.rope_theta, cfg.hd, device)
    if kind == "linear":
        inv = inv / p["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, p)
    return inv, 1.0  # default, dynamic (within max_position_embeddings)


REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("original_max_position_embeddings",)}
"""Keys each rope type needs in config.json's rope_scaling / rope_parameters."""
