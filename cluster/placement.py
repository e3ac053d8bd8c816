"""Before any actor starts: can every pool's actors be placed on the cluster at all?

A pool pinned to a node type (a custom resource such as `encoder_node`, or GPUs) that no
node offers would leave its actors pending forever and the app never ready. This check
fails at once instead, naming the pool and the missing resource.

Autoscaling clusters: a resource counts as offered when a live node has it, or when a node
type of the autoscaler's own config (published to the GCS by the autoscaler of `ray up` or
KubeRay) declares it with room for at least one node: the autoscaler then launches such a
node for the pending actor. Where that config is not published (Ray's v1 autoscaler),
`server.wait_for_nodes_s` gives the cluster's worker nodes time to join. Pools that together
reserve more of a resource than the live nodes and those node types (at their max count)
offer are refused too: some of their actors would wait forever.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.config import ClusterConfig, ConfigError

POLL_S = 1.0


class PlacementError(ConfigError):
    """A pool's actors cannot be placed on this cluster."""


@dataclass(frozen=True)
class NodeShape:
    """What one node (or one node type the autoscaler may launch) offers."""

    source: str
    resources: Mapping[str, float]
    count: int = 1  # nodes of this shape (an autoscaler node type: its max count)

    def holds(self, bundle: Mapping[str, float]) -> bool:
        return all(self.resources.get(name, 0.0) >= amount for name, amount in bundle.items())


def _shown(resources: Mapping[str, float]) -> dict[str, float]:
    """Without Ray's per-node bookkeeping resources (node:<ip>, memory, ...)."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return {k: v for k, v in sorted(resources.items()) if not k.startswith(hidden)}


def unplaceable(config: ClusterConfig, shapes: list[NodeShape]) -> list[str]:
    """One sentence per pool whose actors no node (or node type) can hold, and per resource
    the pools together need more of than all nodes offer."""
    offered = sorted({name for shape in shapes for name in _shown(shape.resources)})
    problems = []
    for name, pool in config.named_pools():
        bundle = pool.ray_resources()
        if missing := [r for r in bundle if not any(r in shape.resources for shape in shapes)]:
            problems.append(
                f"pool {name!r} needs {missing} (each actor reserves {bundle}), which no node "
                "of the cluster offers, nor any node type its autoscaler may launch; "
                f"the nodes offer {offered}"
            )
        elif not any(shape.holds(bundle) for shape in shapes):
            largest = [f"{s.source}: {_shown(s.resources)}" for s in shapes]
            problems.append(
                f"no single node can hold one actor of pool {name!r} ({bundle}); nodes: {largest}"
            )
    return problems or _short(config, shapes)


def _short(config: ClusterConfig, shapes: list[NodeShape]) -> list[str]:
    """Resources the pools need more of, all actors together, than the nodes offer."""
    problems = []
    for resource in sorted({r for _, pool in config.named_pools() for r in pool.ray_resources()}):
        parts = {
            name: pool.num_workers * pool.ray_resources().get(resource, 0.0)
            for name, pool in config.named_pools()
        }
        offered = sum(shape.resources.get(resource, 0.0) * shape.count for shape in shapes)
        if (needed := sum(parts.values())) > offered:
            split = ", ".join(f"{name} {amount:g}" for name, amount in parts.items() if amount)
            problems.append(
                f"the pools reserve {needed:g} {resource} in all ({split}); "
                f"the cluster offers {offered:g}"
            )
    return problems


def live_shapes() -> list[NodeShape]:
    import ray

    return [
        NodeShape(f"node {n['NodeManagerAddress']}", n["Resources"])
        for n in ray.nodes()
        if n["Alive"]
    ]


def autoscaler_shapes() -> list[NodeShape]:
    """Node types the autoscaler may still launch (empty where it publishes no config)."""
    from ray._private.state import state

    try:
        published = state.get_cluster_config()
    except Exception:  # no autoscaler state in this GCS: only live nodes count
        return []
    if published is None:
        return []
    unbounded = 1 << 20  # max_count -1: no limit
    return [
        NodeShape(
            f"node type {group.name} (autoscaler)",
            {k: float(v) for k, v in group.resources.items()},
            group.max_count if group.max_count > 0 else unbounded,
        )
        for group in published.node_group_configs
        if group.max_count != 0
    ]


def check_placement(config: ClusterConfig, wait_s: float | None = None) -> None:
    """Raise PlacementError unless every pool can be placed, waiting up to `wait_s`
    (default: server.wait_for_nodes_s) for nodes still joining."""
    deadline = time.monotonic() + (config.server.wait_for_nodes_s if wait_s is None else wait_s)
    while problems := unplaceable(config, live_shapes() + autoscaler_shapes()):
        if time.monotonic() >= deadline:
            raise PlacementError(
                "cannot place the worker pools on this Ray cluster: " + "; ".join(problems)
            )
        time.sleep(POLL_S)
