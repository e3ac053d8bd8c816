"""LLaVA family: CLIP/SigLIP vision tower + projector + a Llama/Qwen2-style LM. Images only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration

from actors.models.adapter import ItemLayout, ModelAdapter, Part, PlaceholderSpec
from actors.models.part_load import load_part
from actors.types import MediaItem
from router.types import Modality


class LlavaAdapter(ModelAdapter):
    MODEL_CLASS = LlavaForConditionalGeneration  # LLaVA-NeXT subclasses with its own

    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        model = load_part(self.MODEL_CLASS, checkpoint, part, dtype=dtype, device=device)
        self.config = model.config
        if part == Part.ENCODER:
            self._processor = AutoProcessor.from_pretrained(checkpoint).image_processor
            self._llava = model.model  # towers and projector only: the LM was never loaded
        else:
            self._lm, self._lm_head = model.model.language_model, model.lm_head

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        images = [Image.fromarray(np.ascontiguousarray(item.data)) for item in items]
        pixels = self._processor(images=images, return_tensors="pt")["pixel_values"]
        out = self._llava.get_image_features(
            pixel_values=pixels.to(self.device, self.dtype),
            vision_feature_layer=self.config.vision_feature_layer,
            vision_feature_select_strategy=self.config.vision_feature_select_strategy,
        )
        return [features.contiguous() for features in out.pooler_output]


@dataclass(frozen=True)
class LlavaSpec(PlaceholderSpec):
    """Every image becomes the same number of embeddings (the tower's fixed input size)."""

    image_embeddings: int = 0

    def layout(self, item: MediaItem) -> ItemLayout:
        if item.modality != Modality.IMAGE:
            raise self._refuse(item)
        return ItemLayout(self.image_embeddings)


def build_spec(config, processor, dtype_bytes: int) -> LlavaSpec:
    vision = config.vision_config
    num_patches = (vision.image_size // vision.patch_size) ** 2
    extra = 1 if config.vision_feature_select_strategy == "full" else 0
    token = processor.tokenizer.convert_ids_to_tokens(config.image_token_id)
    return LlavaSpec(
        token_by_modality={Modality.IMAGE: token},
        token_id_by_modality={Modality.IMAGE: config.image_token_id},
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
        image_embeddings=num_patches + extra,
    )


ADAPTER = LlavaAdapter
