"""What Serve runs of the ingress, held to the epd config: a Serve config's `deployments:`
section may set `num_replicas` or `autoscaling_config` for the Ingress, which epd's own checks
(server.num_replicas) never saw. Admission shares start from Serve's count (then follow the
replicas registered with the controller); a count that breaks a transport is refused by name."""

from __future__ import annotations

from cluster.config import ClusterConfig, ConfigError


def serve_replicas(config: ClusterConfig, deployment_config) -> int:
    """The ingress replicas Serve is set to run (`deployment_config`: Serve's DeploymentConfig
    of this replica); ConfigError when that contradicts the config's transports."""
    autoscaling = deployment_config.autoscaling_config
    count = deployment_config.num_replicas
    if autoscaling is not None:
        count = max(autoscaling.initial_replicas or 0, autoscaling.min_replicas, 1)
    collective = sorted(
        t.value for t in (config.transport.embeddings, config.transport.kv) if t.collective
    )
    if collective and (autoscaling is not None or count != 1):
        override = "autoscaling_config" if autoscaling is not None else f"num_replicas: {count}"
        raise ConfigError(
            f"the Serve config sets the Ingress deployment's {override}, but transport "
            f"{collective[0]} needs exactly one ingress replica (server.num_replicas: 1): remove "
            "that override from the Serve config, or use the object_store transport"
        )
    return max(count or 1, 1)
