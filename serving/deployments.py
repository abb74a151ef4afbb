"""The Ray Serve application: a Gateway (FastAPI ingress), one ModelServer deployment per model,
and a MetricsHub.

    HTTP -> Gateway replica (validate, tokenize, format) -> DeploymentHandle, streaming
         -> ModelServer replica (ModelCore: admission, engine, coalesced chunks)

HTTP reaches the Gateway replicas directly (server.ingress: direct: each replica runs its own
uvicorn on host:port, serving/direct_http.py) or through Ray Serve's HTTP proxy (server.ingress:
ray-proxy). With one model of one replica on a local Ray (server.ingress: colocated, what auto
picks there) the ModelServer replica serves the gateway's routes itself and there is neither a
Gateway nor a MetricsHub: HTTP -> ModelServer replica (gateway app over a LocalBackend).

A ModelServer replica owns its AsyncLLMEngine. From the model-parallel issue on it also owns
TP x PP shard-worker actors: `placement(spec)` will reserve them as a placement group with the
replica (Ray Serve `placement_group_bundles`, the replica in bundle 0), and `executor_factory(spec)`
will return the Ray executor that drives them inside that group; the engine already takes an
executor factory, so neither ModelCore nor the gateway changes.

Nothing here imports torch at module level: the gateway replica unpickles these classes too.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import pickle
import sys
import time
from typing import Any

from ray import serve

from deploy.schema import DeploymentConfig, ModelSpec, ServerSpec
from serving.metrics import MetricsHub
from serving.placement import UnsupportedConfig, executor_factory, placement  # noqa: F401 - UnsupportedConfig: re-exported
from serving.ptuning_ops import PtuningOp

log = logging.getLogger("shardserve.deploy")
APP_NAME = "shardserve"


def _configure_logging(server: ServerSpec) -> None:
    logger = logging.getLogger("shardserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # Ray Serve's replica logger would prefix and duplicate the JSON lines
    logger.setLevel(logging.INFO if server.log_requests else logging.WARNING)


REPLICA_SWITCH_INTERVAL_S = 0.0005
"""The GIL's switch interval in a ModelServer replica's process (Python's default 5 ms). The engine's loop thread
runs the step's kernels without the GIL and takes it back between them (the prefill's per-layer ops); the event loop
beside it (HTTP, streamed chunks, Ray's handles) can hold it until the interval ends. SmolLM2 fp32 HTTP mix, 64
streams, colocated ingress, 2-core EPYC Zen 4, alternating server starts: 306.8 / 305.0 against 302.1 / 300.8 output
tok/s at 5 ms (BENCHMARKS.md, the SmolLM2 peer section)."""


def prepare_replica_process() -> None:
    """A ModelServer replica's process-wide settings, before its engine starts (REPLICA_SWITCH_INTERVAL_S)."""
    sys.setswitchinterval(REPLICA_SWITCH_INTERVAL_S)


def _process_started() -> float:
    """This process's start, in time.monotonic() seconds (psutil comes with Ray)."""
    import psutil

    return time.monotonic() - (time.time() - psutil.Process().create_time())


class _Publisher:
    """Publishes a registry's metric families to the hub every interval, from inside a replica."""

    def __init__(self, hub: Any, source: str, families, interval_s: float, steps=None):
        self.hub, self.source, self.families, self.interval_s = hub, source, families, interval_s
        self.steps = steps
        """() -> this replica's step window (serving/steps_api.py), sent when it has new steps."""
        self._last_step: object = self  # nothing sent yet: the first window goes out even if empty
        self.task = asyncio.get_running_loop().create_task(self._run())

    def _new_steps(self) -> dict | None:
        if self.steps is None:
            return None
        window = self.steps()
        last = window["rows"][-1][0] if window["rows"] else None  # end_s of its newest step
        if last == self._last_step:
            return None
        self._last_step = last
        return window

    async def _run(self) -> None:
        while True:
            try:
                await self.hub.publish.remote(self.source, self.families(), self._new_steps())
            except Exception as exc:  # noqa: BLE001 - the hub restarts; metrics resume with it
                log.debug("metrics publish failed: %r", exc)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        self.task.cancel()
        try:
            await self.hub.remove.remote(self.source)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.debug("metrics source removal failed: %r", exc)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class MetricsHubDeployment:
    """Exactly one replica: every other replica publishes here, every gateway reads from here."""

    def __init__(self, ttl_s: float = 30.0):
        self.hub = MetricsHub(ttl_s)
        self.steps: dict[str, dict] = {}
        """Latest step window by source (model replicas only)."""

    def publish(self, source: str, families: list, steps: dict | None = None) -> None:
        self.hub.publish(source, families)
        if steps is not None:
            self.steps[source] = steps

    def remove(self, source: str) -> None:
        self.hub.remove(source)
        self.steps.pop(source, None)

    def step_windows(self, model: str) -> list:
        """The latest step window of every live replica of `model` (serving/steps_api.py)."""
        self.hub.snapshot()  # drops the sources silent for ttl_s
        live = set(self.hub.sources())
        for src in [s for s in self.steps if s not in live]:
            del self.steps[src]
        return [w for src, w in self.steps.items() if src.startswith(f"model:{model}:")]

    def snapshot(self, exclude: str | None = None) -> list:
        return self.hub.snapshot(exclude)


def _gateway_options(server: ServerSpec, api_key_hashes, admin_key_hashes, replica: str,
                     behind_ray_proxy: bool = False):
    """The gateway's options in a Ray Serve replica (a Gateway, or a colocated ModelServer)."""
    from serving.gateway import GatewayOptions, rate_limits

    return GatewayOptions(max_body_bytes=server.max_body_bytes, api_key_hashes=frozenset(api_key_hashes),
                          log_requests=server.log_requests, replica=replica,
                          behind_ray_proxy=behind_ray_proxy, admin_key_hashes=frozenset(admin_key_hashes),
                          **rate_limits(server))


@serve.deployment
class ModelServer:
    async def __init__(self, spec: dict, server: dict, hub: Any, ingress: dict | None = None):
        """`ingress` (colocated: {"api_key_hashes": [...], "admin_key_hashes": [...]}): this replica also
        serves the gateway's routes on host:port for its own model, on its own event loop; `hub` is then
        None (its metrics are local)."""
        t0 = time.monotonic()
        prepare_replica_process()
        import torch  # noqa: F401 - timed on its own (the largest import)

        from serving.model_core import ModelCore

        t_import = time.monotonic()

        self.spec = ModelSpec.model_validate(spec)
        self.server = ServerSpec.model_validate(server)
        _configure_logging(self.server)
        replica = serve.get_replica_context().replica_id.unique_id
        self.core = await asyncio.to_thread(ModelCore.load, self.spec, replica, self.server.request_timeout_s,
                                            executor_factory(self.spec))
        self.http = None
        if ingress is not None:
            await self._serve_http(replica, ingress)
        else:
            self.publisher = _Publisher(hub, f"model:{self.spec.name}:{replica}", self.core.metrics.families,
                                        self.server.metrics_push_interval_s, steps=self.core.step_window)
        self.core.ptuning.ensure_watch()  # every replica hot-loads task changes from ptuning/
        # the model, its tokenizer and the app live as long as the replica: out of every later collection (a full
        # one walked them all, ~1 % of the CPU samples of a SmolLM2 prefill on 2 cores)
        gc.collect()
        gc.freeze()
        # where a start's time went: when this constructor began (unix time), how old its process was
        # then (a worker Ray started ahead waits in its pool), the imports, the model's load
        log.info('{"event": "model_ready", "model": "%s", "replica": "%s", "init_at": %.3f, "process_age_s": %.2f, '
                 '"import_s": %.2f, "load_s": %.2f}', self.spec.name, replica, time.time() - (time.monotonic() - t0),
                 t0 - _process_started(), t_import - t0, time.monotonic() - t_import)

    async def _serve_http(self, replica: str, ingress: dict) -> None:
        """Colocated ingress: the gateway app over this replica's engine (serving/backends.LocalBackend),
        served by uvicorn on this replica's event loop (serving/direct_http.py)."""
        from serving.app import build_app
        from serving.backends import LocalBackend
        from serving.direct_http import DirectHTTP
        from serving.gateway import Gateway

        keys, admin = ingress["api_key_hashes"], ingress["admin_key_hashes"]
        options = _gateway_options(self.server, keys, admin, replica)

        async def model_metrics() -> list:
            return [self.core.metrics.families()]

        self.gateway = Gateway({self.spec.name: LocalBackend(self.core)}, options, model_metrics)
        self.http = DirectHTTP(build_app(self.gateway), self.server.host, self.server.port,
                               self.server.drain_timeout_s)
        await self.http.start()

    async def generate(self, req):
        # chunks travel pre-pickled: Ray ships bytes on its fast path, where a dataclass would go
        # through cloudpickle's per-object reducer lookups (measurable per streamed item)
        async for chunk in self.core.generate(req):
            yield pickle.dumps(chunk, protocol=pickle.HIGHEST_PROTOCOL)

    def info(self):
        return self.core.info

    async def ptuning_admin(self, op: PtuningOp):
        """A p-tuning admin operation (serving/ptuning_ops.py) on this replica."""
        return await self.core.ptuning_admin(op)

    def ready(self) -> bool:
        return self.core.ready()

    def check_health(self) -> None:
        # Ray Serve calls this every health_check_period_s; raising marks the replica unhealthy and
        # Ray Serve replaces it (its in-flight requests already failed with 503)
        self.core.check_health()
        if getattr(self, "http", None) is not None:
            self.http.check_health()

    async def __del__(self):
        # Ray Serve has already waited up to graceful_shutdown_timeout_s (= drain_timeout_s) for
        # in-flight requests; whatever is left is aborted here. Colocated, the HTTP server stops
        # accepting first and gives its in-flight requests drain_timeout_s
        if getattr(self, "http", None) is not None:
            await self.http.stop()
        if hasattr(self, "publisher"):
            await self.publisher.stop()
        if hasattr(self, "core"):
            await self.core.shutdown(0.0)


def _answer_ray_errors_as_json(app) -> None:
    """Ray Serve registers plain-text 503 handlers for its routing errors on the ingress app (after
    the app is built, before its lifespan starts); the gateway answers them in its own JSON error
    format instead, with the request's id, like every other error."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from serving.app import error_response
    from serving.wire import ErrorInfo

    async def backpressure(request, exc):
        log.warning("request %s: %s", request.scope.get("state", {}).get("request_id"), exc)
        return error_response(ErrorInfo(429, "rate_limit_error", f"the model server's queue is full ({exc}); "
                                        "retry later", None, "server_overloaded", 1), request.url.path)

    async def unavailable(request, exc):
        return error_response(ErrorInfo(503, "service_unavailable", f"no model server replica is available: {exc}",
                                        None, "engine_unavailable"), request.url.path)

    app.add_exception_handler(BackPressureError, backpressure)
    app.add_exception_handler(DeploymentUnavailableError, unavailable)
    app.middleware_stack = None  # rebuilt with these handlers on the next request


@serve.deployment
@serve.ingress()
class GatewayDeployment:
    async def __init__(self, models: dict[str, Any], server: dict, api_key_hashes: list[str], hub: Any,
                       admin_key_hashes: list[str] = ()):
        from serving.app import build_app
        from serving.backends import RayBackend
        from serving.gateway import Gateway

        server_spec = ServerSpec.model_validate(server)
        _configure_logging(server_spec)
        replica = serve.get_replica_context().replica_id.unique_id
        self.source = f"gateway:{replica}"
        self.hub = hub
        direct = server_spec.ingress == "direct"
        options = _gateway_options(server_spec, api_key_hashes, admin_key_hashes, replica,
                                   behind_ray_proxy=not direct)
        self.gateway = Gateway({name: RayBackend(h, step_windows=functools.partial(self._step_windows, name))
                                for name, h in models.items()}, options, self._remote_metrics)
        # not `self.app`: the ingress wrapper owns that name
        self.fastapi_app = build_app(self.gateway, on_startup=_answer_ray_errors_as_json)
        self.http = None
        if direct:  # this replica serves HTTP itself (serving/direct_http.py)
            from serving.direct_http import DirectHTTP

            self.http = DirectHTTP(self.fastapi_app, server_spec.host, server_spec.port, server_spec.drain_timeout_s)
            await self.http.start()
        self.publisher = _Publisher(hub, self.source, self.gateway.metrics.families,
                                    server_spec.metrics_push_interval_s)

    def __serve_build_asgi_app__(self):
        return self.fastapi_app

    async def _remote_metrics(self) -> list:
        return await self.hub.snapshot.remote(self.source)

    async def _step_windows(self, model: str) -> list:
        return await self.hub.step_windows.remote(model)

    def check_health(self) -> None:
        if self.http is not None:
            self.http.check_health()

    async def __del__(self):
        if getattr(self, "http", None) is not None:
            await self.http.stop()  # stops accepting; in-flight requests get drain_timeout_s
        if hasattr(self, "publisher"):
            await self.publisher.stop()


HEAD_NODE = "node:__internal_head__"  # Ray's resource on the head node only


def build_application(cfg: DeploymentConfig, api_key_hashes: list[str], admin_key_hashes: list[str] = (),
                      ingress: str | None = None):
    """The bound Ray Serve application of a deployment config (run it with serve.run). `ingress`:
    server.ingress resolved (default `cfg.ingress`); colocated binds the one ModelServer alone."""
    from engines.core.config import EngineConfig

    ingress = ingress or cfg.ingress
    server = {**cfg.server.model_dump(), "ingress": ingress}  # what the replicas read: resolved
    colocated = ingress == "colocated"
    # the hub always has publish calls in flight, and losing one at shutdown costs nothing; it holds
    # every replica's metrics, so it lives on the head node, which a cluster does not lose. Colocated
    # has none: its one replica answers /metrics itself (each Ray actor costs an idle core a few %)
    hub = None if colocated else MetricsHubDeployment.options(
        name="MetricsHub", num_replicas=1, graceful_shutdown_timeout_s=0.5, graceful_shutdown_wait_loop_s=0.1,
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE: 0.001}}).bind(
        max(30.0, 10 * cfg.server.metrics_push_interval_s))
    models = {}
    for spec in cfg.models:
        max_num_seqs = EngineConfig(**spec.engine.engine_kwargs()).max_num_seqs
        # Ray admits a little more than the replica's own bound, so the replica (not Ray's queue)
        # answers 429. The router's queue also holds requests while it picks a replica (it probes
        # their queue lengths): sized for a burst of the deployment's whole admission capacity, so
        # only a full model is refused, never one whose router is merely busy
        replicas = spec.autoscaling.max_replicas if spec.autoscaling is not None else spec.replicas
        options: dict[str, Any] = dict(
            name=f"ModelServer:{spec.name}", max_ongoing_requests=max_num_seqs + spec.max_waiting + 8,
            max_queued_requests=max(1, spec.max_waiting) + replicas * (max_num_seqs + spec.max_waiting),
            health_check_period_s=2.0, health_check_timeout_s=30.0,
            graceful_shutdown_timeout_s=cfg.server.drain_timeout_s, graceful_shutdown_wait_loop_s=0.25,
            **placement(spec))
        executor_factory(spec)  # fail at start, not in a replica, on a field a later issue brings
        if spec.autoscaling is not None:
            a = spec.autoscaling
            options["autoscaling_config"] = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                                             "target_ongoing_requests": a.target_ongoing_requests}
        else:
            options["num_replicas"] = spec.replicas
        if colocated:  # the replica owns host:port, as a direct Gateway replica would (it runs on this node)
            return ModelServer.options(**options).bind(spec.model_dump(), server, None, {
                "api_key_hashes": sorted(api_key_hashes), "admin_key_hashes": sorted(admin_key_hashes)})
        models[spec.name] = ModelServer.options(**options).bind(spec.model_dump(), server, hub)
    gateway_actor: dict[str, Any] = {"num_cpus": 0}
    if ingress == "direct":
        # the replicas own host:port, so they run where `shardserve serve` binds it: on the head node.
        # Spread over a cluster, a replica on a worker node would listen on that node, and losing
        # the node would cut every connection it held (not answer them with 503).
        gateway_actor["resources"] = {HEAD_NODE: 0.001}
    # the drain's wait loop as the model's: Ray Serve sleeps one loop before it first counts a replica's ongoing
    # requests, and at its default of 2 s every stop (serve.delete, Ctrl-C) waited 2 s on an idle Gateway after
    # the model replicas were gone (4.9 s stops of tests/test_serving_ray.py's app, the Gateway last by 2.0 s)
    return GatewayDeployment.options(
        name="Gateway", num_replicas=cfg.server.gateway_replicas, max_ongoing_requests=100_000,
        ray_actor_options=gateway_actor, graceful_shutdown_timeout_s=cfg.server.drain_timeout_s,
        graceful_shutdown_wait_loop_s=0.25,
    ).bind(models, server, sorted(api_key_hashes), hub, sorted(admin_key_hashes))


def app_builder(args: dict[str, Any]):
    """Ray Serve application builder (`import_path: serving.deployments:app_builder`, as rendered by
    `shardserve deploy render --target ray-serve|kuberay`): `args.config` is a deployment config;
    API and admin keys come from the config's key files / environment on the node that builds it."""
    from deploy.schema import read_api_keys, validate_config
    from serving.gateway import hash_key

    cfg = validate_config(args.get("config"), source="args.config")
    # a config file deployed onto a cluster of unknown shape: auto means direct (Gateway replicas on the head)
    return build_application(cfg, [hash_key(k) for k in read_api_keys(cfg.server)],
                             [hash_key(k) for k in read_api_keys(cfg.server, admin=True)],
                             ingress="direct" if cfg.server.ingress == "auto" else cfg.server.ingress)
