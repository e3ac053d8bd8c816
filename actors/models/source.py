"""Where a checkpoint's files are on this node: a local directory as given, or a Hugging Face
repo id resolved through the Hugging Face cache (`huggingface_hub.snapshot_download`).

Resolution is per node, since each node of a cluster has its own cache: the CLI resolves
once before any actor starts (downloading with progress when online) and pins the revision
to the commit it found; every process then resolves that same commit from its own node's
cache, downloading only where the node lacks it. A pinned commit never changes, so a cached
snapshot of it is used without asking the Hub at all.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What a Hub repo id looks like ("name" or "org/name"); paths start otherwise or have more parts.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class CheckpointNotFound(ValueError):
    """Neither a local directory nor a repo id this node can get."""


def expand(location: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(location)))


def is_repo_id(location: str) -> bool:
    """A repo id, not a path: it does not exist locally and reads as `org/name`."""
    return not expand(location).exists() and bool(_REPO_ID.match(location)) and ".." not in location


def resolve_checkpoint(
    location: str, revision: str | None = None, cache_dir: str | None = None
) -> Path:
    """The local directory holding the checkpoint's files (a snapshot dir for a repo id;
    its name is the commit). Downloads show huggingface_hub's progress bars.
    CheckpointNotFound says why a repo id cannot be had."""
    if not is_repo_id(location):
        return expand(location)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kwargs = dict(
        repo_id=location, revision=revision, cache_dir=cache_dir and str(expand(cache_dir))
    )
    if revision and _COMMIT.match(revision):  # pinned: the cache is authoritative
        try:
            return Path(snapshot_download(**kwargs, local_files_only=True))
        except LocalEntryNotFoundError:
            pass
    try:
        return Path(snapshot_download(**kwargs))
    except LocalEntryNotFoundError as exc:
        raise CheckpointNotFound(_not_found(location, revision, cache_dir, exc)) from None
    except Exception as exc:  # repository or revision missing, gated, ...: the Hub's own words
        raise CheckpointNotFound(f"cannot fetch Hugging Face repo {location!r}: {exc}") from None


def _not_found(location: str, revision: str | None, cache_dir: str | None, exc: Exception) -> str:
    from huggingface_hub import constants

    cache = expand(cache_dir) if cache_dir else Path(constants.HF_HUB_CACHE)
    why = (
        "the Hub is offline (HF_HUB_OFFLINE is set)"
        if constants.HF_HUB_OFFLINE
        else f"the Hub cannot be reached ({exc.__cause__ or exc})"
    )
    at = f" at revision {revision!r}" if revision else ""
    return (
        f"model.checkpoint {location!r} is not a local directory, and as a Hugging Face repo id "
        f"it is not in the cache at {cache}{at}, and {why}; give an existing directory, "
        f"fill the cache (`hf download {location}` where the Hub is reachable, or copy a cache)"
        + (", or unset HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else "")
    )
