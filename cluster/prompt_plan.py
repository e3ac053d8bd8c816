"""Prompt planning at the ingress: audio windowing, chat template, placeholder expansion
to the exact number of embeddings each item becomes, and the placeholder ranges (with any
3-D position grid) prefill splices into.

Runs on the processor and the model config only: no weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import AutoProcessor

from actors.models.adapter import PlaceholderSpec, placeholder_spec
from actors.models.qwen2_audio import split_windows
from actors.types import MediaItem, PlaceholderRange
from cluster.media.identifiers import media_identifier
from cluster.tokenizer_calls import text_ids
from router.types import Modality


class PromptError(ValueError):
    """The request cannot be turned into a prompt for this model."""


@dataclass(frozen=True)
class PromptPlan:
    token_ids: tuple[int, ...]
    placeholders: tuple[PlaceholderRange, ...]  # one per item, in request order
    num_embeddings: tuple[int, ...]
    items: tuple[
        MediaItem, ...
    ] = ()  # what is encoded: the request's items, long audio split into windows


class PromptPlanner:
    def __init__(self, checkpoint: Path, dtype: str = "float32", template: Path | None = None):
        """`template`: a chat template file used instead of the checkpoint's."""
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.tokenizer = self.processor.tokenizer
        self.text_ids = text_ids(self.tokenizer)
        self.spec: PlaceholderSpec = placeholder_spec(checkpoint, self.processor, dtype)
        self.template = template.read_text() if template is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template has a tool format (it reads `tools`)."""
        source = self.template or self.processor.chat_template or ""
        return "tools" in str(source)

    def render(self, hf_messages: list[dict], tools=None, template_kwargs=None) -> str:
        extra = {"chat_template": self.template} if self.template else {}
        if tools:
            extra["tools"] = tools
        return self.processor.apply_chat_template(
            hf_messages,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
            **extra,
        )

    def check_item(self, item: MediaItem) -> None:
        """PromptError naming the problem if this model's processor cannot take `item`'s shape:
        an aspect ratio or size it refuses, a clip too short to make a single embedding."""
        try:
            layout = self.spec.layout(item)
        except ValueError as exc:  # the family's own resize or layout rules refused it
            raise PromptError(
                f"this model cannot take this {item.modality.value} ({_shape(item)}): {exc}"
            ) from None
        if layout.num_embeddings < 1:
            shortest = self._shortest_audio_samples() * 1e3 / self.spec.audio_sample_rate_hz
            raise PromptError(
                f"this {item.modality.value} ({_shape(item)}) is too short for this model, "
                f"which needs at least {shortest:.1f} ms to make one embedding"
            )

    @functools.cache  # noqa: B019 - one planner per replica, for its lifetime
    def _shortest_audio_samples(self) -> int:
        """The fewest samples of audio this model makes an embedding of (a bisection over the
        family's own length rule)."""
        low, high = 1, self.spec.audio_window_samples or self.spec.audio_sample_rate_hz * 30
        while low < high:
            mid = (low + high) // 2
            probe = MediaItem(Modality.AUDIO, "", np.zeros(mid, np.float32))
            low, high = (low, mid) if self.spec.layout(probe).num_embeddings else (mid + 1, high)
        return low

    def plan(
        self, hf_messages: list[dict], items: list[MediaItem], tools=None, template_kwargs=None
    ) -> PromptPlan:
        """`tools` (OpenAI's tool objects) and `template_kwargs` go to the chat template."""
        hf_messages, items = self.window_audio(hf_messages, items)
        layouts = [self.spec.layout(item) for item in items]
        counts = tuple(layout.num_embeddings for layout in layouts)
        text = self._expand(self.render(hf_messages, tools, template_kwargs), items, counts)
        ids = np.asarray(self.text_ids(text), dtype=np.int64)
        ranges = tuple(
            PlaceholderRange(
                r.offset, r.length, item.modality, layout.grid_thw, layout.seconds_per_grid
            )
            for r, item, layout in zip(self._ranges(ids, items, counts), items, layouts)
        )
        return PromptPlan(tuple(ids.tolist()), ranges, counts, tuple(items))

    def plan_text(self, prompt: str | list[int]) -> PromptPlan:
        """A completions prompt: no chat template, special tokens as the tokenizer adds them
        (as vLLM); token ids as given. Media placeholders have no media here: refused."""
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        vocab = len(self.tokenizer)
        reserved = {
            self.spec.token_id_by_modality[m]: token
            for m, token in self.spec.token_by_modality.items()
        }
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise PromptError(
                    f"token id {token_id} is not in this model's vocabulary of {vocab} tokens"
                )
            if token_id in reserved:
                raise PromptError(f"the prompt holds the reserved media token {reserved[token_id]}")
        if not ids:
            raise PromptError("the prompt has no tokens")
        return PromptPlan(tuple(ids), (), ())

    def window_audio(
        self, hf_messages: list[dict], items: list[MediaItem]
    ) -> tuple[list[dict], list[MediaItem]]:
        """Split clips longer than the model's audio window into windows, each its own audio
        part of the message (the way the model's processor takes several clips)."""
        window = self.spec.audio_window_samples
        if window is None or not any(
            i.modality == Modality.AUDIO and len(i.data) > window for i in items
        ):
            return hf_messages, items
        pending, out_items, out_messages = iter(items), [], []
        for message in hf_messages:
            content = []
            for part in message["content"] if isinstance(message["content"], list) else ():
                if part.get("type") not in {m.value for m in Modality}:
                    content.append(part)
                    continue
                item = next(pending)
                pieces = self._windows(item) if item.modality == Modality.AUDIO else [item]
                out_items.extend(pieces)
                content.extend(dict(part) for _ in pieces)
            out_messages.append({**message, "content": content or message["content"]})
        return out_messages, out_items

    def _windows(self, item: MediaItem) -> list[MediaItem]:
        if len(item.data) <= self.spec.audio_window_samples:
            return [item]
        namespace = item.identifier  # a window's identity derives from its clip's
        return [
            MediaItem(
                Modality.AUDIO,
                media_identifier(namespace, Modality.AUDIO, part, rate=item.sample_rate_hz),
                part,
                item.sample_rate_hz,
            )
            for part in split_windows(item.data, self.spec.audio_window_samples)
        ]

    def _expand(self, text: str, items: list[MediaItem], counts: tuple[int, ...]) -> str:
        """Replace the k-th placeholder of each modality by its item's run of placeholders."""
        for modality, token in self.spec.token_by_modality.items():
            pieces = text.split(token)
            mine = [n for item, n in zip(items, counts) if item.modality == modality]
            if len(pieces) - 1 != len(mine):
                raise PromptError(
                    f"prompt has {len(pieces) - 1} {token} placeholders for {len(mine)} "
                    f"{modality.value} items; "
                    f"the text must not contain the reserved token {token}"
                )
            text = pieces[0] + "".join(token * n + rest for n, rest in zip(mine, pieces[1:]))
        return text

    def _ranges(
        self, ids: np.ndarray, items: list[MediaItem], counts: tuple[int, ...]
    ) -> tuple[PlaceholderRange, ...]:
        """Items take consecutive runs of their modality's placeholder positions, in order."""
        positions = {
            m: np.flatnonzero(ids == tid) for m, tid in self.spec.token_id_by_modality.items()
        }
        taken = {m: 0 for m in positions}
        ranges = []
        for item, n in zip(items, counts):
            run = positions[item.modality][taken[item.modality] : taken[item.modality] + n]
            if len(run) != n or run[-1] - run[0] != n - 1:
                raise PromptError(
                    f"placeholder run for a {item.modality.value} item is not contiguous "
                    "after tokenization"
                )
            taken[item.modality] += n
            ranges.append(PlaceholderRange(int(run[0]), n))
        return tuple(ranges)


def _shape(item: MediaItem) -> str:
    """The item's size as a client would state it."""
    if item.modality == Modality.AUDIO:
        return f"{len(item.data) * 1e3 / (item.sample_rate_hz or 1):.1f} ms"
    height, width = item.data.shape[-3:-1]
    if item.modality == Modality.VIDEO:
        return f"{item.data.shape[0]} frames of {width}x{height} pixels"
    return f"{width}x{height} pixels"
