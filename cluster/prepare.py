"""Before any actor starts: the model a config names made ready on this node, and the
secrets it takes from the environment. Shared by `epd serve` and Serve's app builder."""

from __future__ import annotations

import os

from cluster.config import ClusterConfig, ConfigError


def ensure_model(config: ClusterConfig) -> ClusterConfig:
    """Before any actor starts: the checkpoint is on this node (built from its recipe, or a
    repo id fetched through the Hugging Face cache and pinned to the commit found, so every
    node loads the same files) and of a family epd serves. ConfigError says what is wrong."""
    from actors.checkpoints.build import ensure_checkpoint
    from actors.models.source import CheckpointNotFound, resolve_checkpoint

    m = config.model
    try:
        if m.is_hub_repo:
            path = resolve_checkpoint(m.checkpoint, m.revision, m.hub_cache_dir)
            config = config.replace(
                model={"revision": path.name}
            )  # a snapshot dir is named by its commit
        else:
            path = ensure_checkpoint(m.checkpoint_path, m.builtin, progress=True)
            if (
                not m.checkpoint_path.is_absolute()
            ):  # the workers' working directory is not this one
                config = config.replace(model={"checkpoint": str(path)})
    except (CheckpointNotFound, FileNotFoundError) as exc:
        raise ConfigError(str(exc)) from None
    from actors.models.adapter import (
        UnsupportedFamily,
        check_family,
    )  # torch: only once there is a checkpoint

    try:
        check_family(path)
    except UnsupportedFamily as exc:
        raise ConfigError(str(exc)) from None
    if m.max_model_len is None:
        config = config.replace(model={"max_model_len": context_length(path)})
    return config


def context_length(checkpoint) -> int:
    """The model's own context length: its text config's max_position_embeddings (Omni's
    inside the thinker's config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    config = getattr(config, "thinker_config", config)
    return config.get_text_config().max_position_embeddings


def prepare(config: ClusterConfig) -> ClusterConfig:
    """What `epd serve` and Serve's app builder do before deploying: the API key from
    $EPD_API_KEY unless the config sets one, and the model built or pinned to a commit."""
    if os.environ.get("EPD_API_KEY") and not config.server.api_key:
        config = config.replace(server={"api_key": os.environ["EPD_API_KEY"]})
    return ensure_model(config)


def with_model(
    config: ClusterConfig, model: str | None, served_name: str | None = None
) -> ClusterConfig:
    """`--model ID_OR_DIR` replaces the config's checkpoint (and its recipe, revision, chat
    template and context length: the new checkpoint's own apply); the served name defaults to
    it, as in vLLM."""
    if model is None:
        return config if served_name is None else config.replace(model={"served_name": served_name})
    return config.replace(
        model={
            "checkpoint": model,
            "builtin": None,
            "revision": None,
            "chat_template": None,
            "max_model_len": None,  # the new model's own context (--max-model-len sets one)
            "served_name": served_name or model,
        }
    )
