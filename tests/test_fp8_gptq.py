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
