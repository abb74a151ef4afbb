"""FP8 with GPTQ error compensation (engines/transforms/fp8_gptq.py): same scales and file format as
round-to-nearest, smaller output error on the calibration inputs, and exactly RTN when there is
nothing to compensate."""

from __future__ import annotations

import torch

from engines.transforms.fp8_format import FP8_DTYPE, dequantize, quantize_rows
from engines.transforms.fp8_gptq import gptq_rows


def _correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, k) activations with correlated features and a few loud ones, like a block's inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k // 4, generator=g) @ torch.randn(k // 4, k, generator=g)
    x[:, :4] *= 20  # outlier features
    return x + 0.1 * torch.randn(n, k, generator=g)


def test_gptq_lowers_output_error_with_rtn_scales():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=g) * 0.05
    x = _correlated_inputs(512, 96)
    q, s = gptq_rows(w, x.t() @ x)
    q0, s0 = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and not torch.isnan(q.float()).any()
    assert torch.equal(s, s0)  # the file's scales are RTN's: only the codes differ
    err = (x @ (w - dequantize(q, s, torch.float32)).t()).norm()
    err0 = (x @ (w - dequantize(q0, s0, torch.float32)).t()).norm()
    assert err < 0.7 * err0, (err, err0)
    assert not torch.equal(q.view(torch.uint8), q0.view(torch.uint8))


def test_gptq_is_rtn_when_inputs_are_uncorrelated():
    """A diagonal Hessian gives no other column any share of a rounding error: RTN, code for code
    (also the unseen inputs, whose H row is zero)."""
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    h = torch.diag(torch.rand(32, generator=torch.Generator().manual_seed(3)) + 0.5)
    h[5, 5] = 0.0  # an input never active in calibration
    q, _ = gptq_rows(w, h)
    assert torch.equal(q.view(torch.uint8), quantize_rows(w)[0].view(torch.uint8))


def test_quantize_cli_with_calibration_and_float_layers_named_in_ignore(llama_dir, tmp_path):
    """`shardserve quantize --calibration TEXT` writes the standard layout with GPTQ codes (RTN scales);
    block layers a model keeps in float are listed in `ignore` (as vLLM needs) and load as float."""
    import json

    from safetensors import safe_open
    from typer.testing import CliRunner

    from engines.loading.checkpoint import load_model, save_checkpoint
    from engines.transforms.fp8 import Fp8Linear
    from engines.transforms.fp8_gptq import gptq_quantize
    from shardserve.cli import app

    text = tmp_path / "calib.txt"
    text.write_text("To be, or not to be, that is the question. " * 200)
    r = CliRunner().invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "q"),
                                 "--calibration", str(text), "--calibration-windows", "4",
                                 "--calibration-window", "64"])
    assert r.exit_code == 0 and "GPTQ" in r.output, r.output
    k = "model.layers.1.mlp.down_proj.weight"
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f, \
            safe_open(llama_dir / "model.safetensors", "pt") as src:
        q, s, w = f.get_tensor(k), f.get_tensor(k + "_scale"), src.get_tensor(k)
    rtn_q, rtn_s = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and torch.equal(s, rtn_s)
    assert not torch.equal(q.view(torch.uint8), rtn_q.view(torch.uint8))
    # GPTQ codes of the LM head beside the file, in a folder transformers and vLLM never read (lm_head_dtype fp8)
    from engines.transforms.fp8_format import read_fp8_head

    with safe_open(llama_dir / "model.safetensors", "pt") as src:
        head = src.get_tensor("lm_head.weight" if "lm_head.weight" in src.keys() else "model.embed_tokens.weight")
    hq, hs = read_fp8_head(tmp_path / "q", tuple(head.shape))
    assert torch.equal(hs, quantize_rows(head)[1]) and not torch.equal(hq.view(torch.uint8),
                                                                       quantize_rows(head)[0].view(torch.uint8))
    assert not list((tmp_path / "q").glob("*head*.safetensors"))  # nothing new at the top level
    bad = CliRunner().invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "b"),
                                   "--calibration", str(tmp_path / "missing.txt")])
    assert bad.exit_code == 2 and "--calibration" in bad.output

    model, cfg = load_model(llama_dir)
    n = gptq_quantize(model, torch.randint(0, cfg.vocab_size, (2, 32)), keep=frozenset({"blocks.0.mlp.down"}))
    assert n == 7 and not isinstance(model.blocks[0].mlp.down, Fp8Linear)
    save_checkpoint(model, cfg, tmp_path / "mixed", tokenizer_dir=llama_dir)
    ignore = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore == ["lm_head", "model.layers.0.mlp.down_proj"]
    back, _ = load_model(tmp_path / "mixed")
    assert not isinstance(back.blocks[0].mlp.down, Fp8Linear) and isinstance(back.blocks[1].mlp.down, Fp8Linear)


def test_self_generated_calibration_is_seeded_and_starts_from_ordinary_tokens(llama_dir):
    """Data-free calibration (engines/transforms/fp8_selfcal.py): windows the model writes itself, full
    length, the same for a seed and different for another, never starting at a special token."""
    import pytest

    from engines.loading.tokenizer import Tokenizer
    from engines.transforms.fp8_selfcal import GREEDY_TOKENS, self_generated_windows, start_tokens

    seen = []
    a = self_generated_windows(llama_dir, 3, 20, seed=1, on_tokens=seen.append)
    assert sum(seen) == 3 * 20
    assert a.shape == (3, 20) and a.dtype == torch.long
    assert torch.equal(a, self_generated_windows(llama_dir, 3, 20, seed=1))
    assert not torch.equal(a, self_generated_windows(llama_dir, 3, 20, seed=2))
    special = {i for i, t in Tokenizer.from_dir(llama_dir).tk.get_added_tokens_decoder().items() if t.special}
    assert special and not set(a[:, 0].tolist()) & special
    assert set(start_tokens(4, {0, 1, 2}, 50, seed=0)) == {3}
    with pytest.raises(ValueError, match="calibration: need n >= 1"):
        self_generated_windows(llama_dir, 0, 20)
    with pytest.raises(ValueError, match=f"length >= {GREEDY_TOKENS + 2}"):
        self_generated_windows(llama_dir, 2, GREEDY_TOKENS + 1)


def test_quantize_cli_self_calibrate_is_gptq_on_self_written_text_and_the_default_rtn(llama_dir, tmp_path):
    """--self-calibrate: GPTQ codes (on text the model wrote) with the LM head's beside; no calibration option:
    round-to-nearest codes on absmax scales and no head folder; contradictory or empty options are refused by
    name."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from shardserve.cli import app

    small = ["--self-calibrate", "--calibration-windows", "2", "--calibration-window", "32"]
    r = CliRunner().invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "g"), *small])
    assert r.exit_code == 0 and "GPTQ on 2 x 32 tokens the model wrote itself (seed 0)" in r.output, r.output
    r = CliRunner().invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "r")])
    assert r.exit_code == 0 and "absmax scales, round to nearest" in r.output, r.output
    k = "model.layers.0.self_attn.o_proj.weight"
    with safe_open(tmp_path / "g" / "model.safetensors", "pt") as g, \
            safe_open(tmp_path / "r" / "model.safetensors", "pt") as rt, \
            safe_open(llama_dir / "model.safetensors", "pt") as src:
        rtn_q = quantize_rows(src.get_tensor(k))[0].view(torch.uint8)
        assert torch.equal(rt.get_tensor(k).view(torch.uint8), rtn_q)
        assert not torch.equal(g.get_tensor(k).view(torch.uint8), rtn_q)
    assert (tmp_path / "g" / "fp8_head").is_dir() and not (tmp_path / "r" / "fp8_head").exists()
    for args, field in ((["--self-calibrate", "--calibration", str(tmp_path / "t.txt")], "--self-calibrate"),
                        (["--self-calibrate", "--scales", "search"], "--scales"),
                        (["--calibration-windows", "0"], "--calibration-windows"),
                        (["--calibration-window", "4"], "--calibration-window")):
        bad = CliRunner().invoke(app, ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "b"), *args])
        assert bad.exit_code == 2 and f"error: {field}:" in bad.output, bad.output
    assert not (tmp_path / "b").exists()
