"""Searched FP8 scales (engines/transforms/fp8_scales.py, `shardserve quantize --scales search`): each row
reconstructed no worse than with round-to-nearest's absmax / 448, written in the same format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from engines.loading.checkpoint import load_model
from engines.transforms.fp8 import Fp8Linear
from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, dequantize, quantize_rows
from engines.transforms.fp8_scales import search_rows
from shardserve.cli import app


def _row_err(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (dequantize(q, s, torch.float32) - w.float()).square().sum(1)  # (out,)


def test_searched_scales_never_reconstruct_worse_than_rtn():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * 0.05
    w[:, 3] *= 8  # a loud input column, as real Linears have
    w[7] = 0.0  # an all-zero row keeps a positive scale and zero codes
    q, s = search_rows(w.bfloat16())
    q0, s0 = quantize_rows(w.bfloat16())
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.shape == (64, 1) and s.dtype == torch.float32
    assert (s > 0).all() and (s >= s0).all() and (s < 2 * s0).all()  # absmax / 448 x [1, 2): nothing clipped
    assert torch.equal(q.view(torch.uint8), (w.bfloat16().float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                       .view(torch.uint8))  # each code is the nearest on its row's scale
    e, e0 = _row_err(w.bfloat16(), q, s), _row_err(w.bfloat16(), q0, s0)
    assert (e <= e0).all() and e.sum() < 0.95 * e0.sum(), (e.sum(), e0.sum())
    assert torch.equal(q[7].float(), torch.zeros(96))
    with pytest.raises(ValueError, match="importance has 5 entries for 96 input features"):
        search_rows(w, "blocks.0.w", importance=torch.ones(5))


def test_quantize_cli_scales_search_writes_searched_scales_that_load(llama_dir, tmp_path):
    """--scales search: compressed-tensors FP8 (e4m3 + fp32 (out, 1) per channel), loads as Fp8Linear, and
    each tensor's reconstruction error is at most the default's (absmax scales, round to nearest)."""
    runner = CliRunner()
    r = runner.invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "s"), "--scales", "search"])
    assert r.exit_code == 0 and "searched scales, round to nearest" in r.output, r.output
    r = runner.invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "a")])
    assert r.exit_code == 0 and "absmax scales, round to nearest" in r.output, r.output
    qc = json.loads((tmp_path / "s" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel" and qc["ignore"] == ["lm_head"]
    less = 0
    with safe_open(tmp_path / "s" / "model.safetensors", "pt") as s, \
            safe_open(tmp_path / "a" / "model.safetensors", "pt") as a, \
            safe_open(llama_dir / "model.safetensors", "pt") as src:
        names = [k for k in s.keys() if k.endswith("_proj.weight")]
        assert names
        for k in names:
            w, q, sc = src.get_tensor(k), s.get_tensor(k), s.get_tensor(f"{k}_scale")
            assert q.dtype == FP8_DTYPE and sc.dtype == torch.float32 and sc.shape == (w.shape[0], 1)
            e, e0 = _row_err(w, q, sc), _row_err(w, a.get_tensor(k), a.get_tensor(f"{k}_scale"))
            assert (e <= e0 * (1 + 1e-6)).all(), k
            less += int(e.sum() < e0.sum())
    assert less == len(names)  # every Linear strictly better than round to nearest on this random model
    model, _ = load_model(tmp_path / "s")
    assert all(isinstance(b.attn.qkv, Fp8Linear) and isinstance(b.mlp.down, Fp8Linear) for b in model.blocks)
    bad = runner.invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "b"), "--scales", "x"])
    assert bad.exit_code == 2 and "error: --scales: 'x' is not supported; supported: absmax, search" in bad.output
    assert not (tmp_path / "b").exists()


def test_quantize_cli_keep_float_leaves_those_blocks_float_and_names_them(llama_dir, tmp_path):
    """--keep-float 0: block 0's Linears stay float (in `ignore`, as vLLM needs), the rest are the default's
    round-to-nearest codes; the file loads; an index out of range is refused by name."""
    runner = CliRunner()
    r = runner.invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "k"), "--keep-float", "0"])
    assert r.exit_code == 0 and "blocks 0 kept float" in r.output, r.output
    assert "quantized 7 Linear layers" in r.output, r.output  # 2 blocks x 7 HF Linears, block 0 kept
    qc = json.loads((tmp_path / "k" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["ignore"] and "model.layers.0.mlp.down_proj" in qc["ignore"]
    assert not any(".layers.1." in i for i in qc["ignore"])
    with safe_open(tmp_path / "k" / "model.safetensors", "pt") as k, \
            safe_open(llama_dir / "model.safetensors", "pt") as src:
        assert k.get_tensor("model.layers.0.mlp.down_proj.weight").dtype == src.get_tensor(
            "model.layers.0.mlp.down_proj.weight").dtype
        name = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(k.get_tensor(name).view(torch.uint8), quantize_rows(src.get_tensor(name))[0].view(torch.uint8))
    model, _ = load_model(tmp_path / "k")
    assert type(model.blocks[0].mlp.down) is torch.nn.Linear and isinstance(model.blocks[1].mlp.down, Fp8Linear)
    bad = runner.invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "b"), "--keep-float", "9"])
    assert bad.exit_code == 2 and "error: --keep-float: block indices must be in [0, " in bad.output, bad.output
    assert not (tmp_path / "b").exists()


def test_keep_float_spec_ends_none_and_indices():
    """--keep-float: 'ends' is the first and last block of a model of >= 8 blocks (a smaller model's ends would
    be most of it: none); 'none' and explicit indices as given; anything else refused by name."""
    import typer

    from shardserve.quantize_cmd import ENDS_MIN_BLOCKS, _kept_blocks

    assert _kept_blocks("ends", 30) == [0, 29] and _kept_blocks("ends", ENDS_MIN_BLOCKS) == [0, ENDS_MIN_BLOCKS - 1]
    assert _kept_blocks("ends", ENDS_MIN_BLOCKS - 1) == [] and _kept_blocks("none", 30) == []
    assert _kept_blocks("2, 0,2", 30) == [0, 2]
    with pytest.raises(typer.Exit):
        _kept_blocks("first", 30)
