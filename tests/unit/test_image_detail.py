"""image_url.detail is honoured: "low" shrinks the image to fit 512 x 512 (aspect kept)
under its own content identifier; "high" and "auto" keep it as sent (no Ray)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image

from cluster.config import ClusterConfig
from cluster.intake import Intake
from cluster.prepare import ensure_model
from cluster.prompt_plan import PromptPlanner


def _png(width: int, height: int) -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _item(intake: Intake, url: str, detail: str | None):
    image = {"url": url, **({"detail": detail} if detail else {})}
    content = [{"type": "image_url", "image_url": image}, {"type": "text", "text": "what?"}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    [item] = intake.admit(json.dumps(body).encode(), "r", 0.0).plan.items
    return item


def test_low_detail_shrinks_large_images_only(ckpt):
    config = ClusterConfig.model_validate(
        {
            "model": {"checkpoint": str(ckpt), "served_name": "m"},
            "limits": {"decode_in_process": True},
        }
    )
    config = ensure_model(config)  # as the server does: max_model_len from the checkpoint
    intake = Intake(config, PromptPlanner(ckpt))
    big = _png(1000, 600)
    full, high, low = (_item(intake, big, d) for d in (None, "high", "low"))
    assert full.data.shape == high.data.shape == (600, 1000, 3)
    assert low.data.shape == (307, 512, 3)
    assert low.identifier != full.identifier == high.identifier
    small = _png(300, 200)
    assert _item(intake, small, "low").identifier == _item(intake, small, "auto").identifier
