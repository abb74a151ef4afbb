"""The deployment-config schema: one source of truth, strict, and errors that name the field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.schema import (
    ConfigFileError,
    DeploymentConfig,
    EngineOptions,
    load_config,
    read_api_keys,
    validate_config,
)
from engines.core.config import ConfigError, EngineConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))


def test_engine_options_are_engine_config_fields():
    # EngineOptions is derived from EngineConfig (one source of truth): the same fields, in order
    assert tuple(EngineOptions.model_fields) == EngineConfig.field_names()


def test_engine_options_types_and_choices_follow_engine_config():
    """The schema's field types are EngineConfig's (optional: None keeps the engine's default), and
    every choice the schema offers is one the engine takes."""
    import typing

    hints = typing.get_type_hints(EngineConfig)
    for name, info in EngineOptions.model_fields.items():
        engine_t = hints[name]
        assert info.annotation == (engine_t | None), f"{name}: schema {info.annotation} vs engine {engine_t}"
        assert info.default is None, f"{name}: the schema's default must be None (the engine's default)"
        for choice in typing.get_args(engine_t) if typing.get_origin(engine_t) is typing.Literal else ():
            EngineConfig(**{name: choice})


def test_unset_engine_options_keep_engine_defaults():
    assert EngineOptions().engine_kwargs() == {}
    assert EngineConfig(**EngineOptions().engine_kwargs()) == EngineConfig()
    opts = EngineOptions(max_num_seqs=8, dtype="bfloat16")
    assert EngineConfig(**opts.engine_kwargs()) == EngineConfig(max_num_seqs=8, dtype="bfloat16")


def test_engine_options_ranges_match_engine_checks():
    # every value the schema accepts, the engine accepts too (spot checks at the boundaries)
    for field in dataclasses.fields(EngineConfig):
        if field.name in ("extra",):
            continue
        default = getattr(EngineConfig(), field.name)
        EngineOptions(**{field.name: default})
    for bad in ({"block_size": 0}, {"max_num_seqs": -1}, {"kv_cache_bytes": -1}, {"kv_cache_memory_fraction": 0}, {"max_logprobs": 101},
                {"max_logprobs": 21},
                {"tensor_parallel_size": 0}, {"dtype": "int8"}, {"dist_timeout_s": 0},
                {"dist_timeout_s": float("inf")}, {"step_record_len": 0}, {"step_record_len": 10**7},
                {"compile_decode": "on", "static_decode": "off"}):
        with pytest.raises(ValueError):
            EngineOptions(**bad)
        with pytest.raises((ConfigError, TypeError)):
            EngineConfig(**bad)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    cfg = load_config(path)
    assert cfg.models and cfg.server.host == "127.0.0.1"
    for m in cfg.models:
        EngineConfig(**m.engine.engine_kwargs())


def test_defaults_bind_localhost():
    cfg = DeploymentConfig.for_model_dir("/some/where/default")
    assert cfg.models[0].name == "default"
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8000
    assert cfg.ray.address is None


BAD = [
    ({"models": []}, "models: List should have at least 1 item"),
    ({}, "models: Field required"),
    ({"models": [{"name": "m"}]}, "models.0.path: Field required"),
    ({"models": [{"name": "m", "path": "p", "replica": 2}]}, "models.0.replica: unknown field"),
    ({"models": [{"name": "m", "path": "p", "engine": {"block_size": 0}}]},
     "models.0.engine.block_size: must be a positive integer, got 0"),
    ({"models": [{"name": "m", "path": "p", "engine": {"dtype": "int4"}}]}, "models.0.engine.dtype"),
    ({"models": [{"name": "m", "path": "p", "replicas": 0}]}, "models.0.replicas: Input should be greater"),
    ({"models": [{"name": "bad name", "path": "p"}]}, "models.0.name: must be 1-128 characters"),
    ({"models": [{"name": "a/b", "path": "p"}]}, "models.0.name"),
    ({"models": [{"name": "m", "path": "p"}, {"name": "m", "path": "q"}]}, "models.1.name: 'm' is used by two"),
    ({"models": [{"name": "m", "path": "p", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]},
     "models.0.autoscaling: min_replicas (3) must be <= max_replicas (2)"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"port": 70000}}, "server.port: Input should be less"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"request_timeout_s": 0}}, "server.request_timeout_s"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"request_timeout_s": float("inf")}},
     "server.request_timeout_s: Input should be a finite number"),
    ({"models": [{"name": "m", "path": "p", "num_gpus": float("nan")}]}, "models.0.num_gpus: Input should be a finite"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"port": 0}}, "server.port: Input should be greater than or equal to 1"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"hots": "x"}}, "server.hots: unknown field"),
    ({"models": [{"name": "m", "path": "p", "engine": {"weight_dtype": "int3"}}]}, "models.0.engine.weight_dtype"),
    ({"models": [{"name": "m", "path": "p", "engine": {"device": "tpu"}}]},
     "models.0.engine.device: must be cpu, cuda or cuda:N, got 'tpu'"),
    ({"models": [{"name": "m", "path": "p", "engine": {"device": "cuda:x"}}]},
     "models.0.engine.device: must be cpu, cuda or cuda:N, got 'cuda:x'"),
    ({"models": [{"name": "m", "path": "p", "engine": {"device": "CUDA"}}]}, "models.0.engine.device"),
    ({"models": [{"name": "m", "path": "p"}, {"name": "n", "path": "q"}], "server": {"ingress": "colocated"}},
     "server.ingress: colocated does not apply with 2 models"),
    ({"models": [{"name": "m", "path": "p", "replicas": 2}], "server": {"ingress": "colocated"}},
     "server.ingress: colocated does not apply with models.0: more than one replica"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"ingress": "colocated"}, "ray": {"address": "h:6379"}},
     "server.ingress: colocated does not apply with ray.address"),
    ({"models": [{"name": "m", "path": "p"}], "server": {"ingress": "nearby"}}, "server.ingress: Input should be"),
]


@pytest.mark.parametrize("data, message", BAD, ids=[m for _, m in BAD])
def test_invalid_configs_name_the_field(data, message):
    with pytest.raises(ConfigFileError) as exc:
        validate_config(data)
    assert message in str(exc.value)


def test_load_config_reports_file_and_yaml_errors(tmp_path):
    with pytest.raises(ConfigFileError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigFileError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(ConfigFileError, match="must hold a mapping"):
        load_config(bad)
    bad.write_text("models:\n  - name: m\n    path: p\n    engine:\n      max_num_seqs: lots\n")
    with pytest.raises(ConfigFileError, match=r"bad.yaml: invalid deployment config\nmodels.0.engine.max_num_seqs"):
        load_config(bad)


def test_api_keys_from_file_and_env(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-one\n\n  sk-two  \n")
    cfg = validate_config({"models": [{"name": "m", "path": "p"}], "server": {"api_keys_file": str(keys)}})
    assert read_api_keys(cfg.server, environ={}) == ["sk-one", "sk-two"]
    assert read_api_keys(cfg.server, environ={"SHARDSERVE_API_KEYS": "sk-3, sk-4"}) == [
        "sk-one", "sk-two", "sk-3", "sk-4"]
    cfg = validate_config({"models": [{"name": "m", "path": "p"}]})
    assert read_api_keys(cfg.server, environ={}) == []
    missing = validate_config({"models": [{"name": "m", "path": "p"}], "server": {"api_keys_file": "/nope/k"}})
    with pytest.raises(ConfigFileError, match="server.api_keys_file: /nope/k does not exist"):
        read_api_keys(missing.server, environ={})
    keys.write_text("# nothing\n")
    with pytest.raises(ConfigFileError, match="holds no keys"):
        read_api_keys(cfg.replace(server={"api_keys_file": str(keys)}).server, environ={})


@pytest.mark.parametrize("models, server, ray, want", [
    ([{}], {}, {}, "colocated"),
    ([{"replicas": 2}], {}, {}, "direct"),
    ([{"autoscaling": {"max_replicas": 1}}], {}, {}, "direct"),
    ([{}, {"name": "n"}], {}, {}, "direct"),
    ([{}], {"gateway_replicas": 2}, {}, "direct"),
    ([{}], {}, {"address": "head:6379"}, "direct"),
    ([{}], {"ingress": "ray-proxy"}, {}, "ray-proxy"),
    ([{"replicas": 2}], {"ingress": "direct"}, {}, "direct"),
])
def test_auto_ingress_colocates_one_model_of_one_replica_on_a_local_ray(models, server, ray, want):
    cfg = validate_config({"models": [{"name": "m", "path": "p", **m} for m in models], "server": server, "ray": ray})
    assert cfg.server.ingress == server.get("ingress", "auto")
    assert cfg.ingress == want


def test_replace_validates():
    cfg = DeploymentConfig.for_model_dir("/m")
    assert cfg.replace(server={"port": 9000}).server.port == 9000
    with pytest.raises(ConfigFileError, match="server.port"):
        cfg.replace(server={"port": -1})


def test_engine_option_errors_are_the_engines_own():
    """A value set is checked by EngineConfig itself, under the field's location; a check that joins
    two fields names them in the message."""
    with pytest.raises(ConfigFileError, match=r"models\.0\.engine\.step_record_len: must be an integer in \[1, "):
        validate_config({"models": [{"name": "m", "path": "p", "engine": {"step_record_len": 0}}]})
    with pytest.raises(ConfigFileError, match=r"models\.0\.engine: compile_decode: 'on' .* static_decode is 'off'"):
        validate_config({"models": [{"name": "m", "path": "p",
                                     "engine": {"compile_decode": "on", "static_decode": "off"}}]})
    for device in ("cpu", "cuda", "cuda:1"):  # the devices the engine runs on pass
        opts = validate_config({"models": [{"name": "m", "path": "p", "engine": {"device": device}}]})
        assert opts.models[0].engine.device == device
    opts = validate_config({"models": [{"name": "m", "path": "p", "engine": {"step_record_len": 5000}}]})
    assert EngineConfig(**opts.models[0].engine.engine_kwargs()).step_record_len == 5000


def test_deploy_imports_only_the_torch_free_engine_config():
    """deploy/ imports engines.core.config (standard library only) for its engine options, and nothing
    heavy: no torch, numpy, Ray, FastAPI or serving (the schema loads on a laptop)."""
    code = "import sys, deploy, deploy.schema; bad = [m for m in ('serving', 'torch', 'numpy', 'ray', 'fastapi') " \
           "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("engine,match", [
    ({"tensor_parallel_size": 3}, r"models\.0\.engine\.tensor_parallel_size: .*not divisible"),
    ({"pipeline_parallel_size": 3}, r"models\.0\.engine\.pipeline_parallel_size"),
])
def test_parallel_layout_checked_before_start(gpt2_dir, engine, match):
    """A layout the model cannot be split into fails at start, naming the field (tiny gpt2: 4 heads, 2 layers)."""
    from serving.launcher import check_config

    cfg = validate_config({"models": [{"name": "m", "path": str(gpt2_dir), "engine": engine}]})
    with pytest.raises(ConfigFileError, match=match):
        check_config(cfg)
