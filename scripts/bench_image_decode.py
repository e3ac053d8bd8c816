#!/usr/bin/env python
"""An image's decode at admission (cluster/media/decoders.py), plain PNGs through libspng
(cluster/media/png_plain.py) against Pillow for the same bytes, interleaved: the benchmarks' 20
images (benchkit/workload.py) and two UI-like screenshots. Usage: scripts/bench_image_decode.py
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import statistics
import time

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from benchkit.workload import make_png
from cluster.config import DEFAULT_CONFIG, load_config
from cluster.media import image as media_image
from cluster.media.decoders import decode_media
from router.types import Modality


def screenshot(width: int, height: int) -> bytes:
    """Panels and text on a light ground: rows Paeth-filtered, as real screenshots' are."""
    rng = np.random.default_rng(0)
    canvas = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(canvas)
    for i in range(400):
        x, y = int(rng.integers(0, width - 200)), int(rng.integers(0, height - 20))
        box = [x, y, x + int(rng.integers(20, 200)), y + int(rng.integers(5, 60))]
        draw.rectangle(box, fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
        draw.text((x + 3, y + 3), f"Settings  File  Edit  {i}", fill=(0, 0, 0))
    out = io.BytesIO()
    canvas.save(out, "PNG")
    return out.getvalue()


def min_ms(decode, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        decode()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)


def compare(png: bytes, limits, repeats: int) -> tuple[float, float]:
    """(libspng's way, Pillow's way) in ms, the same pixels checked."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    decode = lambda: decode_media(Modality.IMAGE, url, limits=limits, param="p").data  # noqa: E731
    plain = media_image.plain_png_size
    media_image.plain_png_size = lambda data: None  # Pillow's way
    try:
        pillow_pixels, pillow_ms = decode(), min_ms(decode, repeats)
    finally:
        media_image.plain_png_size = plain
    assert np.array_equal(decode(), pillow_pixels)
    return min_ms(decode, repeats), pillow_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    limits = load_config(DEFAULT_CONFIG).limits
    rng = random.Random(0)
    images = {f"bench_{i}": make_png(rng) for i in range(20)}
    images |= {"screen_1280x800": screenshot(1280, 800), "screen_1920x1080": screenshot(1920, 1080)}
    rows = {}
    for name, png in tqdm(images.items(), desc="images"):
        spng_ms, pillow_ms = compare(png, limits, args.repeats)
        rows[name] = {
            "bytes": len(png),
            "libspng_ms": round(spng_ms, 3),
            "pillow_ms": round(pillow_ms, 3),
        }
        print(f"{name:>17} {len(png):>8} B  libspng {spng_ms:.3f} ms  Pillow {pillow_ms:.3f} ms")
    bench = [row for name, row in rows.items() if name.startswith("bench_")]
    mean = {k: statistics.mean(r[k] for r in bench) for k in ("libspng_ms", "pillow_ms")}
    print(
        f"bench images' mean: libspng {mean['libspng_ms']:.3f} ms, Pillow {mean['pillow_ms']:.3f}"
    )
    print(json.dumps({"images": rows, "bench_mean_ms": mean}))


if __name__ == "__main__":
    main()
