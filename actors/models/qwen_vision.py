"""The Qwen vision tower's side shared by the families that use it (Qwen2.5-Omni thinker,
Qwen2.5-VL): dynamic-resolution grids for images and video (2x2 patch merging, 2-frame
temporal patches), encoding through the checkpoint's own sub-processors, and decode-step
3-D positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from actors.models.adapter import ItemLayout, PlaceholderSpec, merged_kwargs
from actors.types import MediaItem
from router.types import Modality

DEFAULT_VIDEO_FPS = 2.0  # what the server assumes of a video whose frame rate it does not know


@dataclass(frozen=True)
class VisionGridSpec(PlaceholderSpec):
    """Images and videos as grids of merged patches; their placeholder counts follow from
    the processor's resize rule (`smart_resize`), without running it."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_pixels: tuple[int, int] = (0, 0)  # (min, max) pixels an image is resized into
    video_pixels: tuple[int, int] = (0, 0)  # the same per video frame

    def layout(self, item: MediaItem) -> ItemLayout:
        if item.modality == Modality.IMAGE:
            grid = (1, *self._grid_hw(item.data.shape[0], item.data.shape[1], self.image_pixels))
            return ItemLayout(self._tokens(grid), grid)
        if item.modality != Modality.VIDEO:
            raise self._refuse(item)
        frames = item.data.shape[0]
        grid = (
            math.ceil(frames / self.temporal_patch_size),
            *self._grid_hw(item.data.shape[1], item.data.shape[2], self.video_pixels),
        )
        fps = item.frames_per_s or DEFAULT_VIDEO_FPS
        return ItemLayout(self._tokens(grid), grid, self.temporal_patch_size / fps)

    def _grid_hw(self, height: int, width: int, pixels: tuple[int, int]) -> tuple[int, int]:
        h, w = smart_resize(
            height,
            width,
            self.patch_size * self.merge_size,
            min_pixels=pixels[0],
            max_pixels=pixels[1],
        )
        return h // self.patch_size, w // self.patch_size

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge_size**2


def vision_spec_fields(processor) -> dict:
    """VisionGridSpec's fields as the processor's merged kwargs and sub-processors set them."""
    kwargs, video = merged_kwargs(processor), processor.video_processor
    images, videos = kwargs["images_kwargs"], kwargs["videos_kwargs"]
    image_size = images.get("size") or processor.image_processor.size
    video_size = videos.get("size") or video.size
    return dict(
        patch_size=video.patch_size,
        merge_size=video.merge_size,
        temporal_patch_size=video.temporal_patch_size,
        image_pixels=(
            images.get("min_pixels", image_size["shortest_edge"]),
            images.get("max_pixels", image_size["longest_edge"]),
        ),
        video_pixels=(video_size["shortest_edge"], video_size["longest_edge"]),
    )


class VisionEncoding:
    """Image and video encoding for adapters holding `_processor`, `_kwargs` (merged kwargs)
    and `_model` (with get_image_features / get_video_features)."""

    def _images(self, arrays: list[np.ndarray]):
        images = [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]
        inputs = self._processor.image_processor(images, **self._kwargs["images_kwargs"])
        pixels, grid = (
            inputs["pixel_values"].to(self.device, self.dtype),
            inputs["image_grid_thw"].to(self.device),
        )
        return self._model.get_image_features(pixels, grid).pooler_output

    def _videos(self, arrays: list[np.ndarray]):
        # Say the layout: left to guess, the processor reads frames 1 or 3 pixels high as
        # channels-first (a 1x1 GIF became 140 embeddings where the plan's grid says 144).
        kwargs = {**self._kwargs["videos_kwargs"], "input_data_format": "channels_last"}
        inputs = self._processor.video_processor(list(arrays), **kwargs)
        pixels, grid = (
            inputs["pixel_values_videos"].to(self.device, self.dtype),
            inputs["video_grid_thw"].to(self.device),
        )
        return self._model.get_video_features(pixels, grid).pooler_output

    def step_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.unsqueeze(0).expand(
            3, -1, -1
        )  # text tokens: the same position on all three axes
