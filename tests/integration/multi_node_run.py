"""One run of epd on a real multi-node Ray cluster on this machine, in a process of its own.

Three raylets (`ray.cluster_utils.Cluster`): a head with no custom resources, an
`encoder_node` and an `llm_node`, as configs/multi_node.yaml's node types. Deploys
configs/multi_node_cpu.yaml through `epd serve`'s own start path, sends greedy requests
over HTTP and prints one JSON line: the answers, where each worker actor runs, and the
error a pool pinned to an absent node type gets. tests/integration/test_multi_node.py
runs it (Ray allows one cluster connection per process, and the other integration tests
share theirs) and checks the answers against `generate`.

    python -m tests.integration.multi_node_run PORT
"""

from __future__ import annotations

import base64
import io
import json
import sys

import numpy as np
from PIL import Image

NODE_TYPES = {
    "encoder_node": {"num_cpus": 2, "resources": {"encoder_node": 2}},
    "llm_node": {"num_cpus": 3, "resources": {"llm_node": 2}},
}
MAX_TOKENS = 16


def _image(seed: int, width: int, height: int) -> dict:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }


def conversations() -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": [_image(1, 32, 32), {"type": "text", "text": "What is this?"}],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    _image(2, 40, 24),
                    _image(3, 24, 40),
                ],
            }
        ],
        [{"role": "user", "content": "Tell me a story about a fox."}],
    ]


def _placements() -> list[dict]:
    """Each live worker actor's class and the custom resources of the node it runs on."""
    import ray
    from ray._private import state

    custom = {
        n["NodeID"]: sorted(set(n["Resources"]) & set(NODE_TYPES)) or ["head"]
        for n in ray.nodes()
        if n["Alive"]
    }
    actors = [a for a in state.actors().values() if a["State"] == "ALIVE"]
    return [
        {
            "actor": a["ActorClassName"],
            "node": a["Address"]["NodeID"],
            "node_type": custom.get(a["Address"]["NodeID"]),
        }
        for a in actors
    ]


def _stop_beside_another_app(root: str) -> dict:
    """`epd serve`'s stop with another Serve app on the cluster: what is left running."""
    import httpx
    from ray import serve

    from cluster import controller
    from cluster.cli import APP_NAME, stop

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    def other(request) -> str:
        return "still here"

    serve.run(other.bind(), name="other", route_prefix="/other")
    stop()
    with httpx.Client(base_url=root, timeout=60) as http:
        return {
            "apps": sorted(serve.status().applications),
            "other_answers": http.get("/other").text,
            "epd_controllers": controller.running(APP_NAME),
        }


def main(port: int) -> None:
    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.cli import start
    from cluster.config import REPO_ROOT, load_config
    from cluster.placement import PlacementError, check_placement
    from cluster.prepare import ensure_model

    config = load_config(REPO_ROOT / "configs" / "multi_node_cpu.yaml").replace(
        server={"port": port}
    )
    ensure_model(config)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        for node in NODE_TYPES.values():
            cluster.add_node(**node)
        ray.init(address=cluster.address, log_to_driver=False)
        absent = config.replace(encoder={"resources": {"vision_node": 1}})
        try:
            check_placement(absent, wait_s=0)
            refusal = None
        except PlacementError as exc:
            refusal = str(exc)
        root = start(config, address=cluster.address).removesuffix("/v1")
        with httpx.Client(base_url=root, timeout=300) as http:
            answers = [
                http.post(
                    "/v1/chat/completions",
                    json={
                        "model": config.model.served_name,
                        "messages": m,
                        "temperature": 0,
                        "max_tokens": MAX_TOKENS,
                    },
                ).json()
                for m in conversations()
            ]
        placements = _placements()
        stopped = _stop_beside_another_app(root)
        print(
            json.dumps(
                {
                    "answers": answers,
                    "placements": placements,
                    "refusal": refusal,
                    "stopped": stopped,
                }
            ),
            flush=True,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
