"""Serve's replica settings are the truth: a Serve config that overrides the Ingress's
num_replicas or adds autoscaling sets the admission shares, and is refused by name where a
transport needs one replica; a redeploy reconfigures the replicas (the config is their
user_config, under the code's version), and one that replaces them drains them as long as a
request may run (Serve's own deployment config records, no Ray)."""

from __future__ import annotations

import pytest
from ray.serve._private.config import DeploymentConfig
from ray.serve.config import AutoscalingConfig

from cluster import app
from cluster.app import build_app, code_version
from cluster.config import ConfigError, load_config
from cluster.serve_replicas import serve_replicas

OBJECT_STORE = load_config()
GLOO = OBJECT_STORE.replace(transport={"embeddings": "gloo", "kv": "gloo"})


def test_shares_start_from_what_serve_runs():
    assert serve_replicas(OBJECT_STORE, DeploymentConfig(num_replicas=1)) == 1
    assert serve_replicas(OBJECT_STORE, DeploymentConfig(num_replicas=3)) == 3
    scaled = AutoscalingConfig(min_replicas=2, max_replicas=6)
    assert serve_replicas(OBJECT_STORE, DeploymentConfig(autoscaling_config=scaled)) == 2
    scaled = AutoscalingConfig(min_replicas=1, initial_replicas=4, max_replicas=6)
    assert serve_replicas(OBJECT_STORE, DeploymentConfig(autoscaling_config=scaled)) == 4


@pytest.mark.parametrize(
    "serve_side, named",
    [
        (DeploymentConfig(num_replicas=2), "num_replicas: 2"),
        (
            DeploymentConfig(autoscaling_config=AutoscalingConfig(min_replicas=1, max_replicas=3)),
            "autoscaling_config",
        ),
    ],
)
def test_an_override_that_breaks_a_transport_is_refused_by_name(serve_side, named):
    assert serve_replicas(GLOO, DeploymentConfig(num_replicas=1)) == 1
    with pytest.raises(ConfigError, match=f"{named}.*transport gloo needs exactly one"):
        serve_replicas(GLOO, serve_side)


def test_the_app_is_built_with_epds_replicas_and_a_drain_as_long_as_a_request():
    config = OBJECT_STORE.replace(server={"num_replicas": 2}, limits={"request_timeout_s": 300})
    deployment = build_app(config)._bound_deployment._deployment_config
    assert deployment.num_replicas == 2
    # Serve's default (20 s) would cut a long generation short at every redeploy.
    assert deployment.graceful_shutdown_timeout_s >= 300


def test_a_new_config_reaches_the_replicas_as_user_config_under_the_codes_version():
    """What Serve needs to reconfigure running replicas instead of replacing them: the config
    as `user_config` (no constructor arguments) and a version that a new config leaves alone."""
    rotated = OBJECT_STORE.replace(server={"api_key": "sk-new"}, limits={"request_timeout_s": 60})
    built = [build_app(c)._bound_deployment for c in (OBJECT_STORE, rotated)]
    assert [b._deployment_config.user_config for b in built] == [
        c.model_dump(mode="json") for c in (OBJECT_STORE, rotated)
    ]
    assert all(b.init_args == () and b.init_kwargs == {} for b in built)
    assert built[0].version == built[1].version == code_version()


def test_the_code_version_follows_epds_source(tmp_path, monkeypatch):
    """Changed code (a user redeploying after an upgrade) must replace the replicas."""
    for package in app.CODE_PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "mod.py").write_text(f"NAME = {package!r}\n")
    monkeypatch.setattr(app, "REPO_ROOT", tmp_path)
    versions = [app.code_version.__wrapped__()]
    (tmp_path / "router" / "mod.py").write_text("NAME = 'changed'\n")
    versions.append(app.code_version.__wrapped__())
    (tmp_path / "router" / "new.py").write_text("")
    versions.append(app.code_version.__wrapped__())
    assert len(set(versions)) == 3
