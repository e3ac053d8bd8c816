"""The deployment files a user runs as they are: every config validates; cluster/cluster.yaml
and cluster/cluster_local.yaml pass Ray's own cluster-launcher schema and offer the node
types the pinned pools need; configs/serve.yaml and the KubeRay RayService pass Serve's own
config schema and carry the same application."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cluster.app import AppArgs, app_builder
from cluster.config import REPO_ROOT, SERVE_CONFIG, Transport, load_config, repo_configs
from cluster.placement import NodeShape, unplaceable

SERVE_YAML = SERVE_CONFIG
CONFIGS = repo_configs()
CLUSTER = REPO_ROOT / "cluster"


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _ray_up_config(name: str) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _yaml(CLUSTER / name)
    validate_config(prepare_config(raw))  # raises on a schema error
    return raw


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path: Path):
    config = load_config(path)
    if (
        config.model.device == "cuda"
    ):  # nccl between whole GPUs; the object store where workers share one
        expected = (
            Transport.NCCL
            if min(pool.num_gpus for _, pool in config.named_pools()) >= 1
            else Transport.OBJECT_STORE
        )
        assert config.transport.kv == config.transport.embeddings == expected


def test_cluster_yaml_node_types_hold_the_pinned_pools():
    raw = _ray_up_config("cluster.yaml")
    types = raw["available_node_types"]
    assert "GPU" not in types[raw["head_node_type"]]["resources"]
    # the nodes ray up starts (min_workers), enough for every actor of every pool
    workers = [
        NodeShape(name, t["resources"], t["min_workers"])
        for name, t in types.items()
        if t.get("min_workers", 0) > 0
    ]
    assert unplaceable(load_config(REPO_ROOT / "configs" / "multi_node.yaml"), workers) == []


def test_cluster_yaml_sets_nodes_up_from_the_readme_setup():
    raw = _ray_up_config("cluster.yaml")
    assert raw["provider"]["type"] == "aws"
    assert (
        raw["file_mounts"] == {"~/epd": "."} and ".venv" in raw["rsync_exclude"]
    )  # each node builds its own venv
    setup = "\n".join(raw["setup_commands"])
    assert (
        "./scripts/setup" in setup and "epd build-model --config configs/multi_node.yaml" in setup
    )
    assert "torch.cuda.is_available()" in setup  # a GPU node without CUDA torch fails its setup
    # the autoscaler's monitor (head venv) imports boto3 for the AWS provider: the aws extra
    assert any(".[aws]" in c for c in raw["head_setup_commands"])
    extras = __import__("tomllib").loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(dep.startswith("boto3") for dep in extras["aws"])
    assert any(p["FromPort"] == 8000 for p in raw["provider"]["security_group"]["IpPermissions"])


def _start_resources(commands: list[str]) -> dict:
    found = re.search(r"--resources='([^']*)'", " ".join(commands))
    return json.loads(found.group(1)) if found else {}


def test_local_cluster_yaml_offers_what_multi_node_cpu_pins():
    raw = _ray_up_config("cluster_local.yaml")
    assert raw["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": ["127.0.0.2"]}
    assert ".venv" in raw["rsync_exclude"] and any(
        "./scripts/setup" in c for c in raw["setup_commands"]
    )
    assert not any(
        "ray stop" in c for c in raw["worker_start_ray_commands"]
    )  # one host: it would stop the head too
    nodes = [
        NodeShape("head", {"CPU": 2, **_start_resources(raw["head_start_ray_commands"])}),
        NodeShape("worker", {"CPU": 3, **_start_resources(raw["worker_start_ray_commands"])}),
    ]
    assert unplaceable(load_config(REPO_ROOT / "configs" / "multi_node_cpu.yaml"), nodes) == []


def test_serve_yaml_passes_serves_schema_and_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(_yaml(SERVE_YAML))
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is app_builder
    args = AppArgs.model_validate(app.args)
    load_config(REPO_ROOT / args.config)
    with pytest.raises(ValueError, match="extra"):
        AppArgs.model_validate({**app.args, "confg": "typo.yaml"})


def _serve_config_v2() -> tuple[dict, dict]:
    manifest = _yaml(CLUSTER / "kuberay" / "rayservice.yaml")
    return manifest, yaml.safe_load(manifest["spec"]["serveConfigV2"])


def test_rayservice_serves_the_serve_yaml_application():
    from ray.serve.schema import ServeDeploySchema

    manifest, v2 = _serve_config_v2()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    ServeDeploySchema.model_validate(v2)
    expected = _yaml(SERVE_YAML)
    expected["applications"][0]["args"]["config"] = (
        "configs/multi_node.yaml"  # the one difference: the GPU config
    )
    assert v2 == expected


def test_rayservice_worker_groups_hold_the_pinned_pools():
    manifest, v2 = _serve_config_v2()
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == __import__("ray").__version__
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    shapes = []
    for group in cluster["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        custom = json.loads(
            json.loads(group["rayStartParams"]["resources"])
        )  # KubeRay's quoted JSON string
        shapes.append(
            NodeShape(
                group["groupName"],
                {
                    "CPU": float(limits["cpu"]),
                    "GPU": float(limits.get("nvidia.com/gpu", 0)),
                    **custom,
                },
                group["minReplicas"],
            )
        )
    assert (
        unplaceable(load_config(REPO_ROOT / v2["applications"][0]["args"]["config"]), shapes) == []
    )


def test_setup_refuses_a_python_older_than_3_11_by_name(tmp_path):
    """transformers 5 needs 3.11: setup stops at once, naming the interpreter, and builds no
    venv with it. The stand-in answers as a 3.10 interpreter would."""
    import subprocess

    old = tmp_path / "python3.10"
    old.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "Python 3.10.13"; exit 0; fi\n'
        "exit 1  # sys.version_info < (3, 11)\n"
    )
    old.chmod(0o755)
    venv = tmp_path / "venv"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(old), "EPD_VENV": str(venv)}
    done = subprocess.run(
        [str(REPO_ROOT / "scripts" / "setup")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "Python 3.11 or newer, found Python 3.10.13" in done.stderr
    assert not venv.exists()
    assert 'requires-python = ">=3.11"' in (REPO_ROOT / "pyproject.toml").read_text()
