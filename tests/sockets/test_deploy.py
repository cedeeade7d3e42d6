"""The deployment files: Prometheus config and rules (promtool), the Grafana dashboard (generated
from code, importable), and the Ray / KubeRay manifests against the config and placement."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import yaml

from pdserve_core.config import PDServeConfig, parse_config
from tests.conftest import REPO

PROMETHEUS = REPO / "deploy/prometheus"
POOL_RESOURCES = {"prefill": "prefill_pool", "decode": "decode_pool"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=PROMETHEUS)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done


def test_promtool_checks_config_rules_and_rule_tests():
    promtool("check", "config", "prometheus.yml")
    rules = sorted(str(p.relative_to(PROMETHEUS)) for p in (PROMETHEUS / "rules").glob("*.yml"))
    assert len(rules) == 2
    promtool("check", "rules", *rules)
    tested = promtool("test", "rules", "tests/pdserve-rules.test.yml")
    assert "SUCCESS" in tested.stdout


def _generator():
    path = REPO / "deploy/grafana/generate.py"
    spec = importlib.util.spec_from_file_location("pdserve_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dashboard_json_is_what_the_generator_writes():
    generator = _generator()
    assert generator.OUT.read_text() == generator.render(), "run deploy/grafana/generate.py"


def test_dashboard_is_importable_and_shows_both_pools_side_by_side():
    board = json.loads((REPO / "deploy/grafana/dashboards/pdserve-pool-balance.json").read_text())
    assert board["title"] == "pdserve — pool balance"
    assert [v["type"] for v in board["templating"]["list"]] == ["datasource"]
    panels = [p for p in board["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"] for p in panels).lower()
    for topic in ("compute", "bandwidth", "balance", "waiting", "kv transfer", "first token",
                  "inter-token", "outcomes"):  # fmt: skip
        assert topic in titles, topic
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    per_pool = [p for p in panels if any("{{pool}}" in t["legendFormat"] for t in p["targets"])]
    assert len(per_pool) >= 8


def test_grafana_provisioning_points_at_the_dashboard_folder():
    base = REPO / "deploy/grafana/provisioning"
    source = yaml.safe_load((base / "datasources/pdserve.yml").read_text())["datasources"][0]
    assert source["type"] == "prometheus"
    provider = yaml.safe_load((base / "dashboards/pdserve.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]


def _cluster_config(text: str) -> PDServeConfig:
    data = yaml.safe_load(text)
    assert data["model"].startswith("/models/")  # a host path; validated on the cluster
    return parse_config({**data, "model": "default"})


def _check_host(pool: str, config: PDServeConfig, resources: dict, min_hosts: int) -> None:
    """A host type advertising `pool` has room for whole engines of it, and the minimum number
    of such hosts holds every replica the config asks for."""
    spec = getattr(config.pools, pool)
    need = spec.resources[POOL_RESOURCES[pool]]
    per_host = int(resources[POOL_RESOURCES[pool]] // need)
    assert per_host >= 1
    assert resources.get("GPU", 0) >= per_host * spec.num_gpus, (pool, resources)
    assert resources.get("CPU", float("inf")) >= per_host * spec.num_cpus, (pool, resources)
    assert min_hosts * per_host >= spec.replicas, f"{pool}: {min_hosts} hosts × {per_host}"


def test_local_placement_uses_the_pool_resources_the_manifests_declare():
    defaults = PDServeConfig().pools
    assert set(defaults.prefill.resources) == {POOL_RESOURCES["prefill"]}
    assert set(defaults.decode.resources) == {POOL_RESOURCES["decode"]}
    serve_source = (REPO / "pdserve/serve.py").read_text()
    for name in POOL_RESOURCES.values():
        assert f'"{name}"' in serve_source  # the local Ray advertises the same names


def test_ray_cluster_launcher_has_a_worker_type_per_pool():
    config = _cluster_config((REPO / "deploy/config/cluster-gpu.yaml").read_text())
    assert config.mode == "disaggregated" and config.ray.address
    assert config.kv_transfer.transport == "nccl" and config.kv_transfer.host == "0.0.0.0"
    launcher = yaml.safe_load((REPO / "deploy/ray/pdserve-cluster.yaml").read_text())
    types = launcher["available_node_types"]
    head = types[launcher["head_node_type"]]
    assert not set(head["resources"]) & set(POOL_RESOURCES.values()), "no engine on the head"
    for pool, resource in POOL_RESOURCES.items():
        hosts = [t for t in types.values() if resource in t.get("resources", {})]
        assert len(hosts) == 1, f"one worker type advertises {resource}"
        host = hosts[0]
        assert host["max_workers"] >= host["min_workers"] >= 1
        _check_host(pool, config, host["resources"], host["min_workers"])
    assert any("ray start --head" in c for c in launcher["head_start_ray_commands"])
    assert not any("ray stop" in c for c in launcher["head_start_ray_commands"])


def _ray_resources(params: dict) -> dict:
    """rayStartParams' `resources` is a JSON object inside a quoted string."""
    text = params.get("resources", '"{}"')
    value = json.loads(text)
    return json.loads(value) if isinstance(value, str) else value


def test_kuberay_cluster_has_a_worker_group_per_pool():
    documents = list(yaml.safe_load_all((REPO / "deploy/kuberay/raycluster.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    assert set(kinds) == {"ConfigMap", "RayCluster", "Service"}
    config = _cluster_config(kinds["ConfigMap"]["data"]["pdserve.yaml"])
    cluster = kinds["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"].startswith("2.60")
    head = cluster["spec"]["headGroupSpec"]
    assert not set(_ray_resources(head["rayStartParams"])) & set(POOL_RESOURCES.values())
    head_command = " ".join(head["template"]["spec"]["containers"][0]["args"])
    assert "pdserve serve --config" in head_command
    router_port = config.router.http_port
    service_ports = {p["port"] for p in kinds["Service"]["spec"]["ports"]}
    assert router_port in service_ports
    assert kinds["Service"]["spec"]["selector"] == head["template"]["metadata"]["labels"]
    groups = cluster["spec"]["workerGroupSpecs"]
    for pool, resource in POOL_RESOURCES.items():
        matching = [g for g in groups if resource in _ray_resources(g["rayStartParams"])]
        assert len(matching) == 1, f"one worker group advertises {resource}"
        group = matching[0]
        container = group["template"]["spec"]["containers"][0]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert int(group["rayStartParams"]["num-gpus"]) == gpus
        cpus = float(container["resources"]["limits"]["cpu"])
        resources = {**_ray_resources(group["rayStartParams"]), "GPU": gpus, "CPU": cpus}
        _check_host(pool, config, resources, group["minReplicas"])


def test_cluster_files_turn_on_ray_auth_keep_the_dashboard_local_and_ship_no_key():
    launcher = yaml.safe_load((REPO / "deploy/ray/pdserve-cluster.yaml").read_text())
    starts = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in command for command in starts)
    assert "--dashboard-host=127.0.0.1" in launcher["head_start_ray_commands"][0]
    documents = list(yaml.safe_load_all((REPO / "deploy/kuberay/raycluster.yaml").read_text()))
    ray_cluster = next(d for d in documents if d["kind"] == "RayCluster")
    assert ray_cluster["spec"]["authOptions"] == {"mode": "token"}
    assert ray_cluster["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for path in (REPO / "deploy/config").glob("*.yaml"):
        config = yaml.safe_load(path.read_text()) or {}
        assert not (config.get("router") or {}).get("api_key"), f"{path.name} ships an API key"
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    assert "api_key" not in config_map["data"]["pdserve.yaml"]
