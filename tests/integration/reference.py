"""The correctness oracle: the checkpoint's own processor, chat template and `generate`,
in one process, float32, greedy."""
from __future__ import annotations

import base64
import io
from functools import lru_cache

import torch
from PIL import Image
from transformers import AutoProcessor, LlavaForConditionalGeneration


@lru_cache(maxsize=2)
def _load(checkpoint: str, device: str = "cpu"):
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    return processor, model


def _to_hf(messages: list[dict]) -> tuple[list[dict], list[Image.Image]]:
    hf, images = [], []
    for message in messages:
        content = message["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else []
        for part in [] if isinstance(content, str) else content:
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
            else:
                payload = part["image_url"]["url"].split(",", 1)[1]
                images.append(Image.open(io.BytesIO(base64.b64decode(payload))))
                parts.append({"type": "image"})
        hf.append({"role": message["role"], "content": parts})
    return hf, images


@torch.inference_mode()
def reference_generate(checkpoint: str, messages: list[dict], max_new_tokens: int, device: str = "cpu") -> tuple[list[int], str, str]:
    """(new token ids, their text, OpenAI finish reason)."""
    processor, model = _load(checkpoint, device)
    hf, images = _to_hf(messages)
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images or None, return_tensors="pt").to(device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    finish = "stop" if new[-1] == processor.tokenizer.eos_token_id else "length"
    return new, processor.tokenizer.decode(new, skip_special_tokens=True), finish
