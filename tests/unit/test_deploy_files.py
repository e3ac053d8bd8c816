"""The deployment files a user runs as they are: every config validates, and
cluster/cluster.yaml passes Ray's own cluster-launcher schema."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import REPO_ROOT, Transport, load_config

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path: Path):
    config = load_config(path)
    if config.model.device == "cuda":
        assert config.transport.kv == Transport.NCCL


def test_cluster_yaml_is_a_valid_ray_up_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO_ROOT / "cluster" / "cluster.yaml").read_text())
    validate_config(prepare_config(raw))  # raises on a schema error
    assert any("epd serve" in line or "epd build-model" in line for line in raw["setup_commands"])
