"""EngineConfig.lm_head_dtype "fp8" (engines/transforms/fp8.py apply_fp8_head): the logits through a per-row
e4m3 copy of the LM head on the FP8 CPU kernel, the tied embedding left in the compute dtype; GPTQ head codes
from `shardserve quantize --calibration` (fp8_head/, fp8_format.HEAD_FILE) are used where present."""

from __future__ import annotations

import pytest
import torch

from engines.cpu import panel_kernel as pk
from engines.transforms.fp8_format import Fp8FormatError, quantize_rows, read_fp8_head, save_fp8_head
from tests.conftest import make_checkpoint

pytestmark = pytest.mark.skipif(pk.load_fp8()[0] is None, reason="the C++ kernels cannot be built here")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tied"), "llama", seed=3, tie_word_embeddings=True)


def test_fp8_head_logits_and_the_embedding_left_as_it_was(tied_dir):
    from engines.cpu.fp8_linear import Fp8PanelLinear
    from engines.loading.checkpoint import load_model
    from engines.transforms.fp8 import apply_fp8_head

    model, cfg = load_model(tied_dir)
    emb = model.wte.weight.detach().clone()
    assert model.lm_head.weight is model.wte.weight
    assert "rounded to nearest" in apply_fp8_head(model, torch.float32, tied_dir)  # no fp8_head/ there
    head = model.lm_head
    assert isinstance(head, Fp8PanelLinear) and torch.equal(model.wte.weight, emb)  # the lookups keep fp32
    q, s = quantize_rows(emb)
    assert torch.equal(head.weight_fp8().view(torch.uint8), q.view(torch.uint8))
    ref_w = q.float() * s  # (V, C) dequantized
    for rows in (1, 70):  # a decode row through the kernel; a prefill-sized block (dequantized per call)
        h = torch.randn(rows, cfg.n_embd, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(model.logits(h), h @ ref_w.t(), atol=1e-4, rtol=1e-5)
    assert "already FP8" in apply_fp8_head(model, torch.float32)


def test_fp8_head_reads_the_quantizers_codes_and_refuses_a_wrong_shape(tied_dir, tmp_path):
    from engines.loading.checkpoint import load_model
    from engines.transforms.fp8 import apply_fp8_head

    model, _ = load_model(tied_dir)
    w = model.wte.weight.detach()
    q, s = quantize_rows(-w)  # codes unlike RTN's of w: the file's must be the ones used
    save_fp8_head(tmp_path, q, s)
    got_q, got_s = read_fp8_head(tmp_path, tuple(w.shape))
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, s)
    assert "GPTQ codes" in apply_fp8_head(model, torch.float32, tmp_path)
    assert torch.equal(model.lm_head.weight_fp8().view(torch.uint8), q.view(torch.uint8))
    with pytest.raises(Fp8FormatError, match="shape"):
        read_fp8_head(tmp_path, (w.shape[0] + 1, w.shape[1]))
    assert read_fp8_head(tmp_path / "none", tuple(w.shape)) is None


def test_lm_head_dtype_is_checked_where_it_enters():
    from engines.core.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="lm_head_dtype"):
        EngineConfig(lm_head_dtype="int4")
    with pytest.raises(ConfigError, match="lm_head_dtype.*CPU"):
        EngineConfig(device="cuda", lm_head_dtype="fp8")


def test_engine_with_an_fp8_head_decodes_on_the_fused_step(tied_dir):
    from engines import LLM, SamplingParams
    from engines.cpu.fp8_linear import Fp8PanelLinear

    llm = LLM(tied_dir, dtype="float32", lm_head_dtype="fp8", worker_threads=1, decode_steps=1)  # a step a token
    runner = llm.engine.executor.runner
    assert isinstance(runner.model.lm_head, Fp8PanelLinear)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and runner.paths["fused"] >= 3, dict(runner.paths)


@pytest.mark.parametrize("variant", ["portable", "avx2", "avx512_on_avx2", "avx512", "avx512bf16", "avx512bf16_emulated"])
def test_fp8_head_logits_of_bf16_rows_are_the_kernels_unrounded_sums(tied_dir, variant):
    """Fp8PanelLinear.forward_float (the logits head_logits takes): the kernel's fp32 sums, whose bf16 rounding is
    forward's output exactly, near the dequantized fp32 product; not a widened bf16 (which would tie near-equal
    logits)."""
    from engines.cpu.fp8_linear import Fp8PanelLinear
    from engines.loading.checkpoint import load_model
    from engines.model.transformer import head_logits
    from engines.transforms.fp8 import apply_fp8_head

    try:
        pk.fp8_variant(variant, torch.bfloat16)
    except ValueError as exc:
        pytest.skip(str(exc))
    model, cfg = load_model(tied_dir)
    model.to(torch.bfloat16)
    apply_fp8_head(model, torch.bfloat16, tied_dir)
    head = model.lm_head
    assert isinstance(head, Fp8PanelLinear)
    head.variant = variant
    head.bias = torch.randn(head.out_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    ref_w = head.weight_fp8().float() * head.scales[:, None]
    with torch.inference_mode():
        for rows in (1, 5):
            h = torch.randn(rows, cfg.n_embd, generator=torch.Generator().manual_seed(rows)).bfloat16()
            logits = head_logits(head, h)
            assert logits.dtype == torch.float32 and logits.shape == (rows, head.out_features)
            assert torch.equal(logits.bfloat16(), head(h))  # forward rounds the same sums once
            assert not torch.equal(logits, logits.bfloat16().float())  # not a widened bf16
            ref = h.float() @ ref_w.t() + head.bias.float()
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
