"""Fill a Hugging Face hub cache by hand, in the layout huggingface_hub itself writes
(`models--org--name/blobs/<hash>`, `snapshots/<commit>/<file>` symlinks, `refs/main`), so
tests can resolve a repo id offline without the Hub."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def fill_hf_cache(
    cache_dir: Path,
    repo_id: str,
    checkpoint: Path,
    commit: str = "0123456789abcdef" * 2 + "01234567",
) -> Path:
    """Put `checkpoint`'s files into `cache_dir` as revision `commit` (main) of `repo_id`; the
    snapshot dir."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / src.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
