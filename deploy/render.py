"""Deployment files rendered from one DeploymentConfig: a Ray Serve config, a KubeRay RayService
and a docker-compose file. Pure functions of the schema (no Ray, no Kubernetes client), so what is
deployed anywhere is the config `shardserve serve --config` runs, and each rendering carries that
config whole (`config_of` reads it back: the round trip is lossless).

- ray-serve: the `serve deploy` / `serve run` config format. One application whose builder,
  `serving.deployments:app_builder`, takes the deployment config as its `args.config`.
- kuberay: a RayService (ray.io/v1) whose `serveConfigV2` is that Serve config; a head group
  (gateway, metrics hub, Serve controller and proxy; no CPUs for model replicas) and one worker
  group per model, each worker pod sized for one whole model copy: the replica's bundle plus its
  TP x PP shard bundles, so Ray's PACK placement keeps a copy on one pod.
- compose: docker-compose.yml: the shardserve container (Ray head + `shardserve serve`), Prometheus
  and Grafana with the files under deploy/.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import yaml

from deploy.schema import ConfigFileError, DeploymentConfig, ModelSpec, validate_config

Target = Literal["ray-serve", "kuberay", "compose"]
TARGETS: tuple[str, ...] = ("ray-serve", "kuberay", "compose")
APP_NAME = "shardserve"
APP_BUILDER = "serving.deployments:app_builder"
CONFIG_IN_CONTAINER = "/etc/shardserve/config.yaml"
MODELS_IN_CONTAINER = "/app/models"


def config_dict(cfg: DeploymentConfig) -> dict[str, Any]:
    """The config as plain data, only what differs from the defaults (validating it gives `cfg`)."""
    return cfg.model_dump(mode="json", exclude_defaults=True)


def serve_config(cfg: DeploymentConfig) -> dict[str, Any]:
    """A Ray Serve config file (the schema of `serve deploy`) that runs `cfg`."""
    _require(cfg.server.ingress != "colocated", "server.ingress: colocated serves from the model's replica on the "
             "node that runs `shardserve serve`; a Ray Serve config file goes to a cluster: use auto, direct or ray-proxy")
    proxy = cfg.server.ingress == "ray-proxy"
    return {
        "proxy_location": "EveryNode" if proxy else "Disabled",
        "http_options": {"host": cfg.server.host, "port": cfg.server.port, "keep_alive_timeout_s": 30},
        "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": APP_BUILDER,
                          "args": {"config": config_dict(cfg)}}],
    }


def _dns_name(name: str) -> str:
    """A Kubernetes object name (RFC 1123 label) from a model name."""
    s = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    return (s or "model")[:40]


def copy_resources(spec: ModelSpec) -> tuple[float, float]:
    """(CPUs, GPUs) of one model copy: the replica plus, for a split model, its TP x PP shards."""
    shards = spec.world_size if spec.world_size > 1 else 0
    return spec.num_cpus + shards * spec.shard_num_cpus, spec.num_gpus + shards * spec.shard_num_gpus


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigFileError(msg)


def _container(image: str, cpus: float, gpus: float, memory: str, keys_env: str | None,
               ports: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = f"{math.ceil(cpus * 1000)}m" if cpus else "500m"  # the Ray processes need some CPU
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = math.ceil(gpus)
    c: dict[str, Any] = {"name": "ray", "image": image, "resources": {"requests": dict(limits), "limits": limits},
                         "volumeMounts": [{"name": "models", "mountPath": MODELS_IN_CONTAINER, "readOnly": True}]}
    if ports:
        c["ports"] = ports
    if keys_env:  # API keys from a Secret; optional, so a cluster without it serves without keys
        c["env"] = [{"name": keys_env, "valueFrom": {"secretKeyRef": {
            "name": "shardserve-api-keys", "key": "keys", "optional": True}}}]
    return c


def _pod(container: dict[str, Any], models_pvc: str) -> dict[str, Any]:
    return {"spec": {"containers": [container], "volumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": models_pvc, "readOnly": True}}]}}


def rayservice(cfg: DeploymentConfig, image: str = "shardserve:latest", name: str = "shardserve",
               models_pvc: str = "shardserve-models", worker_memory: str = "8Gi", ray_version: str = "2.60.0"
               ) -> dict[str, Any]:
    """A KubeRay RayService (ray.io/v1) serving `cfg`. Model paths are read inside the pods, relative
    to /app (the image's working directory); the `models` PersistentVolumeClaim is mounted at
    /app/models. API keys: the optional Secret `shardserve-api-keys` (key `keys`, comma-separated)."""
    s = cfg.server
    _require(s.ingress == "ray-proxy", "server.ingress: KubeRay sends traffic to Ray Serve's proxy on each "
             "pod (the RayService's serve Service); set it to ray-proxy")
    _require(s.host == "0.0.0.0", f"server.host: must be 0.0.0.0 in a pod (Kubernetes Services reach pods on "
             f"their pod IP); got {s.host!r}")
    _require(cfg.ray.address is None, "ray.address: a RayService brings its own Ray cluster; leave it unset")
    workers = []
    for spec in cfg.models:
        cpus, gpus = copy_resources(spec)
        a = spec.autoscaling
        lo, hi = (a.min_replicas, a.max_replicas) if a else (spec.replicas, spec.replicas)
        params = {"num-cpus": str(math.ceil(cpus))}
        if gpus:
            params["num-gpus"] = str(math.ceil(gpus))
        workers.append({
            "groupName": _dns_name(spec.name), "replicas": lo, "minReplicas": lo, "maxReplicas": hi,
            "rayStartParams": params,
            "template": _pod(_container(image, cpus, gpus, worker_memory, s.api_keys_env, []), models_pvc)})
    head_ports = [{"name": "gcs", "containerPort": 6379}, {"name": "dashboard", "containerPort": 8265},
                  {"name": "serve", "containerPort": s.port}]
    head = {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},  # no model replicas on the head
            "template": _pod(_container(image, 0, 0, "4Gi", s.api_keys_env, head_ports), models_pvc)}
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService", "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(cfg), sort_keys=False),
            "rayClusterConfig": {"rayVersion": ray_version, "enableInTreeAutoscaling": any(
                m.autoscaling for m in cfg.models), "headGroupSpec": head, "workerGroupSpecs": workers},
        },
    }


def _escape_compose(text: str) -> str:
    return text.replace("$", "$$")  # compose interpolates ${VAR} inside inline config content


def compose(cfg: DeploymentConfig, image: str = "shardserve:latest") -> dict[str, Any]:
    """docker-compose.yml for `cfg`: shardserve (Ray head + gateway + model servers, the default model
    built on first start into the `models` volume), Prometheus and Grafana. Ports are published on
    the host's 127.0.0.1 only; change the mappings to expose them."""
    s = cfg.server
    _require(s.host == "0.0.0.0", f"server.host: must be 0.0.0.0 inside a container (the published port "
             f"reaches the container's interface, not its loopback); got {s.host!r}")
    _require(cfg.ray.address is None, "ray.address: the container starts its own Ray head; leave it unset")
    need = sum((m.autoscaling.max_replicas if m.autoscaling else m.replicas) * copy_resources(m)[0]
               for m in cfg.models)
    cpus = cfg.ray.num_cpus or max(2, math.ceil(need))
    env = {"SHARDSERVE_CONFIG": CONFIG_IN_CONTAINER, "RAY_NUM_CPUS": str(cpus)}
    if s.api_keys_env:
        env[s.api_keys_env] = f"${{{s.api_keys_env}:-}}"
    return {
        "name": "shardserve",
        "services": {
            "shardserve": {
                "build": {"context": ".", "dockerfile": "Dockerfile"}, "image": image,
                "environment": env,
                "configs": [{"source": "shardserve-config", "target": CONFIG_IN_CONTAINER}],
                "volumes": ["models:/app/models", "data:/app/data", "runs:/app/runs"],
                "ports": [f"127.0.0.1:{s.port}:{s.port}", "127.0.0.1:8265:8265"],
                "shm_size": "2gb",  # Ray's object store lives in /dev/shm
                "stop_grace_period": f"{math.ceil(s.drain_timeout_s) + 10}s",
                "healthcheck": {
                    "test": ["CMD", "python", "-c", (f"import urllib.request; urllib.request.urlopen("
                             f"'http://127.0.0.1:{s.port}/health', timeout=5)")],
                    "interval": "10s", "timeout": "6s", "retries": 3,
                    # the server gives up by itself past server.start_timeout_s (the first start builds the default model)
                    "start_period": f"{math.ceil(s.start_timeout_s)}s"},
            },
            "prometheus": {
                "image": "prom/prometheus:v2.53.0",
                "volumes": ["./deploy/compose/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
                            "prometheus:/prometheus"],
                "ports": ["127.0.0.1:9090:9090"], "depends_on": ["shardserve"],
            },
            "grafana": {
                "image": "grafana/grafana:11.1.0",
                "environment": {"GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer",
                                "GF_SECURITY_ADMIN_PASSWORD": "${GRAFANA_ADMIN_PASSWORD:-admin}",
                                "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH":
                                    "/var/lib/grafana/dashboards/shardserve.json"},
                "volumes": ["./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
                            "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro", "grafana:/var/lib/grafana"],
                "ports": ["127.0.0.1:3000:3000"], "depends_on": ["prometheus"],
            },
        },
        "configs": {"shardserve-config": {"content": _escape_compose(yaml.safe_dump(config_dict(cfg),
                                                                                    sort_keys=False))}},
        "volumes": {"models": {}, "data": {}, "runs": {}, "prometheus": {}, "grafana": {}},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded configs) as literal blocks, readable in the file."""


_Dumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


HEADER = {
    "ray-serve": "# Ray Serve config (serve deploy / serve run) rendered from a shardserve deployment config:\n",
    "kuberay": "# KubeRay RayService rendered from a shardserve deployment config:\n",
    "compose": "# docker compose up: shardserve + Prometheus + Grafana. Rendered from a deployment config:\n",
}


def render(cfg: DeploymentConfig, target: str, source: str = "", **options: Any) -> str:
    """The YAML text of `target` for `cfg` (with a header naming how it was made)."""
    if target == "ray-serve":
        doc = serve_config(cfg)
    elif target == "kuberay":
        doc = rayservice(cfg, **options)
    elif target == "compose":
        doc = compose(cfg, **options)
    else:
        raise ConfigFileError(f"--target: must be one of {', '.join(TARGETS)}; got {target!r}")
    how = f"#   shardserve deploy render --config {source} --target {target}\n" if source else ""
    return HEADER[target] + how + "# Edit the deployment config and render again rather than editing this file.\n" + \
        yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=110)


def config_of(text: str, target: str) -> DeploymentConfig:
    """The deployment config a rendered file carries (the inverse of `render`)."""
    doc = yaml.safe_load(text)
    if target == "kuberay":
        doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    if target in ("ray-serve", "kuberay"):
        (app,) = [a for a in doc["applications"] if a["name"] == APP_NAME]
        return validate_config(app["args"]["config"], source=f"{target} applications.{APP_NAME}.args.config")
    if target == "compose":
        content = doc["configs"]["shardserve-config"]["content"].replace("$$", "$")
        return validate_config(yaml.safe_load(content), source="compose configs.shardserve-config")
    raise ConfigFileError(f"--target: must be one of {', '.join(TARGETS)}; got {target!r}")
