"""Qwen2.5-VL: the Qwen vision tower (dynamic resolution, images and video) + Qwen2 LM with
3-D rotary positions. Images and video only.

Grids, encoding and decode-step positions are the shared Qwen vision pieces (`qwen_vision`).
The prompt's 3-D positions come from the model's own `get_rope_index`, given each item's grid
and (video) seconds per temporal step from its PlaceholderRange, with explicit position ids,
never the model's per-instance cached deltas (unsafe across concurrent requests).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from actors.models.adapter import ModelAdapter, Part, merged_kwargs
from actors.models.part_load import load_part
from actors.models.qwen_vision import VisionEncoding, VisionGridSpec, vision_spec_fields
from actors.types import MediaItem, PlaceholderRange
from router.types import Modality

# get_rope_index's token types (`mm_token_type_ids`): text 0, image 1, video 2
_TOKEN_TYPE = {Modality.IMAGE: 1, Modality.VIDEO: 2}


def build_spec(config, processor, dtype_bytes: int) -> VisionGridSpec:
    return VisionGridSpec(
        token_by_modality={
            Modality.IMAGE: processor.image_token,
            Modality.VIDEO: processor.video_token,
        },
        token_id_by_modality={
            Modality.IMAGE: config.image_token_id,
            Modality.VIDEO: config.video_token_id,
        },
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
        **vision_spec_fields(processor),
    )


class Qwen2_5_VLAdapter(VisionEncoding, ModelAdapter):
    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        model = load_part(
            Qwen2_5_VLForConditionalGeneration, checkpoint, part, dtype=dtype, device=device
        )
        self._model = model.model  # on the LM side, its shell serves get_rope_index
        if part == Part.ENCODER:
            self._processor = AutoProcessor.from_pretrained(checkpoint)
            self._kwargs = merged_kwargs(self._processor)
        else:
            self._lm, self._lm_head = self._model.language_model, model.lm_head

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        encode = {Modality.IMAGE: self._images, Modality.VIDEO: self._videos}
        return [
            rows.contiguous() for rows in encode[items[0].modality]([item.data for item in items])
        ]

    def prompt_positions(
        self, token_ids: torch.Tensor, ranges: tuple[PlaceholderRange, ...]
    ) -> tuple[torch.Tensor, int]:
        if not ranges:  # text only: plain positions, as the model itself uses
            return super().prompt_positions(token_ids, ranges)
        device = token_ids.device
        token_types = torch.zeros_like(token_ids, dtype=torch.int32)
        for r in ranges:
            token_types[0, r.offset : r.offset + r.length] = _TOKEN_TYPE[r.modality]
        grids = {m: [r.grid_thw for r in ranges if r.modality == m] for m in _TOKEN_TYPE}
        as_tensor = lambda rows, dtype=torch.long: (
            torch.tensor(rows, dtype=dtype, device=device) if rows else None
        )
        positions, deltas = self._model.get_rope_index(
            token_ids,
            token_types,
            image_grid_thw=as_tensor(grids[Modality.IMAGE]),
            video_grid_thw=as_tensor(grids[Modality.VIDEO]),
            attention_mask=torch.ones_like(token_ids),
            second_per_grid_ts=as_tensor(
                [r.seconds_per_grid for r in ranges if r.modality == Modality.VIDEO], torch.float32
            ),
        )
        return positions, int(deltas.reshape(-1)[0])


ADAPTER = Qwen2_5_VLAdapter
