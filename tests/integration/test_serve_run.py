"""Serve's own conventions: the real `serve run configs/serve.yaml` (the app builder behind
`import_path`) serves and answers over HTTP, then stops cleanly. It runs against a Ray of
its own, in subprocesses, beside the shared `ray_session` of the other integration tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from actors.checkpoints import scenes
from cluster.config import REPO_ROOT, load_config
from tests.integration.conftest import png_data_url
from tests.integration.test_multi_node import free_port, private_ray_env

RAY = str(Path(sys.executable).parent / "ray")
SERVE = str(Path(sys.executable).parent / "serve")
# Runs the command with SIGINT at its default, as a terminal starts it: a suite started in the
# background (`./.ci/run &`) ignores SIGINT, a child inherits that, and Python then installs no
# KeyboardInterrupt handler, so `serve run` would sleep through the test's Ctrl-C. An exec, not
# preexec_fn: safe beside threads.
AS_FROM_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """`ray start --head --block`, stopped by signalling the process we started (not `ray stop`)."""
    env = private_ray_env()
    port = free_port()
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _accepts(port):  # the GCS listens: the head is up
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head never came up"
            time.sleep(1)
        time.sleep(2)  # its raylet registers just after the GCS opens
        yield f"127.0.0.1:{port}", env
    finally:
        _stop_group(head)


def _stop_group(head: subprocess.Popen) -> None:
    """SIGTERM to the head's own process group (`ray start` and every process it started),
    SIGKILL to what is left after a grace period."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _serve_yaml(tmp_path: Path, http_port: int) -> Path:
    """configs/serve.yaml as it is, but for the HTTP address (the only thing a test must change)."""
    config = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _interrupt(proc: subprocess.Popen, log: Path, within_s: float = 120) -> int:
    """Ctrl-C, as a user stops `serve run` (it deletes its app and exits); its exit status. If it
    is still up `within_s` later, its Python stacks go into the failure and it is killed, so it does
    not outlive the test (that is how an inherited ignored SIGINT showed itself: see
    AS_FROM_A_TERMINAL)."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which(
            "py-spy"
        )
        dump = (
            subprocess.run(
                [py_spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60
            )
            if py_spy
            else None
        )
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        stacks = (dump.stdout + dump.stderr) if dump else "(py-spy not installed: no stacks)"
        pytest.fail(
            f"serve run still up {within_s:.0f} s after SIGINT; its stacks:\n{stacks}\n"
            f"its log:\n{log.read_text()[-3000:]}"
        )


def _served_name() -> str:
    """The model name of the epd config that configs/serve.yaml serves (the default one)."""
    args = yaml.safe_load((REPO_ROOT / "configs" / "serve.yaml").read_text())["applications"][0][
        "args"
    ]
    return load_config(REPO_ROOT / args["config"]).model.served_name


def _wait_ready(root: str, proc: subprocess.Popen, log: Path, within_s: float = 300) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"serve run exited with {proc.returncode}: {log.read_text()[-3000:]}"
        )
        try:
            if httpx.get(f"{root}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("serve run never became healthy")


def test_serve_run_serves_the_serve_config(ray_head, tmp_path):
    address, env = ray_head
    http_port = free_port()
    log = tmp_path / "serve_run.log"
    proc = subprocess.Popen(
        [
            *AS_FROM_A_TERMINAL,
            SERVE,
            "run",
            "--address",
            address,
            str(_serve_yaml(tmp_path, http_port)),
        ],
        cwd=REPO_ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    root = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(root, proc, log)
        served = _served_name()
        assert httpx.get(f"{root}/v1/models").json()["data"][0]["id"] == served
        sample = scenes.samples(31337, 1, asks=(scenes.Ask.COLOUR,))[
            0
        ]  # the default model is taught colours
        image = {"type": "image_url", "image_url": {"url": png_data_url(sample.image)}}
        reply = httpx.post(
            f"{root}/v1/chat/completions",
            timeout=120,
            json={
                "model": served,
                "messages": sample.messages(image),
                "temperature": 0,
                "max_tokens": 8,
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].strip() == sample.answer
    finally:
        returncode = _interrupt(proc, log)
    assert returncode == 0, log.read_text()[-3000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{root}/health", timeout=5).raise_for_status()  # the app is gone with it
