"""Start and stop the Ray Serve application of a deployment config (the CLI, tests and benchmarks).

`start` starts an embedded local Ray instance (or joins `cfg.ray.address`), runs the application,
and returns once every replica is ready. `stop` drains it (Ray Serve waits up to
server.drain_timeout_s for in-flight requests), stops Ray if we started it, and returns once
the port is free again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from deploy.schema import ConfigFileError, DeploymentConfig
from serving.gateway import hash_key


@dataclass
class Running:
    url: str
    owns_ray: bool
    """True when start() called ray.init (stop() then shuts Ray down; else it only deletes the app)."""
    started_in_s: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each step of start() in order: "ray" (ray.init), "serve" (Ray Serve's controller),
    "application" (the replicas, from creation to ready); a retried start counts its first try in
    "retry"."""


def check_config(cfg: DeploymentConfig) -> None:
    """Everything that can be checked before Ray starts; raises ConfigFileError naming the field."""
    from engines.core.config import ConfigError, EngineConfig
    from serving.placement import UnsupportedConfig, executor_factory, placement

    for i, m in enumerate(cfg.models):
        where = f"models.{i}"
        try:
            EngineConfig(**m.engine.engine_kwargs())
        except ConfigError as exc:
            raise ConfigFileError(f"{where}.engine.{exc}") from None
        p = Path(m.path)
        if not (p / "config.json").is_file():
            raise ConfigFileError(f"{where}.path: {m.path!r} is not a checkpoint directory (no config.json)")
        try:
            placement(m)
            executor_factory(m)
        except UnsupportedConfig as exc:
            raise ConfigFileError(str(exc)) from None
        engine = EngineConfig(**m.engine.engine_kwargs())
        if engine.world_size > 1:
            from engines.core.config import ModelConfig
            from engines.parallel import check_parallel_config

            try:
                check_parallel_config(ModelConfig.from_dir(p), engine.tensor_parallel_size,
                                      engine.pipeline_parallel_size)
            except ConfigError as exc:
                raise ConfigFileError(f"{where}.engine.{exc}") from None


def check_port(cfg: DeploymentConfig) -> None:
    """Fail before Ray starts, naming the field, when server.port is taken."""
    from serving.direct_http import port_in_use

    if cfg.server.port and port_in_use(cfg.server.host, cfg.server.port):
        raise ConfigFileError(f"server.port: {cfg.server.host}:{cfg.server.port} is already in use; "
                              "stop what listens there or choose another port (--port)")


def ray_num_cpus(cfg: DeploymentConfig) -> int:
    """CPUs of the embedded Ray: what the replicas reserve (their largest count), at least 2."""
    if cfg.ray.num_cpus:
        return cfg.ray.num_cpus
    need = 0.0
    for m in cfg.models:
        replicas = m.autoscaling.max_replicas if m.autoscaling else m.replicas
        shards = m.world_size if m.world_size > 1 else 0
        need += replicas * (m.num_cpus + shards * m.shard_num_cpus)
    return max(2, int(-(-need // 1)))


def start(cfg: DeploymentConfig, api_keys: list[str], quiet: bool = True, admin_keys: list[str] = ()) -> Running:
    import importlib

    import ray

    check_config(cfg)
    check_port(cfg)
    t0 = time.monotonic()
    for name in RAY_INIT_IMPORTS:
        importlib.import_module(name)
    # Ray Serve's Python side and our deployments (1-2 s of imports on 2 cores) load on a thread while
    # ray.init starts Ray's processes and mostly waits for them
    preload = threading.Thread(target=_import_serve, name="shardserve-import-serve", daemon=True)
    preload.start()
    level = logging.WARNING if quiet else logging.INFO
    owns_ray = not ray.is_initialized()
    logging.getLogger("ray.serve").setLevel(logging.WARNING if quiet else logging.INFO)
    # An embedded Ray that we start ourselves gets three tries, a pause before each retry: on a loaded
    # host its raylet can miss Ray's fixed 30 s registration wait, or Ray Serve's controller its name
    # lookup (races inside Ray, not problems of the config; CI at load 8 met the first twice in a row).
    # A joined cluster gets one try (not ours to reset).
    attempts = 3 if owns_ray and cfg.ray.address is None else 1
    phases: dict[str, float] = {}
    for attempt in range(1, attempts + 1):
        t = time.monotonic()
        try:
            if owns_ray:
                _init_ray(cfg, level)
            preload.join()
            from ray import serve
            from ray.serve.config import HTTPOptions
            from ray.serve.schema import LoggingConfig

            from serving.deployments import APP_NAME, build_application

            phases["ray"], t = time.monotonic() - t, time.monotonic()
            # quiet: Ray Serve's own replica logs only for errors (its router warns about slow queue-length
            # probes on a busy machine); shardserve's request logs have their own logger and handler
            logs = LoggingConfig(log_level="ERROR" if quiet else "INFO", enable_access_log=not quiet)
            _check_resources(cfg)
            if cfg.ingress != "ray-proxy":  # the Gateway (or colocated model) replicas bind host:port themselves
                serve.start(proxy_location="Disabled", logging_config=logs)
            else:
                serve.start(http_options=HTTPOptions(host=cfg.server.host, port=cfg.server.port,
                                                     request_timeout_s=None, keep_alive_timeout_s=30),
                            logging_config=logs)
            phases["serve"], t = time.monotonic() - t, time.monotonic()
            app = build_application(cfg, [hash_key(k) for k in api_keys], [hash_key(k) for k in admin_keys])
            # not serve.run: it waits for the replicas without a limit (a replica whose start hangs hung
            # `shardserve serve` with no word: CI on 380a0aa); wait_running bounds it and names what is pending
            serve.run_many([serve.RunTarget(app, name=APP_NAME, route_prefix="/", logging_config=logs)],
                           wait_for_applications_running=False)
            wait_running(APP_NAME, t0 + cfg.server.start_timeout_s, since=t0)
            if cfg.ingress == "ray-proxy":
                _wait_http_ready(client_url(cfg), t0 + cfg.server.start_timeout_s)
            phases["application"] = time.monotonic() - t
            break
        except Exception as exc:  # Ray's start races are retried on an embedded Ray
            if attempt == attempts or not _controller_race(exc):
                raise
            logging.getLogger(__name__).warning("Ray Serve did not start (%s); restarting the local Ray (try %d of %d)",
                                                exc, attempt + 1, attempts)
            ray.shutdown()
            if cfg.server.port:
                wait_port_free(f"http://{cfg.server.host}:{cfg.server.port}")
            time.sleep(RETRY_PAUSE_S * attempt)  # let the load that slowed Ray's start pass
            phases = {"retry": time.monotonic() - t0}
    return Running(client_url(cfg), owns_ray and cfg.ray.address is None,
                   time.monotonic() - t0, phases)


RETRY_PAUSE_S = 5.0
"""Seconds before the second start of the embedded Ray (twice that before the third)."""

RAY_INIT_IMPORTS = ("ray._common.usage.usage_lib", "ray.dashboard.optional_deps", "ray.autoscaler._private.util",
                    "ray.autoscaler.v2.utils", "ray._private.runtime_env.uv_runtime_env_hook",
                    "ray._private.thirdparty.pynvml")
"""What ray.init imports on first use (277 modules: aiohttp, grpc, opentelemetry, Ray's usage and
autoscaler code), imported on the main thread before _import_serve's thread starts: with these loaded,
ray.init (Ray 2.60) imports nothing more, so the two threads never import modules at once (a circular
import met from two threads can end in Python's _DeadlockError)."""


class StartTimeout(RuntimeError):
    """The application did not run within server.start_timeout_s; the message names what was pending."""


def wait_running(app_name: str, deadline: float, since: float, poll_s: float = 0.25) -> None:
    """Wait until Ray Serve reports the application RUNNING. Raises RuntimeError when it failed to deploy
    (Ray Serve's message), StartTimeout at `deadline` (time.monotonic) with each deployment still
    starting, its replica states and Ray Serve's message (e.g. a replica whose __init__ is slow or
    stuck); logs the same once a minute while it waits, so a slow start is never silent. Seconds are
    counted from `since` (the start's beginning)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    said = time.monotonic()
    while True:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == ApplicationStatus.RUNNING:
            return
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            raise RuntimeError(f"deploying the application failed: {app.message}")
        waited = time.monotonic() - since
        if time.monotonic() >= deadline:
            raise StartTimeout(f"the application did not start in {waited:.0f} s (server.start_timeout_s): "
                               f"{_pending(app)}")
        if time.monotonic() - said >= 60:
            said = time.monotonic()
            logging.getLogger(__name__).warning("still starting after %.0f s: %s", waited, _pending(app))
        time.sleep(poll_s)


def _pending(app) -> str:
    if app is None:
        return "Ray Serve has not created it yet"
    parts = []
    for name, dep in app.deployments.items():
        if dep.status != "HEALTHY":
            states = ", ".join(f"{n} {state.lower()}" for state, n in sorted(dep.replica_states.items()))
            parts.append(f"{name}: {dep.status.lower()} ({states or 'no replicas yet'})"
                         + (f": {dep.message}" if dep.message else ""))
    return "; ".join(parts) or f"application {app.status.lower()}" + (f": {app.message}" if app.message else "")


def client_url(cfg: DeploymentConfig) -> str:
    """The server's base URL as a client on this host reaches it (a wildcard bind: the loopback)."""
    host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host}:{cfg.server.port}"


def _wait_http_ready(url: str, deadline: float) -> None:
    """Ray Serve's proxy routes to a new application a moment after it runs: wait for its health route."""
    import httpx

    deadline = max(deadline, time.monotonic() + 5.0)
    with httpx.Client(timeout=5.0) as client:
        while True:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise StartTimeout(f"Ray Serve's proxy at {url} did not answer /health within server.start_timeout_s")
            time.sleep(0.1)


def _import_serve() -> None:
    """Import Ray Serve and serving.deployments (the main thread imports them again after ray.init:
    at no cost when this succeeded, with the real error where it failed)."""
    try:
        import ray.serve.config
        import ray.serve.schema  # noqa: F401

        import serving.deployments  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - raised where it matters, by the main thread's import
        logging.getLogger(__name__).debug("background import of Ray Serve failed: %r", exc)


def _controller_race(exc: BaseException) -> bool:
    """Ray's node or Ray Serve's controller did not come up in time on a loaded host (a race inside
    Ray), as opposed to a failure of our config or our replicas."""
    from ray.serve.exceptions import RayServeException

    text = str(exc)
    return ("SERVE_CONTROLLER_ACTOR" in text or "timed out during startup" in text
            or (isinstance(exc, RayServeException) and "no Serve instance" in text))


WORKER_PRELOAD = ("ray.serve._private.replica", "serving.deployments")
"""Modules every worker of the embedded Ray imports as it starts, before it takes work: Ray starts a
worker per CPU ahead (as its driver connects), which a Serve replica (ModelServer, Gateway, MetricsHub)
then takes over; its Ray Serve and shardserve imports (~2 s on 2 cores) are then done while Ray Serve's
controller starts, not between the replica's creation and the model's load. Never torch: the
controller and the gateway run in such workers too."""


EMBEDDED_RAY_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}
"""Settings of the Ray instance `shardserve serve` starts itself (a value the user set wins):
- RAY_worker_niceness: Ray starts its workers (the replicas, the gateway, the shard actors) at nice 15 so that its
  daemons win the CPU; on a host with other work every nice-0 process then takes the engine's cores. The embedded
  instance exists to serve, so its workers keep the caller's priority.
- RAY_SERVE_CONTROL_LOOP_INTERVAL_S: Ray Serve's controller runs its loop every 0.1 s, each a few ms of CPU in the
  controller and the GCS even when nothing changes. Every ms another process takes a core stops the engine's team of
  threads about as long (SmolLM2 fp32 mix, in-process, 2-core EPYC: a 1-ms burst every 10 ms made it 8 % slower);
  at 0.5 s an idle server's controller took 0.67 s of CPU a minute instead of 1.35 and the GCS 0.35 instead of 0.76,
  the start stayed 19 s, and replica state changes are seen up to 0.4 s later."""


def _init_ray(cfg: DeploymentConfig, level: int) -> None:
    import ray

    if cfg.ray.address is None:
        # before ray.init, whose processes inherit them (a cluster's own `ray start` decides for itself)
        for key, value in EMBEDDED_RAY_ENV.items():
            os.environ.setdefault(key, value)
        ray.init(num_cpus=ray_num_cpus(cfg), include_dashboard=False, logging_level=level, log_to_driver=True,
                 _system_config={"preload_python_modules": list(WORKER_PRELOAD)})
    else:
        ray.init(address=cfg.ray.address, logging_level=level, log_to_driver=True)


def _check_resources(cfg: DeploymentConfig) -> None:
    from engines.core.config import ConfigError

    for m in cfg.models:
        if m.world_size > 1:
            from serving.ray_executor import check_cluster_resources

            try:
                check_cluster_resources(
                    m.engine.tensor_parallel_size or 1, m.engine.pipeline_parallel_size or 1,
                    m.autoscaling.max_replicas if m.autoscaling else m.replicas, cpus_per_worker=m.shard_num_cpus,
                    gpus_per_worker=m.shard_num_gpus, replica_cpus=m.num_cpus, replica_gpus=m.num_gpus, model=m.name)
            except ConfigError as exc:
                raise ConfigFileError(str(exc)) from None


def stop(running: Running | None = None) -> None:
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from serving.deployments import APP_NAME

    if not ray.is_initialized():
        return  # the start failed before Ray was up: nothing to drain or stop
    try:
        # drains: Ray Serve stops routing to the replicas and waits for their in-flight requests
        # up to graceful_shutdown_timeout_s (= server.drain_timeout_s) before stopping them
        serve.delete(APP_NAME)
    except RayServeException:
        pass  # no Serve instance (a start that failed before it had one): nothing to drain
    finally:
        if running is None or running.owns_ray:
            ray.shutdown()  # Serve's controller and proxy go with the Ray instance we started
        if running is not None and running.owns_ray and not wait_port_free(running.url):
            logging.getLogger(__name__).warning("%s: the port is still taken 15 s after stopping", running.url)


def wait_port_free(url: str, timeout_s: float = 15.0) -> bool:
    """Wait until nothing listens on the URL's port (a listener's socket closes only when its
    process has exited, which ray.shutdown does not wait for), so that a restart can bind it.
    False if it is still taken after timeout_s."""
    from serving.direct_http import port_in_use

    u = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    while port_in_use(u.hostname, u.port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True

