"""Decoded-pixel budgets: what one video and one request may make the ingress decode.

Each decoder works out, from headers alone, how many pixels an item will decode (an
image's size; a video's frames x frame size) and is charged before it renders any, so
a small file that declares a vast canvas or thousands of frames is refused in
microseconds instead of after gigabytes. The same charge, in bytes, goes to the ingress's
budget for decoded media in flight (`hold`, cluster/media/inflight.py). No torch, no Pillow here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cluster.media.errors import MediaError

RGB_BYTES = 3  # a decoded pixel: uint8 RGB
SAMPLE_BYTES = 4  # a decoded audio sample: float32
# (bytes, param, noun) -> None: charges the ingress's in-flight budget; may wait, or raise
Hold = Callable[[int, str, str], None]


@dataclass(frozen=True)
class DecodeCost:
    """What decoding one item materialises: `num_frames` frames of `width` x `height`."""

    num_frames: int
    width: int
    height: int

    @property
    def num_pixels(self) -> int:
        return self.num_frames * self.width * self.height

    def describe(self) -> str:
        frames = f"{self.num_frames} frames of " if self.num_frames != 1 else ""
        return f"{frames}{self.width}x{self.height} = {self.num_pixels} pixels"


def check_video_pixels(cost: DecodeCost, *, max_pixels: int | None, param: str) -> None:
    """MediaError if one video would decode more than `max_pixels` (None: no per-video limit)."""
    if max_pixels is not None and cost.num_pixels > max_pixels:
        raise MediaError(
            f"video decodes to {cost.describe()}, over this server's limit of {max_pixels} "
            "pixels per video (max_video_pixels); send a shorter or smaller clip",
            param,
        )


class PixelBudget:
    """The decoded pixels one request may still spend; every item is charged before it decodes,
    and its bytes go to `hold` when given (audio, which has no pixels, only to `hold`).

    Not thread-safe: one request's items are decoded one after another.
    """

    def __init__(self, max_pixels: int, hold: Hold | None = None) -> None:
        self.max_pixels = max_pixels
        self.spent_pixels = 0
        self.hold = hold

    def charge(self, cost: DecodeCost, *, param: str, noun: str) -> None:
        """Spend `cost`, or MediaError naming the limit if the request would go over it."""
        total = self.spent_pixels + cost.num_pixels
        if total > self.max_pixels:
            others = f" (with the request's other media, {total})" if self.spent_pixels else ""
            raise MediaError(
                f"{noun} decodes to {cost.describe()}{others}, over this server's limit of "
                f"{self.max_pixels} pixels per request (max_request_pixels)",
                param,
            )
        self.spent_pixels = total
        if self.hold is not None:
            self.hold(cost.num_pixels * RGB_BYTES, param, noun)

    def charge_samples(self, num_samples: int, *, param: str) -> None:
        """Audio: its decoded samples' bytes go to `hold` (the pixel limit does not apply)."""
        if self.hold is not None:
            self.hold(num_samples * SAMPLE_BYTES, param, "audio")
