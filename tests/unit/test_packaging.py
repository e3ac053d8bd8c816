"""epd installs from a wheel, not only in editable mode: every package and sub-package is in
the wheel, and an installed copy imports and runs from a clean virtualenv away from the repo."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("actors", "cluster", "router")


def _run(*argv: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src") / "epd"
    # A copy: setuptools builds in the source tree, and the checkout stays clean.
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *OURS):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check")
    _run(*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source)
    return next(out.glob("epd-*.whl"))


def test_the_wheel_holds_every_module(wheel):
    inside = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for pkg in OURS for p in (ROOT / pkg).rglob("*.py")}
    assert sorted(modules - inside) == []


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory, wheel) -> Path:
    """A new venv with the wheel installed; the dependencies come from this venv's
    site-packages through a .pth line (so nothing is downloaded), which adds that directory
    without running its own .pth files: the editable install's finder stays out."""
    venv = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    site = Path(
        _run(
            venv / "bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
        ).strip()
    )
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    pip = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--python")
    _run(*pip, venv / "bin/python", "install", "-q", "--no-deps", "--no-index", wheel)
    return venv


def test_an_installed_wheel_imports_every_module_from_itself(clean_venv, tmp_path):
    check = textwrap.dedent(f"""
        import importlib, pkgutil
        site = {str(clean_venv)!r}
        for name in {OURS!r}:
            package = importlib.import_module(name)
            for info in pkgutil.walk_packages(package.__path__, name + "."):
                if info.name.endswith("__main__"):
                    continue
                module = importlib.import_module(info.name)
                assert module.__file__.startswith(site), (info.name, module.__file__)
        print("ok")
    """)
    assert _run(clean_venv / "bin/python", "-c", check, cwd=tmp_path).strip() == "ok"


def test_the_installed_command_runs(clean_venv, tmp_path):
    assert "serve" in _run(clean_venv / "bin/epd", "--help", cwd=tmp_path)
    out = _run(
        clean_venv / "bin/epd", "simulate", "--cluster", "2x2x2", "--requests", "200",
        "--load", "0.5", "--json", cwd=tmp_path,
    )  # fmt: skip
    (result,) = json.loads(out)["results"]
    assert result["requests"] == 200 and result["ttft_ms"]["p99"] > 0
