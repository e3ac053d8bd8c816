"""Stage-only weight loading: a worker builds only its part of the model and reads only that
part's tensors from the checkpoint, so an encoder node never holds the language model.

Every family served here has one shape: `XForConditionalGeneration` = `model` (towers,
projector, `model.language_model`) + `lm_head`. The parts:
* `Part.LANGUAGE_MODEL`: `model.language_model` (embed_tokens included) + `lm_head`; a tied
  lm_head stays tied to embed_tokens. The `model` shell stays, for config-only helpers such as
  Qwen's `get_rope_index`.
* `Part.ENCODER`: everything else under `model`: the towers, the projector and any parameter
  of `model` itself (LLaVA-NeXT's `image_newline`, which the LM part keeps too: one row).

The mechanism is transformers' own `from_pretrained`, on a variant of the model class that
removes the other part right after construction (a meta-device build: free). The removed
part's checkpoint keys then match nothing, and transformers' loader files unmatched keys as
unexpected without reading them: safetensors tensors are read (sliced) only for matched keys.
Everything else comes with that loader unchanged and identical to a whole-model load: the Hub
layouts' key conversions, `model.safetensors.index.json`, dtype, tied embeddings, buffers
recomputed after the meta build (rotary inv_freq, position ids).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch

from actors.models.adapter import Part


def load_part(
    model_class, checkpoint: Path, part: str | None, *, dtype: torch.dtype, device: str, **kwargs
):
    """`model_class.from_pretrained(checkpoint, dtype=dtype, **kwargs)` holding only `part`
    (None: the whole model), on `device`, in eval mode."""
    cls = model_class if part is None else _variant(model_class, part)
    # Loaded on the host, then moved: the device's numbers are those of a whole-model load.
    return cls.from_pretrained(checkpoint, dtype=dtype, **kwargs).to(device).eval()


def other_part(model, part: str) -> list[str]:
    """Dotted paths of the modules and parameters `part` does without."""
    if part == Part.ENCODER:
        return ["model.language_model", "lm_head"]
    if part != Part.LANGUAGE_MODEL:
        raise ValueError(f"unknown model part {part!r}")
    # The towers and projectors; parameters of `model` itself stay (LLaVA-NeXT's image_newline,
    # one row): transformers' init code expects them.
    return [f"model.{name}" for name in model.model._modules if name != "language_model"]


@functools.cache
def _variant(model_class, part: str):
    """`model_class`, built without the modules and parameters `other_part` names."""

    def __init__(self, config, *args, **kwargs):
        model_class.__init__(self, config, *args, **kwargs)
        _remove(self, other_part(self, part))

    # transformers picks a checkpoint's key conversions by class name, and skips them for
    # classes defined outside transformers: the variant keeps the base class's names.
    names = {name: getattr(model_class, name) for name in ("__module__", "__qualname__")}
    return type(model_class.__name__, (model_class,), {"__init__": __init__, **names})


def _remove(model, paths: list[str]) -> None:
    """Set each path to None (torch keeps a None module, parameter or buffer out of the
    state dict), and forget what post_init recorded about them."""
    for path in paths:
        owner, _, name = path.rpartition(".")
        setattr(model.get_submodule(owner), name, None)
    kept = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    model.all_tied_weights_keys = {
        target: source
        for target, source in model.all_tied_weights_keys.items()
        if target in kept and source in kept
    }
    # Their checkpoint keys are unexpected by design: not worth a warning.
    ignored = set(model._keys_to_ignore_on_load_unexpected or ())
    model._keys_to_ignore_on_load_unexpected = ignored | {
        rf"^{re.escape(path)}($|\.)" for path in paths
    }
