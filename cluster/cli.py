"""`epd` command line: build or fetch the checkpoint, serve the cluster, simulate routing, plan
a shape."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time

from cluster.config import DEFAULT_CONFIG, ClusterConfig, ConfigError, load_config
from cluster.prepare import ensure_model, prepare, with_model
from cluster.serve_flags import GPU_PRESET, add_flags, apply, preset, settings

APP_NAME = "epd"  # the Serve application (and so its fleet controller's name)


def start(config: ClusterConfig, *, address: str | None = None) -> str:
    """Start (or join) Ray, deploy the Serve app; returns the OpenAI base URL."""
    import ray
    from ray import serve

    from cluster import haproxy_cap
    from cluster.app import build_app
    from cluster.controller import prestart
    from cluster.front_door import controller_options, missing_haproxy
    from cluster.placement import check_placement
    from cluster.prompt_plan import PromptPlanner

    config = ensure_model(config)
    spec = PromptPlanner(config.model.checkpoint_path, config.model.resolved_dtype).spec
    config.encoder_modalities(spec.modalities)  # a modality no pool encodes: ConfigError
    door = config.server.front_door
    if not ray.is_initialized():
        # A Ray of our own runs Serve on this host; a cluster's nodes may differ from it.
        if not address and (problem := missing_haproxy(door)):
            raise ConfigError(problem)
        ray.init(
            address=address,
            num_cpus=None if address else config.server.num_cpus_ray,
            include_dashboard=False,
        )
        if not address:  # a Serve of our own: what an earlier one published is not ours
            haproxy_cap.forget(config.server.port)
    check_placement(
        config
    )  # a pool pinned to a node type the cluster lacks: a clear error, before any actor starts
    serve.start(
        http_options={"host": config.server.host, "port": config.server.port},
        controller_options=controller_options(door, APP_NAME),
    )
    prestart(APP_NAME, config, spec.modalities)  # workers load while the ingress imports
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    return f"http://{config.server.host}:{config.server.port}/v1"


def _serve(args: argparse.Namespace) -> int:
    base = load_config(preset(args.config, args.model, args.device))
    config = with_model(base, args.model, args.served_model_name)
    config = prepare(apply(config, settings(args)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Started with `&` by a script, a process inherits SIGINT ignored: Ctrl-C's path must stop
    # it. Taken before the app answers, so a signal sent once it does is never lost.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        url = start(config, address=args.address)
    except (KeyboardInterrupt, SystemExit):  # stopped while it starts: what came up goes
        _stop_partial()
        return 0
    print(f"epd is serving {config.model.served_name} at {url}  (Ctrl-C stops it)", flush=True)
    try:
        _idle()
    except (KeyboardInterrupt, SystemExit):
        stop()
    return 0


def _idle() -> None:
    """The main thread's wait while the app serves: SIGINT or SIGTERM ends it."""
    while True:
        time.sleep(3600)


def _stop_partial() -> None:
    """stop(), for a start cut short: Ray or Serve may not be up yet, and nothing is to go."""
    import ray
    from ray.serve.exceptions import RayServeException

    if ray.is_initialized():
        with contextlib.suppress(RayServeException):  # no Serve yet
            stop()


def stop(app_name: str = APP_NAME) -> None:
    """`epd serve`'s end: epd's app and its fleet go; other Serve apps on a shared cluster
    (--address) live on."""
    from ray import serve

    from cluster.controller import retire

    serve.delete(app_name)
    retire(app_name)  # the fleet controller is detached: it would outlive the app


def _build_model(args: argparse.Namespace) -> int:
    ensure_model(load_config(args.config))  # also fetches a repo id into the Hugging Face cache
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="start the cluster and the OpenAI endpoint")
    serve_p.add_argument(
        "--config",
        default=None,
        help=f"epd config file (default: {DEFAULT_CONFIG.name}; with --model on a CUDA host: "
        f"{GPU_PRESET.name})",
    )
    serve_p.add_argument(
        "--address",
        default=None,
        help="join a running Ray cluster (e.g. 'auto') instead of starting one",
    )
    serve_p.add_argument(
        "--model",
        default=None,
        metavar="ID_OR_DIR",
        help="serve this checkpoint (a directory or a Hugging Face repo id) "
        "instead of the config's",
    )
    serve_p.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: --model)"
    )
    add_flags(serve_p)
    serve_p.set_defaults(func=_serve)
    build_p = sub.add_parser(
        "build-model", help="build the config's built-in checkpoint if it is missing"
    )
    build_p.add_argument("--config", default=str(DEFAULT_CONFIG))
    build_p.set_defaults(func=_build_model)
    # The simulator owns its flags (epd simulate --help); they pass through untouched.
    sub.add_parser(
        "simulate", help="routing-policy simulator, driving the router's own code", add_help=False
    )
    sub.add_parser(
        "plan",
        help="cheapest E:P:D shape meeting a TTFT SLO at a rate, by simulation",
        add_help=False,
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "simulate":
        from router.sim.cli import main as simulate_main

        return simulate_main(rest)
    if args.command == "plan":
        from router.sim.plan_cli import plan_main

        return plan_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
