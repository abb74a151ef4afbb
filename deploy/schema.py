"""The deployment config: which models to serve, how, and with what limits (one source of truth).

`shardserve serve --config FILE`, the tuner's emitted configs and the YAML examples in
deploy/examples/ all produce a `DeploymentConfig`. Every model carries engine options by value:
`EngineOptions` is derived from engines.EngineConfig's fields (names, types, checks), so each engine
option, its default and its range are defined once, in engines/core/config.py. deploy/ imports that one
module of engines, which imports the standard library only (no torch; tests/test_deploy_schema.py
pins it), and never serving. An unset engine option means "the engine's own default".

Invalid configs fail at load with messages that name the field, e.g.
`models.0.engine.block_size: must be a positive integer, got 0`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from engines.core.config import ConfigError, EngineConfig

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
"""No "/": the name is one path segment of /v2/models/{name}/..."""


class ConfigFileError(ValueError):
    """A deployment config cannot be read or is invalid; the message names file and field."""


class _Strict(BaseModel):
    # unknown keys are typos: fail instead of silently ignoring them
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf / nan: no field means them


class _EngineOptionsBase(_Strict):
    """Engine options of one model: engines.EngineConfig's fields, each optional (None, unset, keeps
    the engine's default). The fields, their types and their checks are EngineConfig's own: each
    value set is checked by building an EngineConfig with it (an error names the field, e.g.
    `models.0.engine.block_size: must be a positive integer, got 0`), and the set as a whole once
    more for the checks that join fields."""

    @field_validator("*")
    @classmethod
    def _engine_checks_the_value(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            try:
                EngineConfig(**{info.field_name: value})
            except ConfigError as exc:  # "name: message"; the location already names the field
                raise ValueError(str(exc).removeprefix(f"{info.field_name}: ")) from None
        return value

    @model_validator(mode="after")
    def _engine_checks_the_set(self) -> _EngineOptionsBase:
        try:
            EngineConfig(**self.engine_kwargs())
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return self

    def engine_kwargs(self) -> dict[str, Any]:
        """The options that were set, as keyword arguments of engines.EngineConfig."""
        return self.model_dump(exclude_none=True)


def _engine_option_fields() -> dict[str, Any]:
    """(type | None, default None) of every EngineConfig field but `extra` (executor plumbing)."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: (hints[f.name] | None, None) for f in dataclasses.fields(EngineConfig) if f.name != "extra"}


EngineOptions = create_model("EngineOptions", __base__=_EngineOptionsBase, __module__=__name__,
                             __doc__=_EngineOptionsBase.__doc__, **_engine_option_fields())
"""The `engine:` section of a model: derived from engines.EngineConfig (one source of truth)."""


class AutoscalingSpec(_Strict):
    """Ray Serve autoscaling of a model's replicas (instead of a fixed `replicas`)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(32.0, gt=0)
    """Requests per replica the autoscaler aims for."""

    @model_validator(mode="after")
    def _order(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self


class ModelSpec(_Strict):
    """One served model: its checkpoint, copies, engine options and parallel layout."""

    name: str
    """The name clients send as `model` (OpenAI) or in the /v2/models/{name} path."""
    path: str
    """Checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
    replicas: int = Field(1, ge=1)
    """Fixed number of ModelServer replicas (ignored when autoscaling is set)."""
    autoscaling: AutoscalingSpec | None = None
    engine: EngineOptions = EngineOptions()
    # admission and streaming
    max_waiting: int = Field(64, ge=0)
    """Sequences a replica queues beyond engine.max_num_seqs running ones; past it, 429."""
    retry_after_s: int = Field(1, ge=1)
    """Retry-After sent with a 429."""
    ttft_slo_ms: float | None = Field(None, gt=0, le=3_600_000)
    """Time-to-first-token SLO for admission: a replica refuses (429) a request it predicts would
    wait longer than this for its first token (the queue ahead over the measured start rate, and the
    prompts ahead and its own priced by the engine's measured step times), and gives up
    (429, before any stream opens) an admitted one still waiting once it can no longer make it
    (serving/admission.py), so admitted requests keep it under overload. None: count bound only."""
    stream_interval_ms: float = Field(0.0, ge=0, le=1000)
    """Least time between two streamed chunks of one request; tokens in between are sent together.
    0 adapts it to load (see docs/serving.md)."""
    # FP8 weights, CUDA graphs, compiled decode and tp / pp are engine options (engine.weight_dtype, ...)
    num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs reserved by each replica (the driver of its engine)."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved by each replica."""
    shard_num_cpus: float = Field(1.0, ge=0)
    """Ray CPUs per shard worker when engine.tensor_parallel_size x pipeline_parallel_size > 1."""
    shard_num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs per shard worker (1 on GPU nodes) when the model is split."""

    @property
    def world_size(self) -> int:
        """Shard workers of one replica (1: the engine runs in the replica itself)."""
        return (self.engine.tensor_parallel_size or 1) * (self.engine.pipeline_parallel_size or 1)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not MODEL_NAME.match(v):
            raise ValueError("must be 1-128 characters of letters, digits and . _ : -, starting with a "
                             f"letter or digit; got {v!r}")
        return v

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a checkpoint directory")
        return v


class RequestLimits(_Strict):
    """Per-request limits the gateway enforces (400 naming the field beyond them); the ceilings are
    the API's own (n <= 128, 16 stop sequences, 20 logprobs)."""

    max_n: int = Field(128, ge=1, le=128)
    """Completions per prompt (n, best_of)."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Tokens of one prompt; None: up to the model's max_model_len."""
    max_tokens: int | None = Field(None, ge=1)
    """Tokens generated per completion (max_tokens; also the default of a chat that names none, where the
    context has more room); None: up to the model's max_model_len."""
    max_stop: int = Field(16, ge=0, le=16)
    """Stop sequences per request."""
    max_stop_chars: int = Field(256, ge=1)
    """Characters of one stop sequence."""
    max_logprobs: int = Field(20, ge=0, le=20)
    """Alternatives per token in logprobs / top_logprobs (completions also stop at 5, as OpenAI)."""


class ServerSpec(_Strict):
    """The HTTP gateway and its limits."""

    host: str = "127.0.0.1"
    """Interface to bind; the default is reachable from this machine only."""
    port: int = Field(8000, ge=1, le=65535)
    ingress: Literal["auto", "colocated", "direct", "ray-proxy"] = "auto"
    """colocated: the model's replica serves HTTP itself, the gateway's routes on its own event loop
    beside the engine: no Gateway replica, no Ray hop for a request or a streamed chunk, no metrics
    hub (one model, one fixed replica, a local Ray, gateway_replicas 1). direct: each Gateway replica
    serves HTTP itself on host:port (SO_REUSEPORT: a node's gateway replicas share the port) and Ray
    Serve's HTTP proxy is off, one process hop less per request and per streamed chunk; in a cluster
    they run on the head node. ray-proxy: Ray Serve's proxy takes host:port and forwards to the
    gateway replicas (a multi-node cluster where clients reach every node's proxy). auto: colocated
    where it applies, direct elsewhere (`DeploymentConfig.ingress`)."""
    gateway_replicas: int = Field(1, ge=1)
    max_body_bytes: int = Field(1 << 20, gt=0)
    """Largest request body accepted (413 beyond)."""
    limits: RequestLimits = RequestLimits()
    request_timeout_s: float = Field(600.0, gt=0)
    """A request still running after this long is aborted (408)."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On shutdown, in-flight requests get this long to finish before they are aborted."""
    start_timeout_s: float = Field(900.0, gt=0)
    """`shardserve serve` gives up when the application does not run this long after it starts
    (Ray's start, the replicas' model loads included): it names each deployment still starting and
    Ray Serve's message for it, stops Ray and exits 1. A slow start says where it waits once a minute."""
    api_keys_file: str | None = None
    """File of accepted API keys, one per line (# comments). When keys are set, every route but the
    health checks needs `Authorization: Bearer <key>`."""
    api_keys_env: str | None = "SHARDSERVE_API_KEYS"
    """Environment variable with comma-separated API keys (added to the file's); None ignores it."""
    admin_api_keys_file: str | None = None
    """File of admin keys, one per line (# comments), for the admin routes (/v1/ptuning/...). They are
    distinct from the user keys: a user key never opens an admin route. With user keys but no admin
    keys, the admin routes are refused (403); with no keys at all, everything is open."""
    admin_api_keys_env: str | None = "SHARDSERVE_ADMIN_KEYS"
    """Environment variable with comma-separated admin keys (added to the file's); None ignores it."""
    log_requests: bool = True
    """One structured (JSON) log line per request."""
    rate_limit_rps: float | None = Field(None, gt=0)
    """Generation requests per second per API key (per client address without keys), sustained;
    429 with Retry-After beyond. None: no rate limit. Per gateway replica."""
    rate_limit_burst: int = Field(10, ge=1)
    """Requests a key may send at once after being idle (the token bucket's size)."""
    max_concurrent_per_key: int | None = Field(None, ge=1)
    """Generation requests (streams included) one key may have in flight; 429 beyond. None: no limit."""
    metrics_push_interval_s: float = Field(1.0, gt=0, le=60)
    """How often Ray Serve replicas publish their metrics for /metrics (the staleness bound)."""


class RaySpec(_Strict):
    address: str | None = None
    """Ray cluster to join (ray://host:10001 or host:6379); None starts a local one."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the embedded local Ray; None sums what the replicas reserve (at least 2)."""


class DeploymentConfig(_Strict):
    models: list[ModelSpec] = Field(min_length=1)
    server: ServerSpec = ServerSpec()
    ray: RaySpec = RaySpec()

    @model_validator(mode="after")
    def _unique_names(self) -> DeploymentConfig:
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            if m.name in seen:
                raise ValueError(f"models.{i}.name: {m.name!r} is used by two models")
            seen.add(m.name)
        return self

    def colocation_blocker(self) -> str | None:
        """Why the model replica cannot serve HTTP itself (None: it can): the gateway then routes
        between several replicas or models, or runs on a cluster's head node away from the model."""
        if len(self.models) != 1:
            return f"{len(self.models)} models (colocated serves one)"
        m = self.models[0]
        if m.autoscaling is not None or m.replicas != 1:
            return "models.0: more than one replica (colocated serves one: set replicas: 1 without autoscaling)"
        if self.server.gateway_replicas != 1:
            return f"server.gateway_replicas: {self.server.gateway_replicas} (colocated has no Gateway replicas)"
        if self.ray.address is not None:
            return "ray.address: a cluster (colocated binds host:port on the node of the model's replica)"
        return None

    @model_validator(mode="after")
    def _colocated_applies(self) -> DeploymentConfig:
        if self.server.ingress == "colocated" and (why := self.colocation_blocker()) is not None:
            raise ValueError(f"server.ingress: colocated does not apply with {why}; use direct or auto")
        return self

    @property
    def ingress(self) -> str:
        """server.ingress with auto resolved: colocated for one model, one replica, on a local Ray."""
        if self.server.ingress != "auto":
            return self.server.ingress
        return "colocated" if self.colocation_blocker() is None else "direct"

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def replace(self, **changes: Any) -> DeploymentConfig:
        """A validated copy with some top-level sections replaced (configs are never mutated)."""
        return validate_config({**self.model_dump(), **changes})

    @classmethod
    def for_model_dir(cls, model_dir: str, name: str | None = None, **server: Any) -> DeploymentConfig:
        """One model from a checkpoint directory, named after the directory."""
        name = name or Path(model_dir).resolve().name
        return validate_config({"models": [{"name": name, "path": str(model_dir)}], "server": server})


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem, each starting with the dotted path of the field."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see deploy/schema.py)"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "\n".join(lines)


def validate_config(data: Any, source: str = "config") -> DeploymentConfig:
    try:
        return DeploymentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigFileError(f"{source}: invalid deployment config\n{format_validation_error(exc)}") from None


def not_utf8(exc: UnicodeDecodeError) -> str:
    """What a file that is not UTF-8 text gets: where its first bad byte is, so a binary file or
    a file saved in another encoding is told from a typo."""
    return f"not UTF-8 text ({exc.reason} at byte {exc.start})"


def load_config(path: str | Path) -> DeploymentConfig:
    """Read and validate a YAML (or JSON) deployment config. Relative model paths are relative to
    the working directory of `shardserve serve`, like --model."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigFileError(f"{p}: no such config file")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{p}: not valid YAML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{p}: {not_utf8(exc)}") from None
    except OSError as exc:
        raise ConfigFileError(f"{p}: cannot read the config file ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{p}: must hold a mapping with a `models` list")
    return validate_config(data, source=str(p))


def read_api_keys(server: ServerSpec, environ: dict[str, str] | None = None, admin: bool = False) -> list[str]:
    """Keys from server.api_keys_file and server.api_keys_env (admin: the admin_ ones); an empty list
    disables auth."""
    environ = os.environ if environ is None else environ
    prefix = "admin_" if admin else ""
    file, env = getattr(server, f"{prefix}api_keys_file"), getattr(server, f"{prefix}api_keys_env")
    keys: list[str] = []
    if file:
        p = Path(file)
        if not p.is_file():
            raise ConfigFileError(f"server.{prefix}api_keys_file: {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigFileError(f"server.{prefix}api_keys_file: {p}: {not_utf8(exc)}") from None
        except OSError as exc:
            raise ConfigFileError(f"server.{prefix}api_keys_file: {p}: cannot read it ({exc.strerror or exc})") from None
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
        if not keys:
            raise ConfigFileError(f"server.{prefix}api_keys_file: {p} holds no keys")
    if env and environ.get(env):
        keys.extend(k.strip() for k in environ[env].split(",") if k.strip())
    return keys
