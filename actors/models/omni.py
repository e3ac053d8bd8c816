"""Qwen2.5-Omni thinker, bare (`qwen2_5_omni_thinker`) or inside the published layout
(`qwen2_5_omni`, talker ignored): one model for images, video and audio (vision tower with 2x2 patch
merging and 2-frame temporal patches, Whisper-style audio tower, LM with 3-D rotary positions).

Encoding calls the checkpoint's own sub-processors with the kwargs its processor would merge,
so features equal what `processor(...)` gives. Positions: the prefill worker lays out the
prompt's 3-D positions with the model's own `get_rope_index` from each item's grid (carried in
PlaceholderRange), with explicit position ids, never the model's per-instance cached deltas
(unsafe across concurrent requests); decode adds the returned delta to cache lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration

from actors.models.adapter import ItemLayout, ModelAdapter, Part, merged_kwargs
from actors.models.part_load import load_part
from actors.models.qwen2_audio import audio_embeddings
from actors.models.qwen_vision import VisionEncoding, VisionGridSpec, vision_spec_fields
from actors.types import MediaItem, PlaceholderRange
from router.types import Modality


@dataclass(frozen=True)
class OmniSpec(VisionGridSpec):
    """Images and video as the vision tower's grids, audio as the audio tower's windows."""

    def layout(self, item: MediaItem) -> ItemLayout:
        if item.modality == Modality.AUDIO:
            return ItemLayout(audio_embeddings(len(item.data), self.hop_length))
        return super().layout(item)


def thinker_config(config):
    """The thinker's config: the checkpoint's own (bare thinker) or nested in the published
    layout's."""
    return getattr(config, "thinker_config", config)


def load_thinker(
    checkpoint: Path, dtype: torch.dtype, part: str | None = None, device: str = "cpu"
) -> Qwen2_5OmniThinkerForConditionalGeneration:
    """The thinker alone, or only its `part` (see part_load). From the published layout
    (`qwen2_5_omni`: thinker + talker + token2wav in one repo) only `thinker.*` tensors are
    read: the talker never reaches memory."""
    config = AutoConfig.from_pretrained(checkpoint)
    kwargs = {}
    if config.model_type == "qwen2_5_omni":
        kwargs = dict(config=config.thinker_config, key_mapping={r"^thinker\.": ""})
    return load_part(
        Qwen2_5OmniThinkerForConditionalGeneration,
        checkpoint,
        part,
        dtype=dtype,
        device=device,
        **kwargs,
    )


def build_spec(config, processor, dtype_bytes: int) -> OmniSpec:
    config = thinker_config(config)
    fe = processor.feature_extractor
    return OmniSpec(
        token_by_modality={
            Modality.IMAGE: processor.image_token,
            Modality.VIDEO: processor.video_token,
            Modality.AUDIO: processor.audio_token,
        },
        token_id_by_modality={
            Modality.IMAGE: config.image_token_id,
            Modality.VIDEO: config.video_token_id,
            Modality.AUDIO: config.audio_token_id,
        },
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
        audio_sample_rate_hz=fe.sampling_rate,
        audio_window_samples=fe.n_samples,
        hop_length=fe.hop_length,
        **vision_spec_fields(processor),
    )


class OmniAdapter(VisionEncoding, ModelAdapter):
    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        thinker = load_thinker(checkpoint, dtype, part, device)
        self._model = thinker.model  # on the LM side, its shell serves get_rope_index
        if part == Part.ENCODER:
            self._processor = AutoProcessor.from_pretrained(checkpoint)
            self._kwargs = merged_kwargs(self._processor)
        else:
            self._lm, self._lm_head = self._model.language_model, thinker.lm_head

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        encode = {
            Modality.IMAGE: self._images,
            Modality.VIDEO: self._videos,
            Modality.AUDIO: self._audio,
        }
        return [
            rows.contiguous() for rows in encode[items[0].modality]([item.data for item in items])
        ]

    def _audio(self, arrays: list[np.ndarray]):
        inputs, _ = self._processor._process_audio(arrays, **self._kwargs["audio_kwargs"])
        mask = inputs["feature_attention_mask"].to(self.device)
        rows = self._model.get_audio_features(
            inputs["input_features"].to(self.device, self.dtype), mask
        ).last_hidden_state
        return torch.split(rows, inputs["num_audio_tokens"].tolist())

    def prompt_positions(
        self, token_ids: torch.Tensor, ranges: tuple[PlaceholderRange, ...]
    ) -> tuple[torch.Tensor, int]:
        grids = {
            m: [r.grid_thw for r in ranges if r.modality == m]
            for m in (Modality.IMAGE, Modality.VIDEO)
        }
        if not any(
            grids.values()
        ):  # text and audio only: plain positions, as the model itself uses
            return super().prompt_positions(token_ids, ranges)
        as_tensor = lambda rows, dtype=torch.long: (
            torch.tensor(rows, dtype=dtype, device=token_ids.device) if rows else None
        )
        positions, deltas = self._model.get_rope_index(
            token_ids,
            image_grid_thw=as_tensor(grids[Modality.IMAGE]),
            video_grid_thw=as_tensor(grids[Modality.VIDEO]),
            attention_mask=torch.ones_like(token_ids),
            use_audio_in_video=False,
            # get_rope_index wants mel frames per audio; 4n - 1 frames is one length the tower
            # maps to n embeddings
            audio_seqlens=as_tensor(
                [4 * r.length - 1 for r in ranges if r.modality == Modality.AUDIO]
            ),
            second_per_grids=as_tensor(
                [r.seconds_per_grid for r in ranges if r.modality == Modality.VIDEO], torch.float32
            ),
        )
        return positions, int(deltas.reshape(-1)[0])


ADAPTER = OmniAdapter
