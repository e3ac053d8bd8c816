"""Model adapters: the one interface between the workers and a Hugging Face model family.

An adapter knows which parts of a checkpoint are the towers, the projector and the
language model. The encoder actor calls `encode`; the prefill and decode actors call
`embed_tokens`, `forward`, `logits` and the position helpers; the ingress needs only a
`PlaceholderSpec`, which is built from the config and processor (no weights). Each family
lives in its own module (`adapter_llava`, `adapter_qwen2_audio`, `adapter_omni`) and is
named in `FAMILIES` by its config's `model_type`.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig

from actors.engine import kv
from actors.types import MediaItem, PlaceholderRange
from router.types import Modality


class Part:
    ENCODER = "encoder"
    LANGUAGE_MODEL = "language_model"


@dataclass(frozen=True)
class ItemLayout:
    """How one item sits in the prompt: its embedding count and, for 3-D rotary models,
    its grid (see PlaceholderRange)."""

    num_embeddings: int
    grid_thw: tuple[int, int, int] | None = None
    seconds_per_grid: float | None = None


@dataclass(frozen=True)
class PlaceholderSpec(abc.ABC):
    """What the ingress needs to plan a prompt: the placeholder token per modality, how an
    item becomes embeddings, and how audio is windowed. Built without weights."""

    token_by_modality: dict[Modality, str] = field(default_factory=dict)
    token_id_by_modality: dict[Modality, int] = field(default_factory=dict)
    embedding_bytes_per_token: int = 0  # one embedding row as it travels (LM width x dtype size)
    kv_bytes_per_token: int = 0  # one token's KV over every layer (kv.bytes_per_token)
    audio_sample_rate_hz: int = 16000
    audio_window_samples: int | None = None  # longer clips are split into windows of at most this
    hop_length: int = 160  # audio samples per mel frame

    @abc.abstractmethod
    def layout(self, item: MediaItem) -> ItemLayout:
        """The item's layout; ValueError if this model does not take its modality."""

    def num_embeddings(self, item: MediaItem) -> int:
        return self.layout(item).num_embeddings

    @property
    def modalities(self) -> frozenset[Modality]:
        return frozenset(self.token_by_modality)

    def _refuse(self, item: MediaItem) -> ValueError:
        return ValueError(f"this model does not take {item.modality.value} input")


class ModelAdapter(abc.ABC):
    """One loaded checkpoint, restricted to the parts one worker kind needs."""

    def __init__(self, checkpoint: Path, *, part: str, dtype: torch.dtype, device: str):
        self.checkpoint, self.part, self.dtype, self.device = checkpoint, part, dtype, device

    @abc.abstractmethod
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """Embeddings, one [num_embeddings, hidden] tensor per item; items share a modality."""

    def tower_linears(self) -> list[torch.nn.Module]:
        """The linear layers of the modules this adapter holds (for the encoder part: its
        towers and projectors). A tower's forward pauses before them for a short prompt on the
        node (actors/engine/node_priority.py): a block is too coarse, as a 30-frame video's
        tower has 4 blocks of a few hundred ms each on the CPU host."""
        roots = [v for v in vars(self).values() if isinstance(v, torch.nn.Module)]
        found = {id(m): m for r in roots for m in r.modules() if isinstance(m, torch.nn.Linear)}
        return list(found.values())

    # The language-model side: families set self._lm (the decoder stack, with embed_tokens)
    # and self._lm_head when part == LANGUAGE_MODEL.
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._lm.embed_tokens(token_ids)

    def forward(self, inputs_embeds, position_ids, cache, attention_mask=None) -> torch.Tensor:
        """Last hidden states of the language model; `cache` is updated in place."""
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

    def step_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """A decode step's attention mask from its [B, L] valid slots. Where SDPA serves every
        layer over the full window, the 4D boolean mask SDPA takes as is: from a 2D mask
        transformers would build it again each step and sync the host to check it."""
        return valid.bool()[:, None, None, :] if self._one_mask_serves_all else valid

    @functools.cached_property
    def _one_mask_serves_all(self) -> bool:
        """Decided once per loaded model: the config does not change between steps."""
        return _full_window_sdpa(self._lm.config)

    def decoder_layers(self) -> list:
        """The language model's decoder layers, in order (prefill preempts between them)."""
        return list(self._lm.layers)

    @property
    def full_window_layers(self) -> int:
        """The language model's layer count where every layer attends the whole window with
        SDPA (a prompt's cache may then be one buffer: prompt_kv.py); else 0."""
        return self._lm.config.num_hidden_layers if self._one_mask_serves_all else 0

    def prompt_positions(
        self, token_ids: torch.Tensor, ranges: tuple[PlaceholderRange, ...]
    ) -> tuple[torch.Tensor, int]:
        """Position ids of a [1, L] prompt and the rope delta decode must add to cache lengths."""
        return torch.arange(token_ids.shape[1], device=token_ids.device).unsqueeze(0), 0

    def step_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Decode-step position ids from plain [B, 1] positions (delta already added)."""
        return positions


def merged_kwargs(processor) -> dict:
    """Per-modality kwargs exactly as the processor's own __call__ merges them, so encoders
    that call its sub-processors get the features `processor(...)` would give."""
    return processor._merge_kwargs(
        tokenizer_init_kwargs=processor.tokenizer.init_kwargs, return_tensors="pt"
    )


# model_type -> module defining ADAPTER (a ModelAdapter) and
# build_spec(config, processor, dtype_bytes)
FAMILIES: dict[str, str] = {
    "llava": "actors.models.llava",
    "qwen2_audio": "actors.models.qwen2_audio",
    "qwen2_5_omni_thinker": "actors.models.omni",
    "qwen2_5_vl": "actors.models.qwen2_5_vl",
    "llava_next": "actors.models.llava_next",
    # the published layout: its thinker is served, the talker ignored
    "qwen2_5_omni": "actors.models.omni",
}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class UnsupportedFamily(ValueError):
    pass


def check_family(checkpoint: Path) -> str:
    """The checkpoint's model_type; UnsupportedFamily naming it and the supported ones if epd has no
    adapter for it. Reads config.json itself: transformers may not know the type either."""
    try:
        model_type = json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise UnsupportedFamily(
            f"checkpoint {checkpoint} has no readable config.json: {exc}"
        ) from None
    if model_type not in FAMILIES:
        raise UnsupportedFamily(
            f"checkpoint {checkpoint} has model_type {model_type!r}, which epd does not serve; "
            f"supported model_type values: {', '.join(sorted(FAMILIES))}"
        )
    return model_type


def _family(config):
    if config.model_type not in FAMILIES:
        raise UnsupportedFamily(
            f"model_type {config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return importlib.import_module(FAMILIES[config.model_type])


def device_dtype(dtype: str, device: str) -> str:
    """`auto` as this worker's device has it: bfloat16 on GPUs with native support (compute
    capability 8.0 and up), float16 on older ones (a T4 only emulates bfloat16, slowly),
    float32 on CPU. Decided on the worker's own node: node types may differ."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    return "bfloat16" if torch.cuda.get_device_capability(device)[0] >= 8 else "float16"


def load_adapter(checkpoint: Path, *, part: str, dtype: str, device: str) -> ModelAdapter:
    """`part` of the checkpoint on `device`, in `dtype` (`auto` resolved for that device)."""
    family = _family(AutoConfig.from_pretrained(checkpoint))
    if device.startswith("cuda"):
        # cuDNN's attention builds an execution plan per new sequence length: on an H100 it
        # took 3 ms of CPU per layer call where the kernel ran 4 us, every decode step (each
        # has a new KV length) and every prefill chunk. SDPA then picks flash or efficient.
        torch.backends.cuda.enable_cudnn_sdp(False)
    return family.ADAPTER(
        checkpoint, part=part, dtype=getattr(torch, device_dtype(dtype, device)), device=device
    )


def placeholder_spec(checkpoint: Path, processor, dtype: str = "float32") -> PlaceholderSpec:
    config = AutoConfig.from_pretrained(checkpoint)
    spec = _family(config).build_spec(config, processor, DTYPE_BYTES[dtype])
    return dataclasses.replace(
        spec, kv_bytes_per_token=kv.bytes_per_token(config.get_text_config(), DTYPE_BYTES[dtype])
    )


def _full_window_sdpa(config) -> bool:
    """SDPA attention (a boolean mask; eager adds a float one) and no sliding-window layer
    (one mask then serves every layer)."""
    layers = getattr(config, "layer_types", None) or ()
    return (
        config._attn_implementation == "sdpa"
        and all(kind == "full_attention" for kind in layers)
        and (bool(layers) or getattr(config, "sliding_window", None) is None)
    )
