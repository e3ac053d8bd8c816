"""The burst from C (scripts/benchkit/burst_client.c): built once with the system's `cc` into
~/.cache/epd/bin (keyed by the source), then run; its answers as RawOutcomes."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchkit.raw_burst import RawOutcome

SOURCE = Path(__file__).with_name("burst_client.c")


def binary() -> Path:
    digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]
    out = Path.home() / ".cache" / "epd" / "bin" / f"burst_client-{digest}"
    if not out.exists():
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("the C burst client needs a C compiler (cc or gcc) on PATH")
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([cc, "-O2", "-o", str(out), str(SOURCE)], check=True)
    return out


def burst(port: int, payload: bytes, n: int) -> list[RawOutcome]:
    """`n` copies of `payload` at once, each on its own connection to 127.0.0.1:`port`."""
    with tempfile.NamedTemporaryFile(suffix=".http") as request:
        request.write(payload)
        request.flush()
        done = subprocess.run(
            [str(binary()), str(port), str(n), request.name],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
    return [_outcome(line) for line in done.stdout.splitlines()]


def _outcome(line: str) -> RawOutcome:
    status, ms, retry_after, openai_error = line.split()
    return RawOutcome(
        status=int(status),
        first_byte_ms=max(float(ms), 0.0),
        retry_after=retry_after == "1",
        openai_error=openai_error == "1",
    )
