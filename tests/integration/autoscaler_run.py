"""epd's encoder autoscaling with Ray's own autoscaler, on this machine, in a process of its own.

A head node (prefill, decode, the ingress) and Ray's autoscaler (v2) with the fake multi-node
provider, whose one worker node type, `encoder_node` (one node at least, two at most), it
launches as raylets on this machine: the first at once, the second when an actor asks for it.
The encoder pool asks for `encoder_node: 1` per worker and autoscales between 1 and 2
workers; the encoder is slowed (a sleep per step) so a few clients keep it busy.

An image burst grows the pool to 2: the new worker is pending until the autoscaler has
launched a second node for it. After the burst the pool drains back to 1, and the autoscaler
releases the idle node. Prints one JSON line: every answer, the encoder nodes and pool sizes
seen over time. tests/integration/test_ray_autoscaler.py checks it.

    python -m tests.integration.autoscaler_run PORT
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

NODE_TYPE = "encoder_node"


def autoscaler_config(gcs_address: str, head_cpus: int) -> dict:
    """Ray's cluster config for the fake multi-node provider (its fields as `ray up`'s)."""
    return {
        "cluster_name": "epd-autoscaler-check",
        "max_workers": 2,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "provider": {
            # The fake multi-node provider as an external module: the wheel lacks the
            # defaults file its built-in type loads.
            "type": "external",
            "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "launch_multiple": True,
            "head_node_id": FAKE_HEAD_NODE_ID,
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": {"CPU": head_cpus},
                "node_config": {},
                "max_workers": 0,
            },
            NODE_TYPE: {
                "resources": {"CPU": 1, NODE_TYPE: 1},
                "node_config": {},
                "min_workers": 1,  # the pool's floor: its first worker's node
                "max_workers": 2,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {"ssh_user": "ubuntu"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def encoder_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"] and NODE_TYPE in n["Resources"])


def verbose_health(root: str, within_s: float = 60.0) -> dict:
    """/health?verbose=1's JSON. Just after the app is ready the front door may still answer
    for it (its own 503 page, before its check finds the replica up): asked again until then."""
    import httpx

    deadline = time.monotonic() + within_s
    while True:
        answer = httpx.get(f"{root}/health", params={"verbose": 1}, timeout=30)
        if answer.headers.get("content-type", "").startswith("application/json"):
            return answer.json()
        assert time.monotonic() < deadline, f"/health answered {answer.status_code}: {answer.text}"
        time.sleep(0.5)


def pool_view(root: str) -> dict:
    """What /health?verbose=1 and /metrics say of the encoder pool now."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    health = verbose_health(root)
    second = health["workers"]["encoder"][1]
    metrics = text_string_to_metric_families(httpx.get(f"{root}/metrics", timeout=30).text)
    return {
        "pool": health["fleet"]["pools"]["encoder"],
        "second": second.get("slot") or ("encoded" if second.get("num_batches") else "idle"),
        "pool_workers": {
            s.labels["state"]: s.value
            for family in metrics
            if family.name == "epd:pool_workers"
            for s in family.samples
            if s.labels["kind"] == "encoder"
        },
    }


class Watch:
    """Encoder nodes and the encoder pool (routed, starting) over time, every 0.5 s."""

    def __init__(self, root: str):
        self.root, self.seen, self._stop = root, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:

        t0 = time.monotonic()
        while not self._stop.wait(0.5):
            pool = verbose_health(self.root)
            pool = pool["fleet"]["pools"]["encoder"]
            self.seen.append([round(time.monotonic() - t0, 1), encoder_nodes(), pool["routed"]])

    def until(self, condition, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if self.seen and condition(*self.seen[-1][1:]):
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(root: str, model: str) -> dict:
    """The burst and the drain, with the pool as the endpoints show it at each step."""
    from tests.integration.burst import burst_until

    views, watch = {"before": pool_view(root)}, Watch(root)

    def grown() -> bool:  # two routed and the new worker has encoded part of the burst
        views["grown"] = pool_view(root)
        return views["grown"]["second"] == "encoded" and views["grown"]["pool"]["routed"] == 2

    answers = burst_until(root, model, grown, within_s=240)
    drained = watch.until(lambda nodes, routed: routed == 1, within_s=90)
    released = watch.until(lambda nodes, routed: nodes == 1, within_s=120)
    watch.stop()
    views["after"] = pool_view(root)
    return {
        "answers": answers,
        "seen": watch.seen,
        "drained": drained,
        "released": released,
        "views": views,
    }


def main(port: int) -> None:
    import ray
    from ray import serve
    from ray._private.services import get_node_ip_address
    from ray.cluster_utils import Cluster

    from cluster.cli import start
    from cluster.config import builtin_model, load_config
    from cluster.prepare import ensure_model
    from tests.background import free_port
    from tests.integration.burst import SCALING

    config = load_config().replace(
        model=builtin_model("tiny-llava"),
        encoder={
            "resources": {NODE_TYPE: 1},
            "slowdown": [10.0, 10.0],
            "autoscaling": SCALING,
        },
        server={"port": port, "front_door": "serve_proxy", "wait_for_nodes_s": 120},
    )
    ensure_model(config)
    gcs_port, head_cpus = free_port(), 4
    path = os.path.join(tempfile.mkdtemp(prefix="epd-autoscaler-"), "cluster.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(autoscaler_config(f"{get_node_ip_address()}:{gcs_port}", head_cpus), f)
    # Ray's autoscaler v2, as KubeRay runs it; the fake provider knows the head by a fixed id.
    os.environ.update(
        {
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "RAY_enable_autoscaler_v2": "1",
            "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
        }
    )
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "gcs_server_port": gcs_port,
            "autoscaling_config": path,
            "include_dashboard": False,
        },
    )
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        root = start(config, address=cluster.address).removesuffix("/v1")
        print(json.dumps(run(root, config.model.served_name)), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
