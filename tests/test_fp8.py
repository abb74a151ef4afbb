"""FP8 weights (issue 13): the quantizer, the compressed-tensors files both ways, the W8A8 glue,
the engine (eager, static decode runner, online quantization) and bad input. Parallel layouts:
tests/test_fp8_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from engines import EngineConfig, SamplingParams
from engines.core.config import ConfigError
from engines.core.executor import InProcessExecutor
from engines.core.llm_engine import LLMEngine
from engines.cpu.fp8_linear import Fp8PanelLinear
from engines.loading.checkpoint import load_model
from engines.transforms.fp8 import Fp8Linear, ScaledMMLinear, apply_fp8, quantize_tokens
from engines.transforms.fp8_format import FP8_DTYPE, FP8_MAX, SCALE_EPS, dequantize, quantize_rows
from shardserve.cli import app

runner = CliRunner()

# ---------------------------------------------------------------- the quantizer

def test_round_trip_within_e4m3_resolution():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-4, 2, 64)[:, None]  # rows over 6 decades
    w[3, 5] = 1e4  # an outlier row
    q, s = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (64, 1)
    back = dequantize(q, s, torch.float32)
    # e4m3: 3 mantissa bits, so a normal value rounds within 2^-4 of itself; below the smallest
    # normal (2^-6 after scaling) the spacing is fixed at 2^-9 of the scale, half of it the error
    bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
    assert ((back - w).abs() <= bound).all()
    # every row's absmax lands exactly on +-448: the full range is used and nothing saturates beyond it
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))


def test_saturation_and_no_nan_or_inf():
    w = torch.tensor([[1e30, -1e30, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-30, -3e-31, 0.0, 5e-31]])
    q, s = quantize_rows(w)
    qf = q.float()
    assert torch.isfinite(qf).all() and torch.isfinite(s).all() and (s > 0).all()
    assert qf.abs().max() == FP8_MAX and qf[0, 0] == FP8_MAX and qf[0, 1] == -FP8_MAX
    assert (qf[1] == 0).all() and s[1, 0] == SCALE_EPS  # an all-zero row: zeros, never a 0 scale
    xq, xs = quantize_tokens(torch.tensor([[1e30, 2.0, -1e30], [0.0, 0.0, 0.0]]))
    assert torch.isfinite(xq.float()).all() and xq.float().abs().max() == FP8_MAX and (xs > 0).all()
    with pytest.raises(ValueError, match="blocks.0.w: holds NaN"):
        quantize_rows(torch.tensor([[float("nan"), 1.0]]), "blocks.0.w")


# ---------------------------------------------------------------- the file we write

def test_quantized_checkpoint_layout(llama_dir, llama_fp8):
    from compressed_tensors.quantization import QuantizationConfig

    hf = json.loads((llama_fp8 / "config.json").read_text())
    qc = hf["quantization_config"]
    parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in (
        "version", "sparsity_config", "transform_config")})  # compressed-tensors' own model of the config
    group = parsed.config_groups["group_0"]
    assert parsed.format == "float-quantized" and parsed.quant_method == "compressed-tensors"
    assert group.weights.strategy == "channel" and group.weights.type == "float" and group.weights.num_bits == 8
    assert group.input_activations.dynamic is True and group.input_activations.strategy == "token"
    assert parsed.ignore == ["lm_head"]
    src = load_file(llama_dir / "model.safetensors")
    with safe_open(llama_fp8 / "model.safetensors", "pt") as f:
        names = set(f.keys())
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            w, s = f.get_tensor(f"model.layers.1.{proj}.weight"), f.get_tensor(f"model.layers.1.{proj}.weight_scale")
            orig = src[f"model.layers.1.{proj}.weight"]
            assert w.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (orig.shape[0], 1)
            # the fused qkv / gate-up scales were split back per tensor: each equals its own rows' absmax
            torch.testing.assert_close(s, orig.float().abs().amax(1, keepdim=True) / FP8_MAX)
        for keep in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                     "model.layers.0.input_layernorm.weight"):
            assert f.get_tensor(keep).dtype == src[keep].dtype
            assert f"{keep}_scale" not in names


def test_quantized_bytes_half_of_bf16(gpt2_dir, tmp_path):
    """The block Linears of a bf16 checkpoint take ~0.5x the bytes in FP8 (1 byte + 4 per row)."""
    m, cfg = load_model(gpt2_dir)
    from engines.loading.checkpoint import save_checkpoint

    save_checkpoint(m, cfg, tmp_path / "bf16", dtype=torch.bfloat16, tokenizer_dir=gpt2_dir)
    r = runner.invoke(app, ["quantize", "--model", str(tmp_path / "bf16"), "--out", str(tmp_path / "q")])
    assert r.exit_code == 0, r.output
    ratio = float(r.output.split("quantized layers: ")[1].split("(")[1].split("x")[0])
    c, f = cfg.n_embd, cfg.ffn_dim
    shapes = [(3 * c, c), (c, c), (f, c), (c, f)]  # (out, in) of qkv, proj, up, down
    expect = sum(o * i + 4 * o for o, i in shapes) / sum(2 * o * i for o, i in shapes)  # e4m3 + fp32 per row
    assert abs(ratio - expect) < 1e-3 and expect < 0.53  # n_embd 64 here; 0.5 + 2/n_embd for large models


# ---------------------------------------------------------------- transformers + compressed-tensors

def _hf_fp8(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _our_model(model_dir: Path, w8a8: bool):
    model, _ = load_model(model_dir)
    rep = apply_fp8(model, "auto", "cpu", torch.float32, force_w8a8=w8a8)
    assert rep.fp8 and (rep.w8a8 if w8a8 else rep.dequant) == 4 * model.cfg.n_layer
    return model


HF_PARTS = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.proj": ("self_attn.o_proj",),
            "mlp.up": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down": ("mlp.down_proj",)}


def _check_against_transformers(model_dir: Path, ids: torch.Tensor) -> None:
    """transformers + compressed-tensors against us on one FP8 llama directory.

    1. Weight-only (our CPU serving path): every Linear transformers decompresses equals our
       dequantized weight bit for bit, and with its activation fake-quantization switched off the
       logits agree to fp32 noise (1e-4): the files, names, fused scales and orientation match.
    2. W8A8 (the sm89+ path, run here on CPU torch._scaled_mm): fed each layer's input as captured
       in transformers' FP8-dynamic forward (weights and per-token activations fake-quantized in
       fp32), our layer gives transformers' output up to the one rounding _scaled_mm adds, its bf16
       result: rtol 2^-7 (bf16 has 8 significant bits), atol 1e-3. Whole-model logits are not
       compared at that tolerance on purpose: each layer's bf16 rounding moves the next layer's
       per-token scales and flips e4m3 roundings, which compounds over layers (measured a few % of
       the logit range on these wide random weights).
    """
    from compressed_tensors.quantization import disable_quantization

    hf = _hf_fp8(model_dir)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [mod.register_forward_hook(lambda m, a, out, n=name: captured.__setitem__(n, (a[0].detach(), out.detach())))
             for name, mod in hf.named_modules() if name.startswith("model.layers.") and isinstance(mod, torch.nn.Linear)]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    ours = _our_model(model_dir, w8a8=True)
    wo = _our_model(model_dir, w8a8=False)
    for i, block in enumerate(ours.blocks):
        for path, parts in HF_PARTS.items():
            names = [f"model.layers.{i}.{p}" for p in parts]
            x = captured[names[0]][0]  # every part of a fused layer sees the same input
            expect = torch.cat([captured[n][1] for n in names], -1)
            with torch.no_grad():
                got = block.get_submodule(path)(x)
            torch.testing.assert_close(got, expect, rtol=2**-7, atol=1e-3)
            theirs_w = torch.cat([hf.get_submodule(n).weight for n in names], 0)
            mod = wo.blocks[i].get_submodule(path)  # CPU weight-only: e4m3 panels (Fp8PanelLinear)
            w = mod.weight if hasattr(mod, "weight") else (mod.weight_fp8().float() * mod.scales[:, None]).to(
                theirs_w.dtype)
            assert torch.equal(w, theirs_w)
    hf.apply(disable_quantization)  # weights stay decompressed; activations are no longer fake-quantized
    with torch.no_grad():
        torch.testing.assert_close(wo.logits(wo(ids))[0], hf(ids).logits[0], rtol=1e-4, atol=1e-4)


def test_our_file_loads_in_transformers(llama_fp8):
    _check_against_transformers(llama_fp8, torch.tensor([[5, 17, 42, 9, 77, 3, 150, 8, 33, 21, 64, 2]]))


def _their_fp8_file(out: Path, strategy: str = "channel", seed: int = 0) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """An FP8 llama written by compressed-tensors itself: scales from its own calculate_qparams,
    compressed by its ModelCompressor, saved by transformers. Returns (dir, ids, their logits)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**fp8, strategy=strategy),
                                input_activations=QuantizationArgs(**fp8, strategy="token", dynamic=True))
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                     quantization_status=QuantizationStatus.FROZEN))
    for mod in hf.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.data
            dims = (1,) if strategy == "channel" else (0, 1)
            lo, hi = w.amin(dims, keepdim=strategy == "channel"), w.amax(dims, keepdim=strategy == "channel")
            scale, _ = calculate_qparams(lo, hi, mod.quantization_scheme.weights)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 150, 8, 200, 21]])
    with torch.no_grad():
        logits = hf(ids).logits[0]  # their fake-quantized forward (weights and activations)
    comp = ModelCompressor.from_pretrained_model(hf, quantization_format="float-quantized")
    comp.compress_model(hf)
    hf.save_pretrained(out)
    comp.update_config(str(out))
    return out, ids, logits


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_their_file_loads_in_ours(tmp_path, strategy):
    d, ids, _ = _their_fp8_file(tmp_path / "theirs", strategy)
    with safe_open(d / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == FP8_DTYPE
    _check_against_transformers(d, ids)
    # and the engine serves it (weight-only on this CPU) with the tokens of the plain forward
    m = _our_model(d, w8a8=False)
    eng = LLMEngine(d, EngineConfig(num_kv_blocks=32, cpu_linear_autotune=False))
    eng.add_request("a", ids[0].tolist(), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    toks = []
    while eng.has_unfinished_requests():
        toks = [o.outputs[0].token_ids for o in eng.step() if o.finished] or toks
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(m.logits(m(torch.tensor([seq])))[0, -1].argmax()))
    assert list(toks[0]) == seq[ids.shape[1]:]


# ---------------------------------------------------------------- W8A8 glue

def _fp8_layer(out_f: int, in_f: int, bias: bool = True, seed: int = 0) -> Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g))
    return Fp8Linear.quantize(lin)


def test_w8a8_glue_equals_dequantize_then_matmul():
    layer = _fp8_layer(96, 64)
    mm = ScaledMMLinear(layer)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16) * 3
    y = mm(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.bfloat16
    xq, xs = quantize_tokens(x.reshape(-1, 64))
    ref = dequantize(xq, xs, torch.float32) @ dequantize(layer.weight, layer.weight_scale, torch.float32).t()
    ref = ref.to(torch.bfloat16).float() + layer.bias  # _scaled_mm rounds its product to bf16
    torch.testing.assert_close(y.float().reshape(-1, 96), ref, rtol=2**-7, atol=1e-3)
    # and it stays within FP8's error of the weight-only (unquantized activations) result
    wo = layer(x.float()).reshape(-1, 96)
    assert (y.float().reshape(-1, 96) - wo).abs().max() < 0.1 * wo.abs().max()


def test_w8a8_bias_in_the_product_equals_bias_after():
    """A bf16 bias goes into _scaled_mm's epilogue (one kernel less a call); same result as adding it
    after the product, up to the one bf16 rounding the fused add saves."""
    lin = torch.nn.Linear(64, 96).to(torch.bfloat16)
    with torch.no_grad():
        lin.bias.mul_(50)  # a bias that matters against the product
    mm = ScaledMMLinear(Fp8Linear.quantize(lin))
    assert mm.fuse_bias
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16) * 3
    fused = mm(x)
    assert mm.fuse_bias, "this torch build refused the fused bias"
    mm.fuse_bias = False
    after = mm(x)
    assert fused.shape == after.shape == (3, 5, 96) and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), after.float(), rtol=2**-7, atol=2**-7 * 50)
    assert (after.float() - mm(torch.zeros_like(x)).float()).abs().max() > 1  # the product is not nothing


def test_cuda_layout_rules_on_meta():
    """What torch._scaled_mm demands on a GPU, checked by its meta kernel: the weight operand is the
    column-major transpose of our (out, in) storage, scales are fp32 (M, 1) and (1, N), K and N
    multiples of 16; the layer satisfies them for decode (M=1) and prefill shapes alike."""
    with torch.device("meta"):
        layer = Fp8Linear(64, 96, bias=False)
        mm = ScaledMMLinear(layer)
        for m in (1, 7, 64):
            assert mm(torch.empty(m, 64, dtype=torch.bfloat16)).shape == (m, 96)
        assert mm.weight.t().stride() == (1, 64)  # column-major (K, N) view, no copy
        assert mm.weight_scale_row.dtype == torch.float32 and mm.weight_scale_row.shape == (1, 96)
        a = torch.empty(8, 64, dtype=FP8_DTYPE)
        sa = torch.empty(8, 1)
        with pytest.raises(RuntimeError, match="col_major"):
            torch._scaled_mm(a, layer.weight.t().contiguous(), scale_a=sa, scale_b=torch.empty(1, 96),
                             out_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="fp32"):
            torch._scaled_mm(a, layer.weight.t(), scale_a=sa, scale_b=torch.empty(1, 96, dtype=torch.bfloat16),
                             out_dtype=torch.bfloat16)
        odd = Fp8Linear(60, 96, bias=False)
        with pytest.raises(RuntimeError, match="divisible by 16"):
            torch._scaled_mm(torch.empty(8, 60, dtype=FP8_DTYPE), odd.weight.t(), scale_a=sa,
                             scale_b=torch.empty(1, 96), out_dtype=torch.bfloat16)


def test_w8a8_skips_shapes_scaled_mm_cannot_take():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = torch.nn.Module(), torch.nn.Module()
            self.attn.qkv, self.attn.proj = _fp8_layer(96, 64), _fp8_layer(64, 32)
            self.mlp.up, self.mlp.down = _fp8_layer(60, 64), _fp8_layer(64, 60)  # 60: not a multiple of 16

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block()])
    rep = apply_fp8(model, "auto", "cpu", torch.float32, force_w8a8=True)
    assert (rep.w8a8, rep.dequant) == (2, 2)
    assert isinstance(model.blocks[0].attn.qkv, ScaledMMLinear) and type(model.blocks[0].mlp.up) is torch.nn.Linear


# ---------------------------------------------------------------- the engine

def _generate(model_dir: Path, cfg: EngineConfig, model=None) -> list[list[int]]:
    kw = {"executor_factory": lambda d, c: InProcessExecutor(d, c, model=model)} if model is not None else {}
    eng = LLMEngine(model_dir, cfg, **kw)
    prompts = [[5, 17, 42, 9, 77, 3], [101, 7, 7, 230, 12], list(range(20, 50))]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[int(o.request_id)] = list(o.outputs[0].token_ids)
    return [out[i] for i in range(len(prompts))]


BASE = EngineConfig(dtype="float32", num_kv_blocks=48, cpu_linear_autotune=False)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_engine_runs_fp8_and_online_quantization_matches(family, gpt2_dir, llama_dir, gpt2_fp8, llama_fp8):
    src, q = (gpt2_dir, gpt2_fp8) if family == "gpt2" else (llama_dir, llama_fp8)
    offline = _generate(q, BASE)
    assert _generate(src, BASE.replace(weight_dtype="fp8")) == offline  # quantized at load: the same values
    eng = LLMEngine(q, BASE)
    assert eng.executor.runner.fp8.dequant == 8 and eng.executor.runner.fp8.quantized_at_load == 0
    assert all(type(b.attn.qkv) is Fp8PanelLinear for b in eng.executor.runner.model.blocks)  # CPU: 1 byte a weight


def _engine_on(model_dir: Path, cfg: EngineConfig, force_w8a8: bool):
    """An engine on model_dir; force_w8a8 hands it a model whose FP8 layers are already W8A8
    (CPU _scaled_mm), which the runner's apply_fp8 then leaves as they are."""
    if not force_w8a8:
        return LLMEngine(model_dir, cfg)
    m, _ = load_model(model_dir)
    apply_fp8(m, cfg.weight_dtype, "cpu", torch.float32, force_w8a8=True)
    return LLMEngine(model_dir, cfg, executor_factory=lambda d, c: InProcessExecutor(d, c, model=m))


@pytest.mark.parametrize("source, weight_dtype, force_w8a8", [
    ("float", "fp8", False),   # quantized at load, dequantized (the CPU serving path)
    ("fp8", "auto", False),    # the FP8 file, dequantized at load
    ("fp8", "auto", True),     # the FP8 file through ScaledMMLinear (what sm89+ GPUs run)
], ids=["online-weight-only", "file-weight-only", "file-w8a8"])
def test_static_decode_runner_accepts_fp8_layers(llama_dir, llama_fp8, source, weight_dtype, force_w8a8):
    """static_decode="on" with FP8 weights gives the eager FP8 path's tokens, and its padded
    batches really ran (requests of different lengths, so batches shrink through the buckets)."""
    model_dir = llama_fp8 if source == "fp8" else llama_dir
    outs, used = [], []
    for static in ("off", "on"):
        cfg = BASE.replace(static_decode=static, weight_dtype=weight_dtype)
        eng = _engine_on(model_dir, cfg, force_w8a8)
        runner = eng.executor.runner
        kind = ScaledMMLinear if force_w8a8 else Fp8PanelLinear  # CPU weight-only: e4m3 kept, widened in the kernel
        assert all(type(b.mlp.down) is kind and type(b.attn.qkv) is kind for b in runner.model.blocks)
        assert (runner.decode_runner is not None) == (static == "on")
        if runner.decode_runner is not None:
            real = runner.decode_runner.run
            runner.decode_runner.run = lambda decode, real=real: used.append(len(decode)) or real(decode)
        prompts = [[5, 17, 42, 9, 77, 3], [101, 7, 7, 230, 12], list(range(20, 50)), [8, 9]]
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True))
        out = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
        outs.append(out)
    assert outs[0] == outs[1]
    assert used and max(used) == 4 and min(used) == 1, f"decode runner batches: {used}"


def test_w8a8_decode_step_has_no_host_sync(llama_fp8):
    """The W8A8 layers inside the padded step (what a CUDA graph captures) never read a value back
    to the host: per-token activation scales stay on the device."""
    from test_engine_decode_runner import _OpLog

    from engines.core.plan import SeqWork

    eng = _engine_on(llama_fp8, BASE.replace(static_decode="on", block_size=4), force_w8a8=True)
    dr = eng.executor.runner.decode_runner
    work = [SeqWork(seq_id=i, token_ids=[5 + i], start_pos=6 + i, block_ids=[2 * i, 2 * i + 1], sample=True)
            for i in range(3)]
    B = dr.bucket_for(work)
    dr._fill(work, B, dr.max_blocks)
    with torch.inference_mode(), _OpLog() as log:
        dr._step(B)
    assert any("_scaled_mm" in op for op in log.ops)
    syncs = [op for op in log.ops if any(s in op for s in ("_local_scalar_dense", "item", "nonzero",
                                                           "masked_select", "unique"))]
    assert not syncs, f"host syncs inside the W8A8 decode step: {syncs}"


def test_weight_dtype_is_validated():
    with pytest.raises(ConfigError, match="weight_dtype: must be one of auto, fp8, got 'int4'"):
        EngineConfig(weight_dtype="int4")
    from deploy.schema import EngineOptions

    assert EngineOptions(weight_dtype="fp8").engine_kwargs() == {"weight_dtype": "fp8"}
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineOptions(weight_dtype="int8")
