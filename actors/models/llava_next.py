"""LLaVA-NeXT: CLIP tower over "anyres" tiles + projector + a Llama/Mistral-style LM. Images only.

An image is resized into the best-fitting resolution of the config's grid pinpoints, cut into
tower-sized tiles, and also seen whole at tower size (the base tile). Its embeddings: the base
tile's patches, then the tiles' patch grid with the padding rows (or columns) the resize added
cut off, one `image_newline` row end after each row. The count therefore depends on the
image's aspect ratio; `LlavaNextSpec` derives it from the size alone, by the model's own rules
(`select_best_resolution`, then the unpadding arithmetic of `unpad_image`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaNextForConditionalGeneration
from transformers.image_processing_utils import select_best_resolution

from actors.models.adapter import ItemLayout, Part, PlaceholderSpec, merged_kwargs
from actors.models.llava import LlavaAdapter
from actors.types import MediaItem
from router.types import Modality


def unpadded_grid(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """Rows and columns of a grid_h x grid_w feature grid left after cutting the padding off an
    image of height x width resized into it (the arithmetic of the model's `unpad_image`)."""
    if width / height > grid_w / grid_h:
        padding = (grid_h - int(round(height * (grid_w / width), 7))) // 2
        return grid_h - 2 * padding, grid_w
    padding = (grid_w - int(round(width * (grid_h / height), 7))) // 2
    return grid_h, grid_w - 2 * padding


@dataclass(frozen=True)
class LlavaNextSpec(PlaceholderSpec):
    tile_pixels: int = 336  # the tower's input side
    patches_per_side: int = 24  # tile_pixels // patch_size
    extra_tokens: int = 0  # 1 for the "full" strategy (CLS kept), else 0
    grid_pinpoints: tuple[
        tuple[int, int], ...
    ] = ()  # (height, width) resolutions an image may be resized into

    def layout(self, item: MediaItem) -> ItemLayout:
        if item.modality != Modality.IMAGE:
            raise self._refuse(item)
        height, width = item.data.shape[:2]
        best_h, best_w = select_best_resolution(
            (height, width), [list(p) for p in self.grid_pinpoints]
        )
        side = self.patches_per_side
        rows, cols = unpadded_grid(
            height, width, best_h // self.tile_pixels * side, best_w // self.tile_pixels * side
        )
        base = side * side + self.extra_tokens
        return ItemLayout(base + rows * (cols + 1))  # each row ends with image_newline


def build_spec(config, processor, dtype_bytes: int) -> LlavaNextSpec:
    vision = config.vision_config
    token = processor.tokenizer.convert_ids_to_tokens(config.image_token_id)
    return LlavaNextSpec(
        token_by_modality={Modality.IMAGE: token},
        token_id_by_modality={Modality.IMAGE: config.image_token_id},
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
        tile_pixels=vision.image_size,
        patches_per_side=vision.image_size // vision.patch_size,
        extra_tokens=1 if config.vision_feature_select_strategy == "full" else 0,
        grid_pinpoints=tuple(tuple(p) for p in config.image_grid_pinpoints),
    )


class LlavaNextAdapter(LlavaAdapter):
    MODEL_CLASS = LlavaNextForConditionalGeneration

    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        if (
            part == Part.ENCODER
        ):  # the image kwargs the processor's __call__ merges (do_pad for anyres)
            self._kwargs = merged_kwargs(AutoProcessor.from_pretrained(checkpoint))["images_kwargs"]

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        images = [Image.fromarray(np.ascontiguousarray(item.data)) for item in items]
        inputs = self._processor(images=images, **self._kwargs)
        out = self._llava.get_image_features(
            pixel_values=inputs["pixel_values"].to(self.device, self.dtype),
            image_sizes=inputs["image_sizes"].to(self.device),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        return [features.contiguous() for features in out.pooler_output]


ADAPTER = LlavaNextAdapter
