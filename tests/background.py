"""Slow, self-contained checks run in processes of their own, started as soon as a test run has
collected a test that needs one, so that they overlap the tests that come before it (on a
2-core host, most tests leave a core idle much of the time). A fixture then takes the
started process and waits for it; where nothing was started, it starts one itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.front_door import free_ports

REPO_ROOT = Path(__file__).resolve().parents[1]
_started: dict[str, Job] = {}


def free_port() -> int:
    return free_ports(1)[0]


def private_ray_env() -> dict:
    """The environment for a Ray of our own: its address file in a private RAY_TMPDIR, so
    `ray.init()` / `address='auto'` elsewhere on this machine never finds it; one auth mode
    for all its processes (`ray start` turns token auth on when ~/.ray/auth_token exists,
    a client of `serve run` does not)."""
    return {
        **os.environ,
        "RAY_TMPDIR": tempfile.mkdtemp(prefix="epd-ray-", dir="/tmp"),
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }


class Job:
    """A started process whose output goes to files, not pipes: a pipe nobody reads yet would
    fill and stall a process started long before its test."""

    def __init__(self, module: str, *args: str, env: dict | None = None):
        self.out, self.err = (tempfile.TemporaryFile("w+") for _ in range(2))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=self.out,
            stderr=self.err,
            start_new_session=True,  # a clean-up kills its whole process group
        )
        self.ray_tmpdir = (env or {}).get("RAY_TMPDIR")  # a private Ray's daemons live under it

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once it ends; killed with everything it started if it
        has not ended within timeout_s."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        self.out.seek(0), self.err.seek(0)
        return self.proc.returncode, self.out.read(), self.err.read()

    def kill(self) -> None:
        """The job's process group, and the processes of its private Ray (`ray start` runs in a
        session of its own and detaches its daemons: a job killed before its own clean-up would
        leave them running). A head still starting spawns more after a scan: scan again until
        one finds none."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(KILL_SCANS if self.ray_tmpdir else 0):
            if not (pids := _pids_mentioning(self.ray_tmpdir)):
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)


KILL_SCANS = 10


def _pids_mentioning(text: str) -> list[int]:
    """Processes whose command line or environment contains `text` (`ray start` names its
    private RAY_TMPDIR only in its environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if any(text.encode() in (entry / f).read_bytes() for f in ("cmdline", "environ")):
                    found.append(int(entry.name))
    return found


def start(name: str, job: Job) -> None:
    _started[name] = job


def stop(name: str) -> None:
    """Kill the job started under `name`, if any: no test that needs it will run."""
    if (job := _started.pop(name, None)) is not None:
        job.kill()


def take(name: str) -> Job | None:
    """The process started early under `name` (once: a second take gets None)."""
    return _started.pop(name, None)


def kill_all() -> None:
    """At the end of a run: nothing started here outlives it."""
    for job in _started.values():
        job.kill()
    _started.clear()


def json_outcome(name: str, start, timeout_s: float) -> dict:
    """The last JSON line a runner printed: from the job started early under `name`, or from
    one `start()` starts now; kept for the other modules that read the same run. Fails with its
    output if it failed or printed none."""
    if name not in _outcomes:
        job = take(name) or start()
        status, stdout, stderr = job.finish(timeout_s)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert status == 0 and lines, stdout[-3000:] + stderr[-5000:]
        _outcomes[name] = json.loads(lines[-1])
    return _outcomes[name]


_outcomes: dict[str, dict] = {}
