"""How epd installs. From a wheel, not only in editable mode: every package and sub-package is
in the wheel, and an installed copy imports and runs from a clean virtualenv away from the
repo. At tested versions: pyproject.toml states ranges, constraints.txt the exact versions
tested, and scripts/setup installs within the one at the other; `scripts/setup --serve`
installs no test tools but does install what `epd simulate --plot` needs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


# ------------------------------------------------------------------- versions: ranges, pins, set-up

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / "constraints.txt"
SETUP = ROOT / "scripts" / "setup"
# Left to its range on purpose (constraints.txt says why): only the `ray up` launcher and the
# head's autoscaler import boto3, and no test does.
UNPINNED = {"boto3"}
TEST_TOOLS = {"pytest", "pytest-timeout", "ruff", "nbclient", "ipykernel", "langchain-openai"}


def _requirements(group: str | None = None) -> list[Requirement]:
    deps = PROJECT["dependencies"] if group is None else PROJECT["optional-dependencies"][group]
    return [Requirement(d) for d in deps]


def _all_requirements() -> list[Requirement]:
    return _requirements() + [
        r for group in PROJECT["optional-dependencies"] for r in _requirements(group)
    ]


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and name.strip() and version.strip(), f"not an exact pin: {line!r}"
        assert "[" not in name, f"pip refuses extras in a constraints file: {line!r}"
        pins[canonicalize_name(name)] = version.strip()
    return pins


def test_dependencies_are_ranges_not_pins():
    for req in _requirements():
        operators = {spec.operator for spec in req.specifier}
        assert operators, f"{req}: no version range at all"
        assert not operators & {"==", "==="}, f"{req}: a pin belongs in constraints.txt"


def test_constraints_pin_every_direct_dependency_within_its_range():
    pins = _pins()
    for req in _all_requirements():
        name = canonicalize_name(req.name)
        if name == "epd" or name in UNPINNED:  # an extra naming another extra; see UNPINNED
            continue
        assert name in pins, f"{req.name} has no tested version in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req}"
        )
    assert not UNPINNED & set(pins)


def test_constraints_are_what_this_venv_runs():
    """The pins are the versions tested: what scripts/setup installed here, at them."""
    differ = {}
    for name, version in _pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an extra this venv does not hold
        if installed != version:
            differ[name] = (version, installed)
    assert not differ, f"constraints.txt vs installed: {differ}"


def test_serving_needs_no_test_tools_and_plots_without_them():
    core = {canonicalize_name(r.name) for r in _requirements()}
    plot = {canonicalize_name(r.name) for r in _requirements("plot")}
    assert not (core | plot) & TEST_TOOLS
    assert "matplotlib" in plot  # epd simulate --plot, in a serve install
    # the test extra reaches matplotlib through the plot extra
    assert any(r.name == "epd" and "plot" in r.extras for r in _requirements("test"))


def _run_setup(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/setup against a throwaway EPD_VENV whose python is a stand-in: it answers every
    check as a 3.11 with torch would and records each pip call instead of installing."""
    venv = tmp_path / "venv"
    log = tmp_path / "pip.log"
    python = venv / "bin" / "python"
    if not python.exists():
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nif [ "$1" = -m ]; then echo "$*" >> "{log}"; fi\nexit 0\n')
        python.chmod(0o755)
    log.unlink(missing_ok=True)
    env = {"PATH": "/usr/bin:/bin", "EPD_VENV": str(venv)}
    done = subprocess.run([str(SETUP), *args], env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return done, [c for c in calls if " -e " in c]


def _stamps(tmp_path: Path) -> list[str]:
    return sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "venv").glob(".epd-setup-*"))


def test_setup_installs_at_the_constraints_and_serve_installs_no_test_extra(tmp_path):
    done, installs = _run_setup(tmp_path, "--serve")
    assert done.returncode == 0, done.stderr
    assert installs == [
        "-m pip install --disable-pip-version-check -q -e .[plot] -c constraints.txt"
    ]
    assert _stamps(tmp_path) == [".epd-setup-serve"]
    # a serve install does not stand in for the test tools: the default installs them
    done, installs = _run_setup(tmp_path)
    assert done.returncode == 0, done.stderr
    assert installs == [
        "-m pip install --disable-pip-version-check -q -e .[test] -c constraints.txt"
    ]
    assert _stamps(tmp_path) == [".epd-setup-test"]
    # ... and a test install holds everything a serve install does: both are no-ops now
    for args in ((), ("--serve",)):
        done, installs = _run_setup(tmp_path, *args)
        assert done.returncode == 0 and installs == [], (args, done.stderr)
    done, _ = _run_setup(tmp_path, "--serv")
    assert done.returncode == 2 and "usage: scripts/setup [--serve]" in done.stderr


def test_setup_stamp_changes_with_the_constraints():
    """Editing a pin re-runs the install: the stamp's key covers constraints.txt."""
    text = SETUP.read_text()
    assert "cat pyproject.toml constraints.txt scripts/setup | sha1sum" in text


def test_simulate_plot_without_matplotlib_names_what_to_install(tmp_path, monkeypatch, capsys):
    """Refused before any simulating (exit 2), naming the extra; nothing is written."""
    from router.sim.cli import main as simulate_main
    from router.sim.report import PlotUnavailable, _pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "ttft.png"
    assert simulate_main(["--cluster", "1x1x1", "--requests", "50", "--plot", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--plot: plots need matplotlib" in err and "pip install 'epd[plot]'" in err
    assert not out.exists()
    with pytest.raises(PlotUnavailable, match=r"epd\[plot\]"):
        _pyplot()
