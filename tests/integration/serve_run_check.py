"""One run of Serve's own conventions, in a process of its own: `ray start --head`, then the
real `serve run configs/serve.yaml` (the app builder behind `import_path`, serving the embedded
default model) against it, a question over HTTP, the held-out questions all at once, Ctrl-C,
and a check that the app is gone. Prints one JSON line of what it saw;
tests/integration/test_serve_run.py and test_default_model.py hold it to what a user expects.
Started early in a test run (tests/background.py), it overlaps the tests before it.

    python -m tests.integration.serve_run_check
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import yaml

from actors.checkpoints import scenes
from actors.checkpoints.shapes import SHAPES_RECIPES
from cluster.config import REPO_ROOT, load_config
from tests.background import free_port
from tests.integration.conftest import png_data_url

RAY = str(Path(sys.executable).parent / "ray")
SERVE = str(Path(sys.executable).parent / "serve")
# Runs the command with SIGINT at its default, as a terminal starts it: a suite started in the
# background (`./.ci/run &`) ignores SIGINT, a child inherits that, and Python then installs no
# KeyboardInterrupt handler, so `serve run` would sleep through the Ctrl-C. An exec, not
# preexec_fn: safe beside threads.
AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


@contextlib.contextmanager
def ray_head():
    """`ray start --head --block` on a free port (the environment is the caller's private one),
    stopped by signalling the process group we started (not `ray stop`)."""
    port = free_port()
    argv = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"]
    argv += ["--num-cpus=4", "--include-dashboard=false"]
    argv += [
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    head = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not _accepts(port):  # the GCS listens: the head is up
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head never came up"
            time.sleep(1)
        time.sleep(2)  # its raylet registers just after the GCS opens
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=5)  # a private cluster: what has not stopped by then is killed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _serve_yaml(folder: Path, http_port: int) -> Path:
    """configs/serve.yaml as it is, but for the HTTP address (the only thing a test changes)."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    path = folder / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _served_config():
    """The epd config that configs/serve.yaml serves (the default one)."""
    app = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())["applications"][0]
    return load_config(REPO_ROOT / app["args"]["config"])


def served_name() -> str:
    return _served_config().model.served_name


def _wait_for_the_model(within_s: float = 900) -> None:
    """A test run trains the default model in the background on a new machine: wait for it,
    rather than have the app builder train a second copy beside it."""
    config = Path(_served_config().model.checkpoint).expanduser() / "config.json"
    deadline = time.monotonic() + within_s
    while not config.is_file() and time.monotonic() < deadline:
        time.sleep(2)


def _wait_ready(root: str, proc: subprocess.Popen, log: Path, within_s: float = 300) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve run exited with {proc.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise AssertionError("serve run never became healthy")


def _interrupt(proc: subprocess.Popen, within_s: float = 120) -> int | str:
    """Ctrl-C, as a user stops `serve run` (it deletes its app and exits): its exit status, or
    its Python stacks if it is still up `within_s` later (then it is killed). That is how an
    inherited, ignored SIGINT showed itself: see AS_FROM_A_TERMINAL."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which(
            "py-spy"
        )
        dump = py_spy and subprocess.run(
            [py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60
        )
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        stacks = (dump.stdout + dump.stderr) if dump else "(py-spy not installed: no stacks)"
        return f"still up {within_s:.0f} s after SIGINT; its stacks:\n{stacks}"


def _ask(root: str) -> dict:
    """/v1/models and one question the default model was taught (colours)."""
    sample = scenes.samples(31337, 1, asks=(scenes.Ask.COLOUR,))[0]
    image = {"type": "image_url", "image_url": {"url": png_data_url(sample.image)}}
    body = {"model": served_name(), "messages": sample.messages(image)}
    reply = httpx.post(
        f"{root}/v1/chat/completions",
        timeout=120,
        json={**body, "temperature": 0, "max_tokens": 8},
    )
    return {
        "model_ids": [m["id"] for m in httpx.get(f"{root}/v1/models").json()["data"]],
        "status": reply.status_code,
        "answer": reply.json()["choices"][0]["message"]["content"] if reply.is_success else None,
        "expected": sample.answer,
        "body": reply.text[:2000],
    }


HELD_OUT_SEED = 20261123  # the training stream uses the recipe's data_seed, never this
NUM_HELD_OUT = 64


def held_out_samples() -> list[scenes.Sample]:
    """Pictures the default model never saw, every kind of question it was taught."""
    recipe = SHAPES_RECIPES[_served_config().model.builtin]  # the default is a trained built-in
    return scenes.samples(HELD_OUT_SEED, NUM_HELD_OUT, asks=recipe.asks)


async def _ask_held_out(root: str) -> list[list]:
    """[status, answer or error body] per held-out question, all in flight at once."""
    async with httpx.AsyncClient(base_url=root, timeout=300) as client:
        calls = [
            client.post(
                "/v1/chat/completions",
                json={
                    "model": served_name(),
                    "temperature": 0,
                    "max_tokens": 8,
                    "messages": s.messages(
                        {"type": "image_url", "image_url": {"url": png_data_url(s.image)}}
                    ),
                },
            )
            for s in held_out_samples()
        ]
        responses = await asyncio.gather(*calls)
    return [
        [r.status_code, r.json()["choices"][0]["message"]["content"] if r.is_success else r.text]
        for r in responses
    ]


def _gone(root: str) -> bool:
    try:
        httpx.get(f"{root}/health", timeout=5).raise_for_status()
    except httpx.HTTPError:
        return True
    return False


def run(folder: Path) -> dict:
    http_port, log = free_port(), folder / "serve_run.log"
    root = f"http://127.0.0.1:{http_port}"
    outcome: dict = {}
    _wait_for_the_model()
    with ray_head() as address:
        argv = [*AS_FROM_A_TERMINAL, SERVE, "run", "--address", address]
        proc = subprocess.Popen(
            [*argv, str(_serve_yaml(folder, http_port))],
            cwd=REPO_ROOT,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_ready(root, proc, log)
            outcome.update(_ask(root))
            outcome["held_out"] = asyncio.run(_ask_held_out(root))
        except Exception:
            outcome["error"] = traceback.format_exc()
        finally:
            outcome["exit"] = _interrupt(proc)
        outcome["gone_after"] = _gone(root)
    outcome["log_tail"] = log.read_text()[-3000:]
    return outcome


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="epd-serve-run-") as folder:
        print(json.dumps(run(Path(folder))), flush=True)


if __name__ == "__main__":
    main()
