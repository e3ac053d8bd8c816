"""A real local Ray cluster and a real Serve app, shared by the integration tests.

One Ray instance per session; the Serve app is redeployed when a test needs another
configuration. A new fleet costs about half a minute on a 2-core host (every worker loads
torch and the model), a redeploy that changes only ingress settings or the workers' live ones
a few seconds (the fleet stays): the modules run in MODULE_ORDER, those on the default config
first, so that the session builds each fleet once.
"""

from __future__ import annotations

import base64
import glob
import io
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from cluster.cli import start
from cluster.config import ClusterConfig, builtin_model, load_config
from cluster.prepare import ensure_model

# Modules in the order they run: the default config's first, then its ingress-only variants,
# then each module with fleets of its own; modules not listed run after these.
MODULE_ORDER = (
    "test_detached_calls.py",  # plain Ray, no app
    "test_bad_input.py",
    "test_endpoints.py",
    "test_openai_compat.py",
    "test_structured.py",
    "test_worker_failures.py",
    "test_operations.py",  # an API key: an ingress-only change
    "test_ingress_replicas.py",  # two replicas, then back to the default: ingress-only changes
    "test_backpressure.py",  # live settings (a slower prefill): the default fleet, in place
    "test_kv_budget.py",  # a live KV budget: the default fleet still
    "test_token_exact.py",  # the default's transport first, then a fleet per transport
    "test_default_model.py",  # reads the `serve run` check's run: no fleet here
    "test_checkpoints.py",
    "test_modalities.py",
    "test_vl_families.py",
    "test_multi_node.py",  # a cluster of its own, in a subprocess
    "test_serve_run.py",  # `serve run` on a cluster of its own
    "test_ray_autoscaler.py",  # Ray's autoscaler launching a node, on a cluster of its own
)


def pytest_collection_modifyitems(config, items):
    """Integration modules in MODULE_ORDER (a stable sort: order within a module is kept)."""

    def rank(item) -> int:
        name = item.path.name
        if item.path.parent != Path(__file__).parent:
            return -1  # not an integration test: before them, as collected
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    items.sort(key=rank)


TEST_PORT = int(os.environ.get("EPD_TEST_PORT", 8765))  # distinct per concurrent run on one machine
TRACE_PATH = (
    Path(tempfile.gettempdir()) / f"epd-test-trace-{os.getpid()}.jsonl"
)  # every app records its requests


def tiny_config() -> ClusterConfig:
    """The default config with the random-weight tiny-llava: built in seconds, where the default's
    trained model costs a training run that only test_default_model.py needs."""
    return load_config().replace(model=builtin_model("tiny-llava"))


def cluster_config(**sections) -> ClusterConfig:
    base = tiny_config().replace(
        server={"port": TEST_PORT, "trace_path": str(TRACE_PATH)},
        encoder={
            "num_workers": 2,
            "max_wait_ms": 20,
            "cache_mb": float(os.environ.get("EPD_TEST_CACHE_MB", 256)),
        },
    )
    return base.replace(**sections) if sections else base


@pytest.fixture(scope="session")
def ray_session():
    ensure_model(tiny_config())
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


class Deployed:
    """The app deployed with one config: its URL, its config, an HTTP client."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.base_url = start(config)
        self.root = self.base_url.removesuffix("/v1")
        self.http = httpx.Client(base_url=self.root, timeout=120)
        self._wait_for_own_replica()

    def _wait_for_own_replica(self, within_s: float = 60) -> None:
        """serve.run returns once the new app runs, but the proxy may route to the old app's
        replica a little longer: wait until a replica of this config answers."""
        import time

        deadline = time.monotonic() + within_s
        own = self.config.fingerprint()
        while (
            self.http.get("/health", params={"verbose": 1})
            .json()
            .get("ingress", {})
            .get("config_sha1")
            != own
        ):
            assert time.monotonic() < deadline, "the new app never took over from the old one"
            time.sleep(0.2)

    def chat(self, messages=None, **params) -> httpx.Response:
        body = (
            {"model": self.config.model.served_name, "messages": messages, **params}
            if messages
            else {"model": self.config.model.served_name, **params}
        )
        return self.http.post("/v1/chat/completions", json=body)


_current: dict[str, Deployed] = {}


def deployed_now() -> Deployed | None:
    """The app this session deployed last, if any."""
    return next(iter(_current.values()), None)


def deploy(config: ClusterConfig) -> Deployed:
    """Deploy `config` unless it is what is running now."""
    key = config.model_dump_json()
    if key not in _current:
        _current.clear()
        _current[key] = Deployed(config)
    return _current[key]


@pytest.fixture(scope="module")
def app(ray_session) -> Deployed:
    return deploy(cluster_config())


def png_data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def random_image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(base)


def replica_log_text() -> str:
    """Every ingress replica's log this session (Serve writes them to its session dir)."""
    logs = ray._private.worker._global_node.get_logs_dir_path()
    return "".join(
        open(p, errors="replace").read()
        for p in glob.glob(os.path.join(logs, "serve", "replica_*Ingress*.log"))
    )


def replica_log_lines(
    *request_ids: str, within_s: float = 20, line: str = "x_request_id={} "
) -> list[str]:
    """The replica log line of each request id that holds `line` with the id in it: by
    default epd's request line."""
    deadline = time.monotonic() + within_s
    while True:
        lines = replica_log_text().splitlines()
        found = [next((ln for ln in lines if line.format(rid) in ln), None) for rid in request_ids]
        if all(found) or time.monotonic() > deadline:
            assert all(found), f"no log line for {request_ids} in the replicas' logs"
            return found
        time.sleep(0.5)
