"""Wiring and deployment: the Serve ingress, the actor fleet, configuration and the CLI.

Owns the OpenAI-compatible HTTP ingress (`app`, `intake`, `request_path`, `responses`),
admission and back-pressure, the live side of the router (`routing`), the fleet
controller and supervisor, metrics, the validated config, what fronts the HTTP port
(`front_door`), and media decoding (`media`).
Follow one request from `app` through `intake` and `request_path`.

Imports from this project: cluster, actors, router
"""
