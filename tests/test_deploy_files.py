"""Deployment files: docker-compose.yml, the Prometheus and Grafana files, the KubeRay RayService and
`shardserve deploy render`. No Docker or Kubernetes here, so: the files parse, reference files that
exist, are what the renderer makes from the one schema, validate against the real RayService CRD
schema and Ray Serve's own config schema, and round-trip to the same deployment config.
promtool checks the Prometheus files and the dashboard's PromQL when it is installed. That the
dashboard's queries name metrics a live server exports: test_serving_ray.py (it has the server)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy.render import TARGETS, config_of, render
from deploy.schema import ConfigFileError, load_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted([*(ROOT / "deploy" / "examples").glob("*.yaml"), ROOT / "deploy/compose/config.yaml",
                   ROOT / "deploy/kuberay/config.yaml"])
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "shardserve.json"
CRD_SCHEMA = ROOT / "deploy" / "kuberay" / "rayservice.crd-schema.json"
PROMTOOL = shutil.which("promtool")


def rendered(rel: str, target: str) -> str:
    return render(load_config(ROOT / rel), target, source=rel)


def strict(schema):
    """The CRD schema as the API server applies it with strict field validation (kubectl's default
    since 1.27): unknown fields are errors, except where the schema preserves unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_validator():
    return jsonschema.Draft7Validator(strict(json.loads(CRD_SCHEMA.read_text())))


# the committed files are the renderer's output (so they never drift from the schema)
@pytest.mark.parametrize(("config", "target", "path"), [
    ("deploy/compose/config.yaml", "compose", "docker-compose.yml"),
    ("deploy/kuberay/config.yaml", "kuberay", "deploy/kuberay/rayservice.yaml")])
def test_committed_files_are_rendered_from_their_config(config, target, path):
    assert (ROOT / path).read_text() == rendered(config, target), \
        f"{path} is stale: shardserve deploy render --config {config} --target {target} -o {path}"


def test_every_example_renders_and_round_trips_through_every_target_it_allows(rayservice_validator):
    from ray.serve.schema import ServeDeploySchema

    rendered_any = {t: 0 for t in TARGETS}
    for example in EXAMPLES:
        cfg = load_config(example)
        for target in TARGETS:
            try:
                text = render(cfg, target)
            except ConfigFileError as exc:  # kuberay / compose need a reachable host: named in the error
                assert re.search(r"server\.(ingress|host)|ray\.address", str(exc)), exc
                continue
            rendered_any[target] += 1
            assert config_of(text, target) == cfg, (example.name, target)
            doc = yaml.safe_load(text)
            if target == "kuberay":
                errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                          for e in rayservice_validator.iter_errors(doc)]
                assert not errors, errors[:5]
                ServeDeploySchema.model_validate(yaml.safe_load(doc["spec"]["serveConfigV2"]))
            elif target == "ray-serve":  # Ray's own schema of `serve deploy` configs
                ServeDeploySchema.model_validate(doc)
    assert all(rendered_any.values()), rendered_any


def test_the_crd_schema_rejects_what_kubernetes_would(rayservice_validator):
    doc = yaml.safe_load(rendered("deploy/kuberay/config.yaml", "kuberay"))
    assert rayservice_validator.is_valid(doc)
    for mutate in (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"),
                   lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"].update(rayStartParams={"num-cpus": 0}),
                   lambda d: d["spec"].update(serveConfig="x"),  # a misspelt field
                   lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="two")):
        bad = copy.deepcopy(doc)
        mutate(bad)
        assert not rayservice_validator.is_valid(bad)


def test_kuberay_worker_pods_hold_one_whole_model_copy():
    cfg = load_config(ROOT / "deploy/kuberay/config.yaml")
    doc = yaml.safe_load(rendered("deploy/kuberay/config.yaml", "kuberay"))
    groups = {g["groupName"]: g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    tp2 = cfg.model("default-tp2")
    g = groups["default-tp2"]
    # the replica's bundle (1 CPU) plus TP=2 shard bundles of 2 CPUs each
    assert g["rayStartParams"]["num-cpus"] == str(int(tp2.num_cpus + 2 * tp2.shard_num_cpus)) == "5"
    assert g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "5000m"
    assert groups["default"]["replicas"] == 2 and groups["default"]["rayStartParams"]["num-cpus"] == "2"
    assert doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


# docker-compose.yml
COMPOSE_SCHEMA = ROOT / "deploy" / "compose" / "compose-spec.schema.json"
"""The Compose Specification's JSON schema, unchanged, from github.com/compose-spec/compose-spec
schema/compose-spec.json at commit 170098ba07d9f53c383a41bfd4c5166b0a4529a6 (Apache-2.0)."""


def test_compose_file_is_valid_by_the_compose_specification():
    v = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]
    assert not errors, errors[:5]
    bad = copy.deepcopy(doc)
    bad["services"]["grafana"]["portz"] = ["3000:3000"]  # a misspelt key is caught
    assert not v.is_valid(bad)


def test_compose_references_files_that_exist_and_ports_that_match():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = doc["services"]
    build = svc["shardserve"]["build"]
    dockerfile = ROOT / build["context"] / build["dockerfile"]
    assert dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():  # every COPY source is in the repository
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", dockerfile.read_text(), re.MULTILINE).group(1))[0]
    assert os.access(ROOT / entry.removeprefix("/app/"), os.X_OK), entry
    named = set(doc["volumes"])
    for name, s in svc.items():
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), (name, src)
            else:
                assert src in named, (name, src)
        for dep in s.get("depends_on", []):
            assert dep in svc
    cfg = config_of((ROOT / "docker-compose.yml").read_text(), "compose")
    assert f"127.0.0.1:{cfg.server.port}:{cfg.server.port}" in svc["shardserve"]["ports"]
    env = svc["shardserve"]["environment"]
    assert env["SHARDSERVE_CONFIG"] == svc["shardserve"]["configs"][0]["target"]
    # Prometheus scrapes the shardserve service on the server's port
    prom = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"shardserve:{cfg.server.port}"] and prom["scrape_configs"][0]["metrics_path"] == "/metrics"


def test_grafana_provisioning_points_at_the_dashboard_and_datasource():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in compose["volumes"] if v.startswith("./"))
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/shardserve.yml").read_text())
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    dash = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    assert uids == {ds["datasources"][0]["uid"]}
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for what in ("first token", "inter-token", "end-to-end", "queue", "tokens per second", "running",
                 "kv-cache", "4xx", "5xx", "429"):
        assert what in titles, what


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [v["definition"] for v in dash["templating"]["list"]]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_prometheus_configs_and_the_dashboard_queries(tmp_path):
    for cfg in ("deploy/prometheus.yml", "deploy/compose/prometheus.yml"):
        r = subprocess.run([PROMTOOL, "check", "config", str(ROOT / cfg)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    # every panel query, as a recording rule: promtool parses its PromQL
    rules = [{"record": f"shardserve:panel{i}", "expr": e.replace("$__rate_interval", "1m").replace(
        "$model", ".*").replace("$replica", ".*")} for i, e in enumerate(dashboard_exprs()[:-2])]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_deploy_render_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "shardserve", "deploy", "render", *args],
                              capture_output=True, text=True, env=env, cwd=ROOT)

    out = tmp_path / "rs.yaml"
    r = cli("--config", "deploy/kuberay/config.yaml", "--target", "kuberay", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (ROOT / "deploy/kuberay/rayservice.yaml").read_text()
    r = cli("--config", "deploy/examples/default.yaml", "--target", "kuberay")
    assert r.returncode == 2 and "server.ingress" in r.stderr and "ray-proxy" in r.stderr
    r = cli("--config", "deploy/examples/default.yaml", "--target", "helm")
    assert r.returncode == 2 and "--target: must be one of ray-serve, kuberay, compose" in r.stderr
    r = cli("--config", "deploy/examples/default.yaml", "--target", "ray-serve")
    assert r.returncode == 0 and config_of(r.stdout, "ray-serve") == load_config(ROOT / "deploy/examples/default.yaml")


def test_a_colocated_config_is_not_rendered_for_a_cluster():
    cfg = validate_config({"models": [{"name": "m", "path": "p"}], "server": {"ingress": "colocated"}})
    with pytest.raises(ConfigFileError, match="server.ingress: colocated"):
        render(cfg, "ray-serve")


def test_the_rendered_import_path_builds_the_application():
    """What `serve deploy` / KubeRay runs: the import_path's builder, given the rendered args."""
    import importlib

    from ray.serve import Application

    doc = yaml.safe_load(rendered("deploy/kuberay/config.yaml", "ray-serve"))
    (app,) = doc["applications"]
    module, _, attr = app["import_path"].partition(":")
    built = getattr(importlib.import_module(module), attr)(app["args"])
    assert isinstance(built, Application)
    with pytest.raises(ConfigFileError, match="args.config"):
        getattr(importlib.import_module(module), attr)({"config": {"models": []}})
