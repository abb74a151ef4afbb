"""Bad GGUF input: a clear error naming the field or tensor, and no output directory left behind."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf_support import byte_level_vocab, tiny_llama, write_llama_gguf

from engines.loading.gguf_import import GGUFImportError, import_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    vocab = byte_level_vocab()
    return write_llama_gguf(tiny_llama(len(vocab[0])), tmp_path_factory.mktemp("g") / "good.gguf", vocab)


def _nothing_written(parent):
    assert [p.name for p in parent.iterdir()] == [], "a partial output directory was left behind"


def _fails(src, tmp_path, match):
    parent = tmp_path / "outs"
    parent.mkdir()
    with pytest.raises(GGUFImportError, match=match):
        import_gguf(src, parent / "out", dtype="fp32")
    _nothing_written(parent)


def test_truncated_file_is_refused(good, tmp_path):
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1000])  # gguf's reader fails on the last tensor's data
    _fails(bad, tmp_path, r"cut.gguf: not a readable GGUF file, truncated or corrupt \(\d+ bytes")


def test_truncated_header_and_bad_magic(good, tmp_path):
    head = tmp_path / "head.gguf"
    head.write_bytes(good.read_bytes()[:300])  # cut inside the metadata
    (tmp_path / "a").mkdir()
    _fails(head, tmp_path / "a", r"head.gguf: not a readable GGUF file")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + good.read_bytes()[4:])
    (tmp_path / "b").mkdir()
    _fails(junk, tmp_path / "b", r"junk.gguf: not a readable GGUF file")


def _write(path, arch="llama", qtype=None, extra_tensor=None):
    vocab = byte_level_vocab()
    model = tiny_llama(len(vocab[0]))
    write_llama_gguf(model, path, vocab, arch=arch)
    if qtype is None and extra_tensor is None:
        return path
    # rewrite with one tensor of another type / an unknown tensor, copying the rest
    r = gguf.GGUFReader(str(path))
    out = path.with_name("re_" + path.name)
    w = gguf.GGUFWriter(str(out), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        data = np.array(t.data)
        if qtype is not None and t.name == "blk.1.ffn_up.weight":
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    bad = _write(tmp_path / "q5.gguf", qtype=gguf.GGMLQuantizationType.Q5_0)
    _fails(bad, tmp_path, r"tensor 'blk.1.ffn_up.weight': type Q5_0 unsupported; supported: F32, .*Q6_K")


def test_unknown_tensor_names_the_tensor(tmp_path):
    bad = _write(tmp_path / "x.gguf", extra_tensor="blk.0.mystery.weight")
    _fails(bad, tmp_path, r"tensor 'blk.0.mystery.weight' has no place in a llama model")


def test_unsupported_architecture_names_the_field(tmp_path):
    bad = _write(tmp_path / "arch.gguf", arch="falcon")
    _fails(bad, tmp_path, r"general.architecture 'falcon' unsupported; supported: llama, mistral, qwen2, qwen3")


def test_existing_output_is_refused_and_left_alone(good, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(good, out)
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_cli_reports_the_error_with_exit_code_2(tmp_path):
    from typer.testing import CliRunner

    from shardserve.cli import app

    bad = tmp_path / "nope.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    res = CliRunner().invoke(app, ["import", str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "not a readable GGUF file" in res.output
    assert not (tmp_path / "o").exists()
