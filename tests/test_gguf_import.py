"""GGUF import: every supported tensor type against the gguf package's dequantizers, and a tiny random
llama written as GGUF (llama.cpp's q/k permutation included) imported back to the same logits."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q
from gguf_support import CHATML, byte_level_vocab, tiny_llama, write_llama_gguf

from engines.loading.checkpoint import load_model
from engines.loading.gguf_import import SUPPORTED_TYPES, dequantize_tensor, import_gguf, read_gguf
from engines.loading.model_source import resolve_model

ROWS, COLS = 3, 512  # two 256-element super-blocks per row for the K-quants
# byte offsets of the fp16 scale fields inside one block (random bytes there could be inf/NaN)
_K_SCALES = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def _raw(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """(data to write, the float32 source it was quantized from or None for raw random blocks)."""
    src = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if kind == "F32":
        return src, src
    if kind == "F16":
        return src.astype(np.float16), src
    if kind in _K_SCALES:  # gguf can dequantize these but not quantize: random blocks, sane scales
        block, offsets = _K_SCALES[kind]
        raw = rng.integers(0, 256, size=(ROWS, COLS // 256, block), dtype=np.uint8)
        for off in offsets:
            scale = rng.uniform(1e-3, 1e-2, size=(ROWS, COLS // 256)).astype(np.float16)
            raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(ROWS, COLS // 256, 2)
        return raw.reshape(ROWS, -1), None
    return gguf.quants.quantize(src, Q[kind]), src


@pytest.mark.parametrize("kind", SUPPORTED_TYPES)
def test_each_tensor_type_round_trips_through_the_gguf_dequantizer(kind, tmp_path):
    rng = np.random.default_rng(SUPPORTED_TYPES.index(kind))
    data, src = _raw(kind, rng)
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if data.dtype == np.uint8:
        w.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=Q[kind])
    else:
        w.add_tensor("blk.0.ffn_up.weight", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (t,) = read_gguf(path).tensors
    assert t.tensor_type.name == kind
    ours = dequantize_tensor(t)
    assert ours.shape == (ROWS, COLS) and ours.dtype == np.float32
    ref = gguf.quants.dequantize(data.view(np.uint8) if data.dtype == np.uint8 else data, Q[kind])
    np.testing.assert_array_equal(ours, np.asarray(ref, dtype=np.float32).reshape(ROWS, COLS))
    assert np.isfinite(ours).all() and ours.std() > 0
    if src is not None:  # and the quantization error is the format's, not a layout mix-up
        tol = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q4_1": 0.3, "Q4_0": 0.4}[kind]
        assert np.abs(ours - src).max() <= tol * np.abs(src).max()


@pytest.fixture(scope="module")
def vocab():
    return byte_level_vocab()


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_llama_gguf_imports_to_the_source_logits(vocab, tmp_path, tie):
    src = tiny_llama(len(vocab[0]), tie=tie, seed=int(tie))
    path = write_llama_gguf(src, tmp_path / "tiny.gguf", vocab)
    out = import_gguf(path, tmp_path / "out", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is tie
    assert cfg["num_key_value_heads"] == 2 and cfg["eos_token_id"] == 2
    ours, _ = load_model(out)
    idx = torch.randint(0, len(vocab[0]), (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.logits(ours(idx)) - src(idx).logits).abs().max().item()
    assert diff <= 1e-4
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHATML and tc["eos_token"] == "<|im_end|>" and tc["bos_token"] == "<|im_start|>"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    # transformers loads the imported directory to the same logits
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (hf(idx).logits - src(idx).logits).abs().max().item() <= 1e-4


def test_quantized_import_matches_the_dequantized_weights(vocab, tmp_path):
    """Q8_0 weights: the import holds exactly what the gguf dequantizer gives, q/k un-permuted."""
    src = tiny_llama(len(vocab[0]), seed=3)
    path = write_llama_gguf(src, tmp_path / "q8.gguf", vocab, qtype=Q.Q8_0)
    out = import_gguf(path, tmp_path / "out", dtype="fp32")
    from safetensors.torch import load_file

    sd = load_file(out / "model.safetensors")
    for name, p in src.state_dict().items():
        if p.ndim == 2 and name in sd:  # (lm_head is tied) dequantized Q8_0: close to the source, error bounded by the format
            assert (sd[name] - p).abs().max() <= 0.02 * p.abs().max(), name


def test_llm_takes_a_gguf_file_and_reuses_its_cached_import(vocab, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the cache's location, not a switch
    src = tiny_llama(len(vocab[0]), seed=4)
    path = write_llama_gguf(src, tmp_path / "m.gguf", vocab)
    first = resolve_model(path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(path) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name == "m" and str(first).startswith(str(tmp_path / "cache"))
    assert resolve_model(tmp_path) == tmp_path  # a directory is taken as is

    from engines import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32")
    prompt = [5, 17, 42, 99, 7]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ids = list(out[0].outputs[0].token_ids)
    ref = src.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()
    assert ids == ref
