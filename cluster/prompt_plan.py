"""Prompt planning at the ingress: chat template, placeholder expansion to the exact
number of embeddings each item becomes, and the placeholder ranges prefill splices into.

Runs on the tokenizer and the model config only: no weights, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import AutoProcessor

from actors.adapters import PlaceholderSpec, placeholder_spec
from actors.types import MediaItem, PlaceholderRange


class PromptError(ValueError):
    """The request cannot be turned into a prompt for this model."""


@dataclass(frozen=True)
class PromptPlan:
    token_ids: tuple[int, ...]
    placeholders: tuple[PlaceholderRange, ...]  # one per item, in request order
    num_embeddings: tuple[int, ...]


class PromptPlanner:
    def __init__(self, checkpoint: Path, dtype: str = "float32"):
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.tokenizer = self.processor.tokenizer
        self.spec: PlaceholderSpec = placeholder_spec(checkpoint, self.tokenizer, dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    def render(self, hf_messages: list[dict]) -> str:
        return self.processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)

    def plan(self, hf_messages: list[dict], items: list[MediaItem]) -> PromptPlan:
        counts = tuple(self.spec.num_embeddings(item) for item in items)
        text = self._expand(self.render(hf_messages), items, counts)
        ids = np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        return PromptPlan(tuple(ids.tolist()), self._ranges(ids, items, counts), counts)

    def _expand(self, text: str, items: list[MediaItem], counts: tuple[int, ...]) -> str:
        """Replace the k-th placeholder of each modality by its item's run of placeholders."""
        for modality, token in self.spec.token_by_modality.items():
            pieces = text.split(token)
            mine = [n for item, n in zip(items, counts) if item.modality == modality]
            if len(pieces) - 1 != len(mine):
                raise PromptError(
                    f"prompt has {len(pieces) - 1} {token} placeholders for {len(mine)} {modality.value} items; "
                    f"the text must not contain the reserved token {token}"
                )
            text = pieces[0] + "".join(token * n + rest for n, rest in zip(mine, pieces[1:]))
        return text

    def _ranges(self, ids: np.ndarray, items: list[MediaItem], counts: tuple[int, ...]) -> tuple[PlaceholderRange, ...]:
        """Items take consecutive runs of their modality's placeholder positions, in order."""
        positions = {m: np.flatnonzero(ids == tid) for m, tid in self.spec.token_id_by_modality.items()}
        taken = {m: 0 for m in positions}
        ranges = []
        for item, n in zip(items, counts):
            run = positions[item.modality][taken[item.modality] : taken[item.modality] + n]
            if len(run) != n or run[-1] - run[0] != n - 1:
                raise PromptError(f"placeholder run for a {item.modality.value} item is not contiguous after tokenization")
            taken[item.modality] += n
            ranges.append(PlaceholderRange(int(run[0]), n))
        return tuple(ranges)
