"""Config files that are not UTF-8 text (a binary file, a file saved in another encoding) are
refused by the module that reads them, naming the file, instead of a UnicodeDecodeError traceback
or, under `shardserve serve`, a ValueError that does not say which file."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from shardserve.cli import app

NOT_UTF8 = b"\xff\xfe"


@pytest.fixture
def bad(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(NOT_UTF8)
    return path


def test_deployment_config_file(bad):
    from deploy.schema import ConfigFileError, load_config

    with pytest.raises(ConfigFileError, match=rf"^{bad}: not UTF-8 text \(invalid start byte at byte 0\)$"):
        load_config(bad)


def test_api_key_files(bad):
    """Under serve a ValueError that does not name the file was all the user saw."""
    from deploy.schema import ConfigFileError, read_api_keys, validate_config

    for prefix in ("", "admin_"):
        cfg = validate_config({"models": [{"name": "m", "path": "p"}], "server": {f"{prefix}api_keys_file": str(bad)}})
        with pytest.raises(ConfigFileError, match=rf"^server\.{prefix}api_keys_file: {bad}: not UTF-8 text"):
            read_api_keys(cfg.server, environ={}, admin=bool(prefix))


def test_recipe_file(bad):
    from engines.core.config import ConfigError
    from training.recipe import load_recipe

    with pytest.raises(ConfigError, match=rf"^recipe: {bad}: not UTF-8 text \(invalid start byte at byte 0\)$"):
        load_recipe(bad)


def test_profile_file(bad):
    from tuner.profiles import ProfileError, load_profile

    with pytest.raises(ProfileError, match=rf"^hardware: {bad}: not UTF-8 text"):
        load_profile(str(bad))


@pytest.mark.parametrize("args", [["deploy", "render", "-c", "{bad}", "-t", "ray-serve"], ["train", "--config", "{bad}"],
                                  ["tune", "predict", "--model", "{cfg}", "--hardware", "{bad}"]],
                         ids=["deploy render", "train", "tune predict"])
def test_commands_exit_2_naming_the_file(bad, tmp_path, args):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "gpt2", "vocab_size": 100, "n_layer": 2, "n_head": 4, "n_embd": 32}')
    run = CliRunner().invoke(app, [a.format(bad=bad, cfg=cfg) for a in args])
    assert run.exit_code == 2 and f"{bad}: not UTF-8 text" in run.output, (run.output, run.exception)
