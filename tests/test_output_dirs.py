"""Commands that write a model or task folder never delete what was there, unless it is their own
earlier output and the user passed --overwrite; their output is readable by other users; and their
flags refuse values they would otherwise misread (quantize, export, train's export_dir, ptune,
generate --prompt, eval ppl --max-tokens)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shardserve.cli import app

runner = CliRunner()


@pytest.fixture
def model(gpt2_dir, tmp_path) -> Path:
    """A private copy of the tiny GPT-2 with a generation_config.json richer than bos/eos."""
    d = tmp_path / "models" / "m"
    shutil.copytree(gpt2_dir, d)
    gen = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 1, "temperature": 0.6, "top_p": 0.9}
    (d / "generation_config.json").write_text(json.dumps(gen))
    (tmp_path / "models" / "sibling").mkdir()
    (tmp_path / "models" / "sibling" / "keep.txt").write_text("precious")
    return d


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _quantize(model: Path, out: Path, *extra: str):
    return runner.invoke(app, ["quantize", "--model", str(model), "--out", str(out), *extra])


def test_quantize_refuses_an_out_that_would_delete_something(model, tmp_path):
    models = model.parent
    before = _tree(models)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("precious")
    afile = tmp_path / "afile"
    afile.write_text("precious")
    for out, why in ((existing, "not empty"), (models, "contains the source"), (model, "is the source"),
                     (model / "q", "inside --model"), (afile, "is a file")):
        r = _quantize(model, out)
        assert r.exit_code == 2 and "--out" in r.output and why in r.output, (out, r.output)
        assert "Traceback" not in r.output
    assert _tree(models) == before
    assert (existing / "notes.txt").read_text() == "precious" and afile.read_text() == "precious"
    # --overwrite does not make a folder of other things replaceable either
    r = _quantize(model, existing, "--overwrite")
    assert r.exit_code == 2 and "not empty" in r.output and (existing / "notes.txt").is_file()


def test_quantize_replaces_an_earlier_checkpoint_only_with_overwrite(model, tmp_path):
    out = tmp_path / "q"
    assert _quantize(model, out).exit_code == 0
    first = (out / "model.safetensors").stat().st_mtime_ns
    r = _quantize(model, out)
    assert r.exit_code == 2 and "--overwrite" in r.output and "already holds a checkpoint" in r.output
    assert (out / "model.safetensors").stat().st_mtime_ns == first
    r = _quantize(model, out, "--overwrite", "--keep-float", "0")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] != ["lm_head"]
    # a file the user added makes it more than a checkpoint: refused, even with --overwrite, and kept
    (out / "README.md").write_text("my notes")
    r = _quantize(model, out, "--overwrite")
    assert r.exit_code == 2 and "README.md" in r.output and (out / "README.md").read_text() == "my notes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.")]  # no temporary folders left


def test_an_empty_out_folder_is_used(model, tmp_path):
    (tmp_path / "empty").mkdir()
    r = _quantize(model, tmp_path / "empty")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_quantized_folder_is_readable_by_others(model, tmp_path):
    old = os.umask(0o022)
    try:
        r = _quantize(model, tmp_path / "q")
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    out = tmp_path / "q"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_quantized_folder_keeps_the_sources_generation_settings_and_tokenizer(model, tmp_path):
    assert _quantize(model, tmp_path / "q").exit_code == 0
    out = tmp_path / "q"
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (model / "generation_config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model / name).is_file():
            assert (out / name).read_bytes() == (model / name).read_bytes()


def test_save_checkpoint_replaces_only_when_asked(gpt2_dir, tmp_path):
    from engines.loading.checkpoint import load_model, save_checkpoint
    from engines.loading.output_dir import OutputDirError

    net, cfg = load_model(gpt2_dir)
    out = save_checkpoint(net, cfg, tmp_path / "c")
    with pytest.raises(OutputDirError, match="already holds a checkpoint"):
        save_checkpoint(net, cfg, out)
    save_checkpoint(net, cfg, out, overwrite=True)
    (out / "ptuning").mkdir()  # a model's p-tuned tasks are not checkpoint files
    with pytest.raises(OutputDirError, match="ptuning"):
        save_checkpoint(net, cfg, out, overwrite=True)
    assert (out / "ptuning").is_dir() and (out / "model.safetensors").is_file()


def test_export_model_refuses_a_used_folder_and_overwrites_an_earlier_export_when_asked(gpt2_dir, tmp_path):
    from engines.loading.checkpoint import load_model
    from training.export import ExportError, export_model

    net, cfg = load_model(gpt2_dir)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("precious")
    with pytest.raises(ExportError, match="out.export_dir: .* not empty"):
        export_model(net, cfg, victim, gpt2_dir)
    assert (victim / "important.txt").read_text() == "precious"
    with pytest.raises(ExportError, match="is the source"):
        export_model(net, cfg, gpt2_dir, gpt2_dir, overwrite=True)
    out = export_model(net, cfg, tmp_path / "e", gpt2_dir)
    assert stat.S_IMODE(out.stat().st_mode) & 0o055 == 0o055  # others can list and read it
    with pytest.raises(ExportError, match="already holds a checkpoint"):
        export_model(net, cfg, out, gpt2_dir)
    export_model(net, cfg, out, gpt2_dir, overwrite=True)


def test_train_checks_its_export_dir_before_training(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("precious")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"
    r = runner.invoke(app, ["train", "--config", str(recipe), "--set", f"out.export_dir={victim}",
                            "--set", f"out.dir={tmp_path / 'run'}", "--set", "model.vocab_size=300",
                            "--no-progress"])
    assert r.exit_code == 2 and "out.export_dir" in r.output and "not empty" in r.output, r.output
    assert (victim / "important.txt").read_text() == "precious" and not (tmp_path / "run").exists()


def _ptune(model: Path, data: Path, *extra: str):
    return runner.invoke(app, ["ptune", "--model", str(model), "--task", "t1", "--data", str(data),
                               "--set", "max_steps=1", "--set", "num_virtual_tokens=2", "--no-progress", *extra])


@pytest.fixture
def pt_data(tmp_path) -> Path:
    p = tmp_path / "pt.jsonl"
    p.write_text("".join(json.dumps({"input": f"w{i} w{i}", "output": (" yes", " no")[i % 2]}) + "\n"
                         for i in range(8)))
    return p


def test_ptune_refuses_an_out_that_would_delete_something(model, pt_data, tmp_path):
    models = model.parent
    before = _tree(models)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("precious")
    for out, why in ((victim, "not empty"), (model, "is or contains the model"),
                     (models, "is or contains the model"), (pt_data, "is a file")):
        r = _ptune(model, pt_data, "--out", str(out), "--overwrite")
        assert r.exit_code == 2 and "--out" in r.output and why in r.output, (out, r.output)
    cwd = os.getcwd()
    os.chdir(models)
    try:
        r = _ptune(model, pt_data, "--out", ".")
    finally:
        os.chdir(cwd)
    assert r.exit_code == 2 and "--out" in r.output and "Traceback" not in r.output, r.output
    assert _tree(models) == before and (victim / "important.txt").read_text() == "precious"
    assert not list(tmp_path.glob(".*partial"))


def test_ptune_replaces_an_earlier_task_only_with_overwrite(model, pt_data, tmp_path):
    out = tmp_path / "task"
    assert _ptune(model, pt_data, "--out", str(out)).exit_code == 0
    first = (out / "task.json").read_bytes()
    r = _ptune(model, pt_data, "--out", str(out))
    assert r.exit_code == 2 and "--overwrite" in r.output and (out / "task.json").read_bytes() == first
    r = _ptune(model, pt_data, "--out", str(out), "--overwrite")
    assert r.exit_code == 0, r.output
    # the model's own slot: the CLI asks for --overwrite too; the REST job's train_task retrains in place
    assert _ptune(model, pt_data).exit_code == 0
    r = _ptune(model, pt_data)
    assert r.exit_code == 2 and "--task" in r.output and "--overwrite" in r.output
    from training.ptune import train_task
    from training.ptune_recipe import PtuneRecipe

    train_task(model, "t1", pt_data, PtuneRecipe(max_steps=1, num_virtual_tokens=2), progress=False)


def test_generate_refuses_a_prompt_that_is_not_utf8(gpt2_dir):
    r = runner.invoke(app, ["generate", "--model", str(gpt2_dir), "--prompt", b"\xff\xfe abc".decode(
        "utf-8", "surrogateescape"), "--max-tokens", "2"])
    assert r.exit_code == 2 and "--prompt: not valid UTF-8" in r.output, r.output


def test_eval_ppl_refuses_negative_max_tokens(gpt2_dir, tmp_path):
    import numpy as np

    np.random.default_rng(0).integers(0, 300, size=300, dtype=np.uint16).tofile(tmp_path / "val.bin")
    r = runner.invoke(app, ["eval", "ppl", "--model", str(gpt2_dir), "--tokens", str(tmp_path / "val.bin"),
                            "--window", "64", "--max-tokens", "-5"])
    assert r.exit_code == 2 and "--max-tokens" in r.output and ">= 1" in r.output, r.output
