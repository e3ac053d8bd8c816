"""Small, seeded LLaVA checkpoints (CLIP tower + projector + Llama LM), built locally.

Conventions callers rely on:
* The chat template starts with `<s>`; the tokenizer never adds bos/eos (add_bos_token=False),
  so a rendered prompt has exactly one bos with add_special_tokens False (recommended) or True.
* vision_feature_layer=-1 (random weights: no reason to prefer the penultimate layer) and
  strategy "default" (CLS dropped): an image becomes (image_size // patch_size) ** 2 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.checkpoints.kit import (
    greedy_generation_config,
    init_weights,
    mute_unprintable,
    text_config_fields,
    train_bpe,
)

if TYPE_CHECKING:
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

# LLaVA-style template; `<s>` comes from the template, never from the tokenizer.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- message['role'] | upper + ': ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ['image', 'video', 'audio'] -%}{{- '<' + part['type'] + '>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if messages -%}{{- '\\n' -}}{%- endif -%}{{- 'ASSISTANT:' -}}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class Recipe:
    """Sizes of one synthetic checkpoint (weight scales: see `init_weights`)."""

    name: str
    seed: int
    vocab_size: int
    image_size: int
    patch_size: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    max_positions: int = 2048

    @property
    def image_tokens(self) -> int:  # placeholder tokens per image ("default" drops CLS)
        return (self.image_size // self.patch_size) ** 2


RECIPES: dict[str, Recipe] = {
    "tiny-llava": Recipe(
        name="tiny-llava",
        seed=1234,
        vocab_size=1000,
        image_size=32,
        patch_size=8,
        vision_hidden=64,
        vision_layers=2,
        vision_heads=4,
        vision_intermediate=128,
        text_hidden=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=128,
    ),
    "bench-llava": Recipe(
        name="bench-llava",
        seed=4321,
        vocab_size=4000,
        image_size=224,
        patch_size=16,
        vision_hidden=384,
        vision_layers=6,
        vision_heads=6,
        vision_intermediate=1536,
        text_hidden=512,
        text_layers=8,
        text_heads=8,
        text_kv_heads=4,
        text_intermediate=1536,
    ),
}


def build_tokenizer(recipe: Recipe) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(recipe),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "image_token": "<image>",
            "video_token": "<video>",
            "audio_token": "<audio>",
        },
        add_bos_token=False,
        add_eos_token=False,  # the chat template supplies <s>
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.max_positions,
        clean_up_tokenization_spaces=False,
    )


def llava_config(recipe: Recipe, tokenizer: PreTrainedTokenizerFast) -> LlavaConfig:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=recipe.vision_hidden,
        intermediate_size=recipe.vision_intermediate,
        num_hidden_layers=recipe.vision_layers,
        num_attention_heads=recipe.vision_heads,
        image_size=recipe.image_size,
        patch_size=recipe.patch_size,
    )
    text = LlamaConfig(**text_config_fields(recipe, tokenizer, bos_token_id=tokenizer.bos_token_id))
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )


def build_processor(recipe: Recipe, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    # Saved as the PIL backend; AutoProcessor loads the torchvision one where torchvision is
    # installed. Both the server and the tests' reference load it that way, so they agree.
    images = CLIPImageProcessorPil(
        size={"shortest_edge": recipe.image_size},
        crop_size={"height": recipe.image_size, "width": recipe.image_size},
        do_resize=True,
        do_center_crop=True,
        do_convert_rgb=True,
    )
    # num_additional_image_tokens=1 (CLS) minus 1 for "default" = one token per patch.
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=recipe.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
        image_token="<image>",
    )


def build_model(
    recipe: Recipe, tokenizer: PreTrainedTokenizerFast
) -> LlavaForConditionalGeneration:
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(llava_config(recipe, tokenizer)).to(torch.float32).eval()
    init_weights(model, recipe)
    mute_unprintable(model, tokenizer)
    model.generation_config = greedy_generation_config(tokenizer)
    return model


def build_llava(recipe: Recipe):
    """(model, processor) of a LLaVA recipe."""
    tokenizer = build_tokenizer(recipe)
    return build_model(recipe, tokenizer), build_processor(recipe, tokenizer)
