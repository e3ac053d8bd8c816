"""The load benchmark's requests: seeded Poisson arrivals of short prompts, about a subject,
some carrying one generated PNG (random noise or a colour gradient)."""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

SUBJECTS = (
    "a red car|the old bridge|two cats|a quiet lake|the tall tree|a small boat|the city at night"
    "|a green field"
).split("|")
ASKS = [
    "Describe {s}.",
    "What is near {s}?",
    "Write one sentence about {s}.",
    "Tell me a story about {s}.",
    "What color is {s}?",
    "Why would someone paint {s}?",
]


@dataclass
class Req:
    idx: int
    arrival_s: float
    prompt: str
    png: bytes | None  # None: a text-only request


def make_png(rng: random.Random) -> bytes:
    """Random noise or a colour gradient, 128..512 px a side."""
    w, h = rng.randint(128, 512), rng.randint(128, 512)
    nprng = np.random.default_rng(rng.randrange(2**32))
    if rng.random() < 0.5:
        arr = nprng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    else:
        gy, gx = np.mgrid[0:h, 0:w]
        c = nprng.uniform(0.2, 1.0, 3)
        arr = (((gx / w)[..., None] * c + (gy / h)[..., None] * (1 - c)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_workload(n: int, rate: float, image_fraction: float, seed: int) -> list[Req]:
    """Poisson arrivals at `rate`; rate 0 gives all-image requests at t=0 (idle TTFT)."""
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(n):
        png = make_png(rng) if rate == 0 or rng.random() < image_fraction else None
        reqs.append(Req(i, t, rng.choice(ASKS).format(s=rng.choice(SUBJECTS)), png))
        t += rng.expovariate(rate) if rate else 0.0
    return reqs
