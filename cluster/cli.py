"""`epd` command line: build or fetch the checkpoint, serve the cluster, simulate routing."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from cluster.config import DEFAULT_CONFIG, ClusterConfig, ConfigError, load_config

APP_NAME = "epd"  # the Serve application (and so its fleet controller's name)


def ensure_model(config: ClusterConfig) -> ClusterConfig:
    """Before any actor starts: the checkpoint is on this node (built from its recipe, or a
    repo id fetched through the Hugging Face cache and pinned to the commit found, so every
    node loads the same files) and of a family epd serves. ConfigError says what is wrong."""
    from actors.checkpoint_source import CheckpointNotFound, resolve_checkpoint
    from actors.checkpoints import ensure_checkpoint

    m = config.model
    try:
        if m.is_hub_repo:
            path = resolve_checkpoint(m.checkpoint, m.revision, m.hub_cache_dir)
            config = config.replace(model={"revision": path.name})  # a snapshot dir is named by its commit
        else:
            path = ensure_checkpoint(m.checkpoint_path, m.builtin, progress=True)
            if not m.checkpoint_path.is_absolute():  # the workers' working directory is not this one
                config = config.replace(model={"checkpoint": str(path)})
    except (CheckpointNotFound, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None
    from actors.adapters import UnsupportedFamily, check_family  # torch: only once there is a checkpoint

    try:
        check_family(path)
    except UnsupportedFamily as exc:
        raise ConfigError(str(exc)) from None
    return config


def start(config: ClusterConfig, *, address: str | None = None) -> str:
    """Start (or join) Ray, deploy the Serve app; returns the OpenAI base URL."""
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.placement import check_placement

    config = ensure_model(config)
    if not ray.is_initialized():
        ray.init(address=address, num_cpus=None if address else config.server.num_cpus_ray, include_dashboard=False)
    check_placement(config)  # a pool pinned to a node type the cluster lacks: a clear error, before any actor starts
    serve.start(http_options={"host": config.server.host, "port": config.server.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://{config.server.host}:{config.server.port}/v1"


def prepare(config: ClusterConfig) -> ClusterConfig:
    """What `epd serve` and Serve's app builder do before deploying: the API key from
    $EPD_API_KEY unless the config sets one, and the model built or pinned to a commit."""
    if os.environ.get("EPD_API_KEY") and not config.server.api_key:
        config = config.replace(server={"api_key": os.environ["EPD_API_KEY"]})
    return ensure_model(config)


def with_model(config: ClusterConfig, model: str | None, served_name: str | None = None) -> ClusterConfig:
    """`--model ID_OR_DIR` replaces the config's checkpoint (and its recipe and revision);
    the served name defaults to it, as in vLLM."""
    if model is None:
        return config if served_name is None else config.replace(model={"served_name": served_name})
    return config.replace(model={"checkpoint": model, "builtin": None, "revision": None, "served_name": served_name or model})


def _serve(args: argparse.Namespace) -> int:
    config = with_model(load_config(args.config), args.model, args.served_model_name)
    if args.port is not None:
        config = config.replace(server={"port": args.port})
    config = prepare(config)
    url = start(config, address=args.address)
    print(f"epd is serving {config.model.served_name} at {url}  (Ctrl-C stops it)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        from ray import serve

        from cluster.controller import retire

        serve.shutdown()
        retire(APP_NAME)  # the fleet controller is detached: it would outlive the app
    return 0


def _build_model(args: argparse.Namespace) -> int:
    ensure_model(load_config(args.config))  # also fetches a repo id into the Hugging Face cache
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="start the cluster and the OpenAI endpoint")
    serve_p.add_argument("--config", default=str(DEFAULT_CONFIG))
    serve_p.add_argument("--address", default=None, help="join a running Ray cluster (e.g. 'auto') instead of starting one")
    serve_p.add_argument(
        "--model", default=None, metavar="ID_OR_DIR", help="serve this checkpoint (a directory or a Hugging Face repo id) instead of the config's"
    )
    serve_p.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    serve_p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's server.port)")
    serve_p.set_defaults(func=_serve)
    build_p = sub.add_parser("build-model", help="build the config's built-in checkpoint if it is missing")
    build_p.add_argument("--config", default=str(DEFAULT_CONFIG))
    build_p.set_defaults(func=_build_model)
    # The simulator owns its flags (epd simulate --help); they pass through untouched.
    sub.add_parser("simulate", help="routing-policy simulator, driving the router's own code", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "simulate":
        from router.sim.cli import main as simulate_main

        return simulate_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
