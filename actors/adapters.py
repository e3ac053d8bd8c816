"""Model adapters: which parts of a Hugging Face checkpoint are the towers, the projector
and the language model, and how many placeholder tokens one item expands to.

The encoder actor calls `encode`; the prefill and decode actors call `embed_tokens`,
`forward` and `logits`; the ingress calls only `num_embeddings` (through a
`PlaceholderSpec`, which needs no weights). New families (audio, all-modality)
subclass `ModelAdapter` and register themselves in `ADAPTERS`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor, LlavaForConditionalGeneration

from actors.types import MediaItem, Modality


class Part:
    ENCODER = "encoder"
    LANGUAGE_MODEL = "language_model"


@dataclass(frozen=True)
class PlaceholderSpec:
    """What the ingress needs to plan a prompt: the placeholder token per modality and
    how many embeddings one item becomes. Built from the config alone (no weights)."""

    token_by_modality: dict[Modality, str]
    token_id_by_modality: dict[Modality, int]
    image_embeddings: int
    embedding_bytes_per_token: int  # one embedding row as it travels (LM width x dtype size)

    def num_embeddings(self, item: MediaItem) -> int:
        if item.modality == Modality.IMAGE:
            return self.image_embeddings
        raise ValueError(f"this model does not take {item.modality.value} input")

    @property
    def modalities(self) -> frozenset[Modality]:
        return frozenset(self.token_by_modality)


class ModelAdapter(abc.ABC):
    """One loaded checkpoint, restricted to the parts one worker kind needs."""

    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        self.checkpoint, self.part, self.dtype, self.device = checkpoint, part, dtype, device

    @abc.abstractmethod
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Embeddings, one [num_embeddings, hidden] tensor per item; items share a modality."""

    @abc.abstractmethod
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def forward(self, inputs_embeds, position_ids, cache, attention_mask=None) -> torch.Tensor:
        """Last hidden states of the language model; `cache` is updated in place."""

    @abc.abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class LlavaAdapter(ModelAdapter):
    """LLaVA family: CLIP/SigLIP vision tower + projector + a Llama/Qwen2-style LM."""

    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        super().__init__(checkpoint, part=part, dtype=dtype, device=device)
        model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype)
        self.config = model.config
        if part == Part.ENCODER:
            self._processor = AutoProcessor.from_pretrained(checkpoint).image_processor
            self._llava = model.model
            self._llava.language_model = None  # the encoder never runs the LM: free it
            self._llava.to(device).eval()
        else:
            self._lm = model.model.language_model.to(device).eval()
            self._lm_head = model.lm_head.to(device).eval()
            # keep the LM's embedding table only (towers and projector are the encoder's)
        del model

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

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._lm.embed_tokens(token_ids)

    def forward(self, inputs_embeds, position_ids, cache, attention_mask=None) -> torch.Tensor:
        out = self._lm(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden)


def _llava_spec(config, tokenizer, dtype_bytes: int) -> PlaceholderSpec:
    vision = config.vision_config
    num_patches = (vision.image_size // vision.patch_size) ** 2
    extra = 1 if config.vision_feature_select_strategy == "full" else 0
    token = tokenizer.convert_ids_to_tokens(config.image_token_id)
    return PlaceholderSpec(
        token_by_modality={Modality.IMAGE: token},
        token_id_by_modality={Modality.IMAGE: config.image_token_id},
        image_embeddings=num_patches + extra,
        embedding_bytes_per_token=config.text_config.hidden_size * dtype_bytes,
    )


ADAPTERS: dict[str, tuple[type[ModelAdapter], callable]] = {
    "llava": (LlavaAdapter, _llava_spec),
}


def _family(config) -> str:
    if config.model_type not in ADAPTERS:
        raise ValueError(f"unsupported model family {config.model_type!r}; known: {sorted(ADAPTERS)}")
    return config.model_type


def load_adapter(checkpoint: Path, *, part: str, dtype: str, device: str) -> ModelAdapter:
    adapter_cls, _ = ADAPTERS[_family(AutoConfig.from_pretrained(checkpoint))]
    return adapter_cls(checkpoint, part=part, dtype=getattr(torch, dtype), device=device)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def placeholder_spec(checkpoint: Path, tokenizer, dtype: str = "float32") -> PlaceholderSpec:
    config = AutoConfig.from_pretrained(checkpoint)
    return ADAPTERS[_family(config)][1](config, tokenizer, DTYPE_BYTES[dtype])
