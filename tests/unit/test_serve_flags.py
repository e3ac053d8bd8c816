"""`epd serve`'s vLLM-style flags and --set: each lands in its config field, validated as
the config file's own settings are; a wrong name or value is refused by name before Ray
starts."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.config import DEFAULT_CONFIG, ConfigError, load_config
from cluster.serve_flags import GPU_PRESET, add_flags, apply, preset, settings


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(argv)


def test_each_flag_sets_its_config_field():
    args = _args(
        "--host", "0.0.0.0", "--port", "9000", "--dtype", "bfloat16", "--max-model-len", "4096",
        "--api-key", "k", "--revision", "abc123",
        "--set", "decode.max_batch_size=64", "--set", "limits.retry_after_s=3",
    )  # fmt: skip
    config = apply(load_config(), settings(args))
    assert (config.server.host, config.server.port, config.server.api_key) == ("0.0.0.0", 9000, "k")
    assert (config.model.dtype, config.model.max_model_len) == ("bfloat16", 4096)
    assert config.model.revision == "abc123"
    assert config.decode.max_batch_size == 64 and config.limits.retry_after_s == 3


def test_a_chat_template_file_is_taken_from_where_the_command_ran(tmp_path, monkeypatch):
    (tmp_path / "tools.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    config = apply(load_config(), settings(_args("--chat-template", "tools.jinja")))
    assert config.model.chat_template_file == tmp_path / "tools.jinja"  # absolute: any cwd


def test_no_flags_change_nothing():
    config = load_config()
    assert apply(config, settings(_args())) == config


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--dtype", "float64"), "model.dtype must be one of"),
        (("--device", "tpu"), "model.device must be cpu or cuda"),
        (("--set", "decode.max_batch_size=0"), "max_batch_size"),
        (("--set", "decode.nope=1"), "decode.nope"),
        (("--set", "nosuch.field=1"), "no section 'nosuch'"),
        (("--set", "decode"), "expected SECTION.FIELD=VALUE"),
        (("--tensor-parallel-size", "2"), "no tensor parallelism"),
        (("--chat-template", "/no/such.jinja"), "model.chat_template: no file at"),
    ],
)
def test_a_wrong_setting_is_refused_by_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        apply(load_config(), settings(_args(*argv)))


def test_the_cli_refuses_before_starting_anything(capsys):
    assert main(["serve", "--tensor-parallel-size", "4"]) == 2
    assert "--tensor-parallel-size 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config, model, device, cuda, expected",
    [
        (None, None, None, True, DEFAULT_CONFIG),  # no --model: the embedded default
        (None, "org/m", None, True, GPU_PRESET),  # a published model on a GPU host
        (None, "org/m", None, False, DEFAULT_CONFIG),
        (None, None, "cuda", False, GPU_PRESET),
        (None, "org/m", "cpu", True, DEFAULT_CONFIG),
        ("mine.yaml", "org/m", None, True, Path("mine.yaml")),  # a given file always wins
    ],
)
def test_model_on_a_gpu_host_starts_from_the_gpu_preset(
    monkeypatch, config, model, device, cuda, expected
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert preset(config, model, device) == expected
    assert load_config(GPU_PRESET).model.device == "cuda"


def test_serve_stops_on_ctrl_c_even_when_started_in_the_background(monkeypatch):
    """A script's `epd serve &` inherits SIGINT ignored (bash's rule for background jobs):
    serve takes it back, so Ctrl-C's path (SIGINT) still stops it and deletes the app."""
    from cluster import cli

    stopped: list[str] = []
    monkeypatch.setattr(cli, "prepare", lambda config: config)
    monkeypatch.setattr(cli, "start", lambda config, address=None: "http://127.0.0.1:1/v1")
    monkeypatch.setattr(cli, "stop", lambda: stopped.append("stop"))

    def idle() -> None:  # where serve waits: the signal arrives now
        signal.raise_signal(signal.SIGINT)
        raise AssertionError("SIGINT was ignored: serve slept through Ctrl-C")

    monkeypatch.setattr(cli, "_idle", idle)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["serve"]) == 0
    finally:
        signal_defaults()
        signal.signal(signal.SIGINT, before)
    assert stopped == ["stop"]


def test_ctrl_c_while_serve_starts_stops_it_quietly(monkeypatch):
    """A script polls until the app answers, then sends SIGINT: that can land before `start`
    returns. serve exits 0 (no traceback) and stops what came up; here Ray never started."""
    from cluster import cli

    def start(config, address=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "prepare", lambda config: config)
    monkeypatch.setattr(cli, "start", start)
    monkeypatch.setattr(cli, "stop", lambda: pytest.fail("stop() needs Ray, which never started"))
    try:
        assert main(["serve"]) == 0
    finally:
        signal_defaults()


def signal_defaults() -> None:
    """serve's handlers off again: pytest's own SIGINT handling, SIGTERM's default."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
