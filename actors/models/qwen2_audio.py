"""Qwen2-Audio family: Whisper-style audio encoder + projector + Qwen2 LM. Audio only.

Qwen2-Audio has no `get_audio_features`: its audio path is inline in the model's forward,
so `_audio_features` mirrors it (tower over one padded window per item, attention masked
to the item's frames, projector, rows cut to the item's output length). Audio longer than
the feature extractor's window is split at the ingress (see `split_windows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration
from transformers.masking_utils import create_bidirectional_mask

from actors.models.adapter import ItemLayout, ModelAdapter, Part, PlaceholderSpec, merged_kwargs
from actors.models.part_load import load_part
from actors.types import MediaItem
from router.types import Modality


def audio_output_length(num_frames: int) -> int:
    """Embeddings a Whisper-style tower (two stride-2 stages) makes of `num_frames` mel frames."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def audio_embeddings(num_samples: int, hop_length: int) -> int:
    # The feature extractor's frame mask keeps every hop_length-th sample of the padded clip.
    return audio_output_length(math.ceil(num_samples / hop_length))


def split_windows(samples: np.ndarray, window_samples: int) -> list[np.ndarray]:
    """A clip split into the fewest windows of at most `window_samples`, of near-equal length,
    so no window is a sliver (a tower needs a few frames to make any embedding)."""
    count = max(1, math.ceil(len(samples) / window_samples))
    return [np.ascontiguousarray(part) for part in np.array_split(samples, count)]


@dataclass(frozen=True)
class AudioSpec(PlaceholderSpec):
    """Audio only; embeddings follow from the clip's length (see audio_embeddings)."""

    def layout(self, item: MediaItem) -> ItemLayout:
        if item.modality != Modality.AUDIO:
            raise self._refuse(item)
        return ItemLayout(audio_embeddings(len(item.data), self.hop_length))


def build_spec(config, processor, dtype_bytes: int) -> AudioSpec:
    fe = processor.feature_extractor
    return AudioSpec(
        token_by_modality={Modality.AUDIO: processor.audio_token},
        token_id_by_modality={Modality.AUDIO: config.audio_token_id},
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
        audio_sample_rate_hz=fe.sampling_rate,
        audio_window_samples=fe.n_samples,
        hop_length=fe.hop_length,
    )


class Qwen2AudioAdapter(ModelAdapter):
    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        model = load_part(
            Qwen2AudioForConditionalGeneration, checkpoint, part, dtype=dtype, device=device
        )
        inner = model.model
        if part == Part.ENCODER:
            self._processor = AutoProcessor.from_pretrained(checkpoint)
            self._audio_kwargs = merged_kwargs(self._processor)["audio_kwargs"]
            self._tower, self._projector = inner.audio_tower, inner.multi_modal_projector
        else:
            self._lm, self._lm_head = inner.language_model, model.lm_head

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        features, _ = self._processor._process_audio(
            [item.data for item in items], **self._audio_kwargs
        )
        mel = features["input_features"].to(self.device, self.dtype)
        feat_lengths, out_lengths = self._tower._get_feat_extract_output_lengths(
            features["feature_attention_mask"].sum(-1)
        )
        projected = self._projector(
            self._tower(mel, attention_mask=self._mask(mel, feat_lengths)).last_hidden_state
        )
        return [rows[:n].contiguous() for rows, n in zip(projected, out_lengths.tolist())]

    def _mask(self, mel: torch.Tensor, feat_lengths: torch.Tensor):
        """The tower's attention mask over its post-conv sequence, as the model's forward
        builds it."""
        batch, _, num_frames = mel.shape
        seq_len = (num_frames - 2) // 2 + 1
        valid = torch.arange(seq_len, device=mel.device).unsqueeze(0) < feat_lengths.to(
            mel.device
        ).unsqueeze(1)
        dummy = torch.zeros((batch, seq_len, 1), dtype=self.dtype, device=mel.device)
        return create_bidirectional_mask(
            config=self._tower.config, inputs_embeds=dummy, attention_mask=valid.long()
        )


ADAPTER = Qwen2AudioAdapter
