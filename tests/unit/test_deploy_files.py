"""The deployment files a user runs as they are: every config validates;
cluster/cluster_local.yaml passes Ray's own cluster-launcher schema and offers the node
types the pinned pools need (cluster/cluster.yaml: tests/unit/test_cluster_yaml.py);
configs/serve.yaml passes Serve's own config schema (the KubeRay RayService that carries
the same application: tests/unit/test_kuberay.py)."""

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
    # Shipped configs use the object store: nccl is not measured across nodes yet and needs a
    # single ingress replica (docs/GPU_CHECKS.md).
    assert config.transport.kv == config.transport.embeddings == Transport.OBJECT_STORE


def test_multi_node_config_serves_a_published_model():
    """Eight GPU nodes answer with a real model, not a random-weight recipe: a Hub repo id in
    the dtype its GPUs have, with two ingress replicas."""
    model = load_config(REPO_ROOT / "configs" / "multi_node.yaml").model
    assert model.is_hub_repo and model.builtin is None and model.dtype == "auto"
    assert load_config(REPO_ROOT / "configs" / "multi_node.yaml").server.num_replicas >= 2


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
    # the v1 autoscaler (v2 never launches local-provider workers), set in the file itself,
    # after ray up's own export of RAY_enable_autoscaler_v2=1
    assert raw["head_start_ray_commands"][-1].startswith("export RAY_enable_autoscaler_v2=0;")
    assert any("./scripts/setup --serve" in c for c in raw["setup_commands"])
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
