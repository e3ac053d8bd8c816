"""The correctness oracle: the checkpoint's own processor, chat template and `generate`,
in one process, greedy, float32 unless a test asks for another dtype, for every model family
(the published Qwen2.5-Omni through its own text-only generate).

Media are decoded here independently of the server's decoders: images and GIF frames with
Pillow, WAV with soundfile (tests send 16 kHz mono, the models' rate, so no resampling).
Audio longer than the model's window is split by the product's documented rule
(`split_windows`), each window an audio part of its own, as the server does.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache

import numpy as np
import soundfile
import torch
from PIL import Image, ImageSequence
from transformers import AutoConfig, AutoProcessor

from actors.models.qwen2_audio import split_windows


class TextOnly:
    """The published Qwen2.5-Omni (thinker + talker) under the plain `generate` signature:
    its own generate, text only (the talker's speech is not what epd serves)."""

    def __init__(self, model):
        self.model = model

    def generate(self, max_new_tokens: int, **kwargs):
        return self.model.generate(
            generation_mode="text", thinker_max_new_tokens=max_new_tokens, **kwargs
        )


def _model_class(model_type: str):
    import transformers

    return {
        "llava": transformers.LlavaForConditionalGeneration,
        "qwen2_audio": transformers.Qwen2AudioForConditionalGeneration,
        "qwen2_5_omni_thinker": transformers.Qwen2_5OmniThinkerForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "llava_next": transformers.LlavaNextForConditionalGeneration,
        "qwen2_5_omni": transformers.Qwen2_5OmniForConditionalGeneration,
    }[model_type]


@lru_cache(maxsize=3)
def _load(checkpoint: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    processor = AutoProcessor.from_pretrained(checkpoint)
    model_type = AutoConfig.from_pretrained(checkpoint).model_type
    model = _model_class(model_type).from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    return processor, TextOnly(model) if model_type == "qwen2_5_omni" else model


def _payload(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def _video_frames(data: bytes) -> np.ndarray:
    return np.stack(
        [
            np.array(frame.convert("RGB"))
            for frame in ImageSequence.Iterator(Image.open(io.BytesIO(data)))
        ]
    )


class _Media:
    """Decoded media of one conversation, in order, per modality."""

    def __init__(self, window_samples: int | None):
        self.window_samples = window_samples
        self.images, self.videos, self.audio = [], [], []

    def part(self, part: dict) -> list[dict]:
        if part["type"] == "image_url":
            self.images.append(Image.open(io.BytesIO(_payload(part["image_url"]["url"]))))
            return [{"type": "image"}]
        if part["type"] == "video_url":
            self.videos.append(_video_frames(_payload(part["video_url"]["url"])))
            return [{"type": "video"}]
        samples, _ = soundfile.read(
            io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32"
        )
        windows = split_windows(samples, self.window_samples) if self.window_samples else [samples]
        self.audio.extend(windows)
        return [{"type": "audio"}] * len(windows)

    def kwargs(self, video_fps: float) -> dict:
        out = {"images": self.images or None, "audio": self.audio or None}
        if self.videos:
            # fps for the Omni processor, per-video metadata for Qwen2.5-VL's (which else assumes
            # 24 fps)
            metadata = [{"total_num_frames": len(v), "fps": video_fps} for v in self.videos]
            out.update(
                videos=self.videos, videos_kwargs={"fps": video_fps, "video_metadata": metadata}
            )
        return {k: v for k, v in out.items() if v is not None}


def _to_hf(messages: list[dict], media: _Media) -> list[dict]:
    hf = []
    for message in messages:
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else []
        for part in [] if isinstance(content, str) else content:
            parts += (
                [{"type": "text", "text": part["text"]}]
                if part["type"] == "text"
                else media.part(part)
            )
        hf.append({"role": message["role"], "content": parts})
    return hf


@torch.inference_mode()
def reference_generate(
    checkpoint: str,
    messages: list[dict],
    max_new_tokens: int,
    device: str = "cpu",
    video_fps: float = 2.0,
    dtype: torch.dtype = torch.float32,
    **generate_kwargs,
) -> tuple[list[int], str, str]:
    """(new token ids, their text, OpenAI finish reason); `generate_kwargs` go to `generate`
    (repetition_penalty, min_new_tokens, ...)."""
    processor, model = _load(checkpoint, device, dtype)
    extractor = getattr(processor, "feature_extractor", None)
    media = _Media(extractor.n_samples if extractor is not None else None)
    hf = _to_hf(messages, media)
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, return_tensors="pt", **media.kwargs(video_fps)).to(device)
    inputs = inputs.to(
        dtype
    )  # floating inputs (pixels, features) in the model's dtype; ids stay integers
    out = model.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs
    )
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    finish = "stop" if new[-1] == processor.tokenizer.eos_token_id else "length"
    return new, processor.tokenizer.decode(new, skip_special_tokens=True), finish


@torch.inference_mode()
def reference_generate_ids(
    checkpoint: str, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs
) -> list[int]:
    """New token ids `generate` gives after a raw prompt (no chat template): /v1/completions."""
    _, model = _load(checkpoint)
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **generate_kwargs,
    )
    return out[0, ids.shape[1] :].tolist()
