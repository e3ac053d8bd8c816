"""cluster/front_door.py: one choice of front door reaches Serve's controller, its proxies and the
ingress replicas alike, whichever way the app is started."""

from __future__ import annotations

import socket

import pytest
import yaml
from ray.serve.config import ControllerOptions

from cluster.app import AppArgs, build_app
from cluster.config import REPO_ROOT, SERVE_CONFIG, ConfigError, load_config
from cluster.front_door import (
    FrontDoor,
    controller_options,
    free_ports,
    missing_haproxy,
    replica_runtime_env,
    serve_env,
)


def test_haproxy_is_the_default_and_turns_on_serves_direct_ingress() -> None:
    assert load_config().server.front_door is FrontDoor.HAPROXY
    env = serve_env(FrontDoor.HAPROXY)
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) < 30  # Serve's default
    # a request on a reused connection to a replica that just died goes to another one
    assert "empty-response" in env["RAY_SERVE_HAPROXY_RETRY_ON"].split()


def test_serve_proxy_turns_both_off_even_where_the_environment_had_them_on() -> None:
    env = serve_env(FrontDoor.SERVE_PROXY)
    assert env == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


def test_an_unknown_front_door_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server: {front_door: nginx}\n")
    with pytest.raises(ConfigError, match="front_door"):
        load_config(path)


def test_chosen_ports_lie_below_the_kernels_ephemeral_range() -> None:
    """A port from the ephemeral range can be taken by any outgoing connection on the host
    before Serve binds it; below that range only a listener naming it could."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_start = int(f.read().split()[0])
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(20000 <= port < ephemeral_start for port in ports), ports


@pytest.mark.parametrize("door", list(FrontDoor))
def test_controller_options_pass_serves_own_validation(door: FrontDoor) -> None:
    env = ControllerOptions.model_validate(controller_options(door)).runtime_env["env_vars"]
    assert serve_env(door).items() <= env.items()


def test_each_controller_gets_haproxy_ports_of_its_own() -> None:
    """Two Serves on one host (two `epd serve`, a test cluster beside another) must not both
    bind Serve's fixed HAProxy stats and metrics ports."""
    first, second = (
        controller_options(FrontDoor.HAPROXY)["runtime_env"]["env_vars"] for _ in range(2)
    )
    names = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
    ports = [int(env[name]) for env in (first, second) for name in names]
    assert len(set(ports[:2])) == 2 and not {8404, 9101} & set(ports)
    for port in ports[:2]:  # free: this process can bind it
        with socket.socket() as sock:
            sock.bind(("", port))
    assert names[0] not in controller_options(FrontDoor.SERVE_PROXY)["runtime_env"]["env_vars"]


@pytest.mark.parametrize("door", list(FrontDoor))
def test_the_ingress_replicas_carry_the_same_front_door(door: FrontDoor) -> None:
    config = load_config().replace(server={"front_door": door})
    options = build_app(config)._bound_deployment.ray_actor_options
    env = options["runtime_env"]["env_vars"]
    assert env.items() >= serve_env(door).items()  # and the arrival gate where they serve HTTP
    assert options["runtime_env"] == replica_runtime_env(door)
    assert options["num_cpus"] == 0


def test_the_serve_config_gives_the_controller_its_apps_front_door() -> None:
    """serve run / serve deploy / KubeRay: the controller reads the YAML, the replicas the app's
    epd config; a mismatch would leave replicas waiting on a proxy that never calls them."""
    serve_yaml = yaml.safe_load(SERVE_CONFIG.read_text())
    (app,) = serve_yaml["applications"]
    config = load_config(REPO_ROOT / AppArgs.model_validate(app["args"]).config)
    env = serve_yaml["controller_options"]["runtime_env"]["env_vars"]
    assert env == serve_env(config.server.front_door)  # HAProxy's own ports: one Serve a node


def test_a_host_without_haproxy_is_told_which_setting_to_change(monkeypatch) -> None:
    from ray.serve._private import haproxy

    assert missing_haproxy(FrontDoor.HAPROXY) is None  # ray[serve] on Linux brings one
    monkeypatch.setattr(haproxy, "_resolve_haproxy_binary", _no_binary)
    problem = missing_haproxy(FrontDoor.HAPROXY)
    assert "server.front_door: serve_proxy" in problem and "no haproxy here" in problem
    assert missing_haproxy(FrontDoor.SERVE_PROXY) is None


def _no_binary() -> str:
    raise FileNotFoundError("no haproxy here")
