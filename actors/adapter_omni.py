"""Qwen2.5-Omni thinker: one model for images, video and audio (vision tower with 2x2 patch
merging and 2-frame temporal patches, Whisper-style audio tower, LM with 3-D rotary positions).

Encoding calls the checkpoint's own sub-processors with the kwargs its processor would merge,
so features equal what `processor(...)` gives. Positions: the prefill worker lays out the
prompt's 3-D positions with the model's own `get_rope_index` from each item's grid (carried in
PlaceholderRange), with explicit position ids, never the model's per-instance cached deltas
(unsafe across concurrent requests); decode adds the returned delta to cache lengths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from actors.adapter_qwen2_audio import audio_embeddings
from actors.adapters import ItemLayout, ModelAdapter, Part, PlaceholderSpec, merged_kwargs
from actors.types import MediaItem, Modality, PlaceholderRange

DEFAULT_VIDEO_FPS = 2.0  # what the processor assumes when no fps is given


@dataclass(frozen=True)
class OmniSpec(PlaceholderSpec):
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_pixels: tuple[int, int] = (0, 0)  # (min, max) pixels an image is resized into
    video_pixels: tuple[int, int] = (0, 0)  # the same per video frame

    def layout(self, item: MediaItem) -> ItemLayout:
        if item.modality == Modality.AUDIO:
            return ItemLayout(audio_embeddings(len(item.data), self.hop_length))
        if item.modality == Modality.IMAGE:
            grid = (1, *self._grid_hw(item.data.shape[0], item.data.shape[1], self.image_pixels))
            return ItemLayout(self._tokens(grid), grid)
        frames = item.data.shape[0]
        grid = (math.ceil(frames / self.temporal_patch_size), *self._grid_hw(item.data.shape[1], item.data.shape[2], self.video_pixels))
        fps = item.frames_per_s or DEFAULT_VIDEO_FPS
        return ItemLayout(self._tokens(grid), grid, self.temporal_patch_size / fps)

    def _grid_hw(self, height: int, width: int, pixels: tuple[int, int]) -> tuple[int, int]:
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, min_pixels=pixels[0], max_pixels=pixels[1])
        return h // self.patch_size, w // self.patch_size

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge_size**2


def build_spec(config, processor, dtype_bytes: int) -> OmniSpec:
    kwargs, fe, video = merged_kwargs(processor), processor.feature_extractor, processor.video_processor
    images, videos = kwargs["images_kwargs"], kwargs["videos_kwargs"]
    image_size = images.get("size") or processor.image_processor.size
    video_size = videos.get("size") or video.size
    return OmniSpec(
        token_by_modality={Modality.IMAGE: processor.image_token, Modality.VIDEO: processor.video_token,
                           Modality.AUDIO: processor.audio_token},
        token_id_by_modality={Modality.IMAGE: config.image_token_id, Modality.VIDEO: config.video_token_id,
                              Modality.AUDIO: config.audio_token_id},
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
        audio_sample_rate_hz=fe.sampling_rate, audio_window_samples=fe.n_samples, hop_length=fe.hop_length,
        patch_size=video.patch_size, merge_size=video.merge_size, temporal_patch_size=video.temporal_patch_size,
        image_pixels=(images.get("min_pixels", image_size["shortest_edge"]), images.get("max_pixels", image_size["longest_edge"])),
        video_pixels=(video_size["shortest_edge"], video_size["longest_edge"]),
    )


class OmniAdapter(ModelAdapter):
    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        thinker = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype)
        self._model = thinker.model
        if part == Part.ENCODER:
            self._processor = AutoProcessor.from_pretrained(checkpoint)
            self._kwargs = merged_kwargs(self._processor)
            self._model.language_model = None  # the encoder never runs the LM: free it
        else:
            self._model.audio_tower = self._model.visual = None  # towers are the encoder's
            self._lm, self._lm_head = self._model.language_model, thinker.lm_head.to(device).eval()
        self._model.to(device).eval()  # kept whole on the LM side for get_rope_index
        del thinker

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        encode = {Modality.IMAGE: self._images, Modality.VIDEO: self._videos, Modality.AUDIO: self._audio}
        return [rows.contiguous() for rows in encode[items[0].modality]([item.data for item in items])]

    def _images(self, arrays: list[np.ndarray]):
        images = [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]
        inputs = self._processor.image_processor(images, **self._kwargs["images_kwargs"])
        pixels, grid = inputs["pixel_values"].to(self.device, self.dtype), inputs["image_grid_thw"].to(self.device)
        return self._model.get_image_features(pixels, grid).pooler_output

    def _videos(self, arrays: list[np.ndarray]):
        # Say the layout: left to guess, the processor reads frames 1 or 3 pixels high as
        # channels-first (a 1x1 GIF became 140 embeddings where the plan's grid says 144).
        kwargs = {**self._kwargs["videos_kwargs"], "input_data_format": "channels_last"}
        inputs = self._processor.video_processor(list(arrays), **kwargs)
        pixels, grid = inputs["pixel_values_videos"].to(self.device, self.dtype), inputs["video_grid_thw"].to(self.device)
        return self._model.get_video_features(pixels, grid).pooler_output

    def _audio(self, arrays: list[np.ndarray]):
        inputs, _ = self._processor._process_audio(arrays, **self._kwargs["audio_kwargs"])
        mask = inputs["feature_attention_mask"].to(self.device)
        rows = self._model.get_audio_features(inputs["input_features"].to(self.device, self.dtype), mask).last_hidden_state
        return torch.split(rows, inputs["num_audio_tokens"].tolist())

    def prompt_positions(self, token_ids: torch.Tensor, ranges: tuple[PlaceholderRange, ...]) -> tuple[torch.Tensor, int]:
        grids = {m: [r.grid_thw for r in ranges if r.modality == m] for m in (Modality.IMAGE, Modality.VIDEO)}
        if not any(grids.values()):  # text and audio only: plain positions, as the model itself uses
            return super().prompt_positions(token_ids, ranges)
        as_tensor = lambda rows, dtype=torch.long: torch.tensor(rows, dtype=dtype, device=token_ids.device) if rows else None
        positions, deltas = self._model.get_rope_index(
            token_ids, image_grid_thw=as_tensor(grids[Modality.IMAGE]), video_grid_thw=as_tensor(grids[Modality.VIDEO]),
            attention_mask=torch.ones_like(token_ids), use_audio_in_video=False,
            # get_rope_index wants mel frames per audio; 4n - 1 frames is one length the tower maps to n embeddings
            audio_seqlens=as_tensor([4 * r.length - 1 for r in ranges if r.modality == Modality.AUDIO]),
            second_per_grids=as_tensor([r.seconds_per_grid for r in ranges if r.modality == Modality.VIDEO], torch.float32),
        )
        return positions, int(deltas.reshape(-1)[0])

    def step_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.unsqueeze(0).expand(3, -1, -1)  # text tokens: the same position on all three axes


ADAPTER = OmniAdapter
