"""Serve's own conventions: the real `serve run configs/serve.yaml` (the app builder behind
`import_path`) serves and answers over HTTP, then stops cleanly on Ctrl-C. It runs against a
Ray of its own, in a process of its own (serve_run_check.py), started as the test run begins
(tests/background.py), beside the shared `ray_session` of the other integration tests."""

from __future__ import annotations

import pytest

from tests import background
from tests.background import Job, private_ray_env
from tests.integration.serve_run_check import served_name


def start_run() -> Job:
    return Job("tests.integration.serve_run_check", env=private_ray_env())


@pytest.fixture(scope="module")
def outcome() -> dict:
    return background.json_outcome(
        "serve-run", start_run, timeout_s=600
    )  # started early, if listed


def test_serve_run_serves_the_serve_config(outcome):
    assert "error" not in outcome, outcome["error"] + outcome["log_tail"]
    assert outcome["model_ids"] == [served_name()]
    assert outcome["status"] == 200, outcome["body"]
    assert outcome["answer"].strip() == outcome["expected"]  # the default model knows colours


def test_ctrl_c_stops_serve_run_and_its_app(outcome):
    assert outcome["exit"] == 0, f"{outcome['exit']}\n{outcome['log_tail']}"
    assert outcome["gone_after"]  # the app went with it
