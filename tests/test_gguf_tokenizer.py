"""The tokenizer rebuilt from GGUF metadata gives the ids of transformers' own GGUF tokenizer.

(The whole-Shakespeare-corpus check on the real SmolLM2 file is in benchmarks/bench_quality.py.)
"""

from __future__ import annotations

import json

import pytest

gguf = pytest.importorskip("gguf")
from gguf_support import CHATML, SPECIALS, TEXT, byte_level_vocab

from engines.loading.gguf_import import read_gguf
from engines.loading.gguf_tokenizer import GGUFTokenizerError, build_tokenizer

SAMPLES = [TEXT, " leading space", "tabs\tand  double  spaces\n\n\n", "émigré 日本語 🙂 x²",
           "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b", ""]


def _write(path, kind: str, tokens, types, merges=None, scores=None, pre=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kind)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _compare(path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tk, cfg = build_tokenizer(read_gguf(path).meta)
    for text in SAMPLES:
        ids = tk.encode(text).ids
        assert ids == ref(text)["input_ids"], text
        assert tk.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    return tk, cfg, ref


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_byte_level_bpe_ids_equal_transformers(tmp_path, pre):
    tokens, types, merges = byte_level_vocab()
    path = _write(tmp_path / "bl.gguf", "gpt2", tokens, types, merges, pre=pre)
    tk, cfg, ref = _compare(path)
    assert cfg["chat_template"] == CHATML
    assert (cfg["bos_token"], cfg["eos_token"]) == (ref.bos_token, ref.eos_token) == tuple(SPECIALS[1:])
    assert cfg["add_bos_token"] is False
    # control tokens are whole special tokens: one id each, dropped by skip_special_tokens
    assert tk.encode("<|im_end|>").ids == [2]
    assert tk.decode([1, *tk.encode("hi").ids, 2], skip_special_tokens=True) == "hi"


def test_sentencepiece_bpe_ids_equal_transformers(tmp_path):
    """llama-style vocabulary: byte tokens, `▁` pieces, merges derived from scores (none in the file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trained = Tokenizer(models.BPE(byte_fallback=True))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    pieces = [t for t, _ in sorted(json.loads(trained.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(i) for i in range(len(pieces))]]
    path = _write(tmp_path / "sp.gguf", "llama", tokens, types, scores=scores)
    tk, cfg, _ = _compare(path)
    assert cfg["add_bos_token"] is True and tk.encode("hi").ids[0] == 1


def test_unknown_tokenizer_model_is_named():
    with pytest.raises(GGUFTokenizerError, match=r"tokenizer.ggml.model 'wordpiece' unsupported"):
        build_tokenizer({"tokenizer.ggml.model": "wordpiece", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(GGUFTokenizerError, match=r"missing tokenizer field 'tokenizer.ggml.model'"):
        build_tokenizer({})
