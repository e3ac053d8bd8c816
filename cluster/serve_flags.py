"""`epd serve`'s flags as a vLLM user expects them (`--host`, `--dtype`, `--max-model-len`,
...), and `--set section.field=value` for any other setting: overrides of the config file,
validated by the config itself, so a wrong name or value is refused as the file's would be."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.config import DEFAULT_CONFIG, REPO_ROOT, ClusterConfig, ConfigError

GPU_PRESET = REPO_ROOT / "configs" / "single_gpu.yaml"


def _file(value: str) -> str:
    """A path given on the command line: absolute, so the replicas read the same file."""
    return str(Path(value).expanduser().resolve())


# flag, config path, type, help
FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--host", "server.host", str, "address the HTTP endpoint binds, e.g. 0.0.0.0"),
    ("--port", "server.port", int, "HTTP port"),
    ("--device", "model.device", str, "torch device of every worker: cpu or cuda"),
    ("--dtype", "model.dtype", str, "auto (bfloat16 on cuda, float32 on cpu), float32, ..."),
    ("--max-model-len", "model.max_model_len", int, "most prompt plus generated tokens"),
    ("--api-key", "server.api_key", str, "require `Authorization: Bearer <key>` on /v1"),
    ("--revision", "model.revision", str, "Hub revision (branch, tag or commit) of --model"),
    ("--chat-template", "model.chat_template", _file, "a Jinja chat template file to use"),
)


def preset(config: str | None, model: str | None, device: str | None) -> Path:
    """The config file `epd serve` starts from: the one given; else, for `--model` on a host
    with a GPU (or `--device cuda`), the one-GPU preset; else the embedded CPU default."""
    if config is not None:
        return Path(config)
    if device == "cuda" or (model is not None and device is None and _has_cuda()):
        return GPU_PRESET
    return DEFAULT_CONFIG


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def add_flags(parser: argparse.ArgumentParser) -> None:
    for flag, path, kind, text in FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=f"{text} (config: {path})")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="any other config setting, e.g. --set decode.max_batch_size=64 (repeatable)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="only 1: epd has no tensor parallelism"
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """config path -> value, from the flags given (flags first, then --set in order)."""
    if args.tensor_parallel_size != 1:
        raise ConfigError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: epd runs each worker on one "
            "device (no tensor parallelism yet); scale with more workers per pool instead"
        )
    out = {
        path: value
        for flag, path, _, _ in FLAGS
        if (value := getattr(args, flag[2:].replace("-", "_"))) is not None
    }
    for item in args.set:
        path, sep, raw = item.partition("=")
        if not sep or "." not in path:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        out[path.strip()] = yaml.safe_load(raw)  # 64 -> int, true -> bool, [a, b] -> list
    return out


def apply(config: ClusterConfig, values: dict[str, Any]) -> ClusterConfig:
    """`config` with each dotted path set, validated; ConfigError naming what is wrong."""
    data = config.model_dump()
    for path, value in values.items():
        *sections, field = path.split(".")
        node = data
        for name in sections:
            if not isinstance(node.get(name), dict):
                raise ConfigError(f"{path}: the config has no section {name!r}")
            node = node[name]
        node[field] = value
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid setting: {exc}") from None
