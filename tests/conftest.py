"""Suite-wide hooks: GPU-only tests are skipped where torch sees no CUDA device."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (what a GPU run checks: docs/GPU_CHECKS.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
