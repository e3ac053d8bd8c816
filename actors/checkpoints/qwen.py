"""Small, seeded Qwen-family checkpoints built locally: an audio model (Qwen2-Audio:
Whisper-style encoder + projector + Qwen2 LM) and an all-modality one (the Qwen2.5-Omni
thinker: vision tower for images and video, audio tower, LM with 3-D rotary positions).

Both save a real processor (feature extractor, image/video processors, tokenizer, chat
template) beside the weights, so the serving code and the tests load them with
`from_pretrained` like a user's checkpoint. The audio window (`window_s`) is short in the
tiny recipes so that tests can send a clip longer than one window cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.checkpoints.kit import (
    greedy_generation_config,
    init_weights,
    mute_unprintable,
    text_config_fields,
    train_bpe,
)

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
]

_PLACEHOLDERS = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}

# ChatML, as the Qwen models use it; each media part renders as bos + one placeholder + eos.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    + "".join(
        f"{{%- elif part['type'] == '{kind}' -%}}{{{{- '{text}' -}}}}"
        for kind, text in _PLACEHOLDERS.items()
    )
    + "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class QwenRecipe:
    name: str
    # "qwen2_audio" | "qwen2_5_omni_thinker" |
    # "qwen2_5_omni" (the published layout, thinker + talker)
    family: str
    seed: int
    vocab_size: int
    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128
    audio_hidden: int = 32
    audio_layers: int = 2
    audio_heads: int = 2
    num_mel_bins: int = 32
    window_s: int = (
        4  # feature-extractor window: longer clips are split into windows of this length
    )
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    image_max_tokens: int = 16  # images are resized to at most this many merged 28x28 patches
    max_positions: int = 4096


QWEN_RECIPES: dict[str, QwenRecipe] = {
    "tiny-qwen2-audio": QwenRecipe(
        name="tiny-qwen2-audio", family="qwen2_audio", seed=2024, vocab_size=1000
    ),
    "tiny-omni": QwenRecipe(
        name="tiny-omni", family="qwen2_5_omni_thinker", seed=2025, vocab_size=1000
    ),
    "tiny-qwen2.5-omni": QwenRecipe(
        name="tiny-qwen2.5-omni", family="qwen2_5_omni", seed=2027, vocab_size=1000
    ),
    "bench-omni": QwenRecipe(
        name="bench-omni",
        family="qwen2_5_omni_thinker",
        seed=2026,
        vocab_size=4000,
        text_hidden=512,
        text_layers=8,
        text_heads=8,
        text_kv_heads=4,
        text_intermediate=1536,
        audio_hidden=256,
        audio_layers=4,
        audio_heads=4,
        num_mel_bins=128,
        window_s=30,
        vision_hidden=256,
        vision_layers=4,
        vision_heads=4,
        image_max_tokens=256,
    ),
}

# Sharper LM attention, as for LLaVA: random weights otherwise ignore the prompt.
_GAINS = {r"language_model\..*\.[qk]_proj": 2.0, r"audio_tower\.embed_positions": 0.2}


def build_tokenizer(recipe: QwenRecipe):
    from transformers import PreTrainedTokenizerFast

    named = {
        "image_token": "<|IMAGE|>",
        "video_token": "<|VIDEO|>",
        "audio_token": "<|AUDIO|>",
        "vision_bos_token": "<|vision_bos|>",
        "vision_eos_token": "<|vision_eos|>",
        "audio_bos_token": "<|audio_bos|>",
        "audio_eos_token": "<|audio_eos|>",
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(recipe, QWEN_SPECIALS),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        extra_special_tokens=named,
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.max_positions,
        clean_up_tokenization_spaces=False,
    )


def _feature_extractor(recipe: QwenRecipe):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=recipe.num_mel_bins,
        sampling_rate=16000,
        hop_length=160,
        chunk_length=recipe.window_s,
        n_fft=400,
    )


def _audio_config(recipe: QwenRecipe, **extra) -> dict:
    """The Whisper-style audio tower both Qwen audio families share."""
    return dict(
        num_mel_bins=recipe.num_mel_bins,
        encoder_layers=recipe.audio_layers,
        encoder_attention_heads=recipe.audio_heads,
        encoder_ffn_dim=2 * recipe.audio_hidden,
        d_model=recipe.audio_hidden,
        **extra,
    )


def qwen_vision_config(recipe, **extra) -> dict:
    """The Qwen2.5 vision tower of a tiny recipe (Omni's thinker and Qwen2.5-VL share it)."""
    return dict(
        depth=recipe.vision_layers,
        hidden_size=recipe.vision_hidden,
        num_heads=recipe.vision_heads,
        intermediate_size=2 * recipe.vision_hidden,
        out_hidden_size=recipe.text_hidden,
        fullatt_block_indexes=[recipe.vision_layers - 1],
        window_size=56,
        **extra,
    )


def _audio_model(recipe: QwenRecipe, tokenizer):
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
    )

    # The tower takes exactly one window of mel frames: 2 frames per source position.
    window_frames = recipe.window_s * 100
    config = Qwen2AudioConfig(
        audio_config=_audio_config(recipe, max_source_positions=window_frames // 2),
        text_config=text_config_fields(recipe, tokenizer, model_type="qwen2"),
        audio_token_index=tokenizer.audio_token_id,
    )
    processor = Qwen2AudioProcessor(
        feature_extractor=_feature_extractor(recipe),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    return Qwen2AudioForConditionalGeneration(config), processor


def _omni_model(recipe: QwenRecipe, tokenizer):
    from transformers import (
        Qwen2_5OmniProcessor,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    ids = tokenizer.convert_tokens_to_ids
    head_dim = recipe.text_hidden // recipe.text_heads
    third = head_dim // 2 // 4  # mrope sections (t, h, w) over head_dim / 2 rotary frequencies
    config = Qwen2_5OmniThinkerConfig(
        audio_config=_audio_config(recipe, output_dim=recipe.text_hidden, n_window=50),
        vision_config=qwen_vision_config(recipe),
        text_config=text_config_fields(
            recipe,
            tokenizer,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 2 - 2 * third, third, third],
            },
        ),
        audio_token_index=tokenizer.audio_token_id,
        image_token_index=tokenizer.image_token_id,
        video_token_index=tokenizer.video_token_id,
        audio_start_token_id=ids("<|audio_bos|>"),
        audio_end_token_id=ids("<|audio_eos|>"),
        vision_start_token_id=ids("<|vision_bos|>"),
        vision_end_token_id=ids("<|vision_eos|>"),
    )
    pixels = 28 * 28
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=4 * pixels, max_pixels=recipe.image_max_tokens * pixels
        ),
        video_processor=Qwen2VLVideoProcessor(),
        feature_extractor=_feature_extractor(recipe),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    return Qwen2_5OmniThinkerForConditionalGeneration(config), processor


def build_qwen(recipe: QwenRecipe):
    """(model, processor) of a Qwen-family recipe, weights drawn from the recipe's seed."""
    import torch

    tokenizer = build_tokenizer(recipe)
    model, processor = (_audio_model if recipe.family == "qwen2_audio" else _omni_model)(
        recipe, tokenizer
    )
    model = model.to(torch.float32).eval()
    init_weights(model, recipe, _GAINS)
    mute_unprintable(model, tokenizer, len(QWEN_SPECIALS))
    if recipe.family == "qwen2_5_omni":
        from actors.checkpoints.omni import with_talker

        model = with_talker(model, recipe)
    model.generation_config = greedy_generation_config(tokenizer)
    return model, processor
