"""Small, seeded vision-language checkpoints in the published repos' layout: Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`: dynamic-resolution vision tower with 2x2 patch
merging, images and video, 3-D rotary LM) and LLaVA-NeXT (`LlavaNextForConditionalGeneration`:
CLIP tower over anyres tiles, Mistral LM).

Layout as on the Hub (Qwen/Qwen2.5-VL-*-Instruct, llava-hf/llava-v1.6-mistral-7b-hf), so the
serving code loads them through `from_pretrained` the way it loads a user's download:
config.json (Qwen2.5-VL: flat text fields, `vision_config` nested, `rope_scaling` of type
mrope), generation_config.json, model.safetensors, preprocessor_config.json (Qwen's video
processor reads it too: no video_preprocessor_config.json), chat_template.json, tokenizer
files; LLaVA-NeXT adds processor_config.json (patch size, feature strategy), as its repo does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from actors.checkpoints.kit import (
    SPECIAL_TOKENS,
    greedy_generation_config,
    init_weights,
    mute_unprintable,
    text_config_fields,
    train_bpe,
)
from actors.checkpoints.qwen import qwen_vision_config

QWEN_VL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<unk>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The published Qwen2.5-VL template's structure: a default system turn, ChatML turns, each
# image or video as <|vision_start|><|image_pad|/|video_pad|><|vision_end|>.
QWEN_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The published LLaVA-NeXT (Mistral) template's structure: [INST] turns, images first.
LLAVA_NEXT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '[INST] ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] if part['type'] == 'image' -%}"
    "{{- '<image>\\n' -}}{%- endfor -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}{{- ' [/INST]' -}}"
    "{%- else -%}"
    "{%- if message['content'] is string -%}{{- ' ' + message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- ' ' + part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class VLRecipe:
    name: str
    family: str  # "qwen2_5_vl" | "llava_next"
    seed: int
    vocab_size: int = 1000
    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    image_max_tokens: int = (
        16  # Qwen: images and frames are resized to at most this many merged 28x28 patches
    )
    tile_size: int = 32  # LLaVA-NeXT: the tower's input (one anyres tile), in pixels
    patch_size: int = 8  # LLaVA-NeXT: CLIP patch size
    max_positions: int = 4096

    def publish_layout(self, out: Path) -> None:
        """Rewrite what `save_pretrained` wrote into the published repo's file layout."""
        jinja = out / "chat_template.jinja"
        (out / "chat_template.json").write_text(
            json.dumps({"chat_template": jinja.read_text()}, indent=2) + "\n"
        )
        jinja.unlink()
        processor = json.loads((out / "processor_config.json").read_text())
        images = {
            **processor.pop("image_processor"),
            "processor_class": processor["processor_class"],
        }
        processor.pop(
            "video_processor", None
        )  # Qwen's video processor reads preprocessor_config.json
        if self.family == "qwen2_5_vl":
            _flatten_qwen_config(out / "config.json")
            images.update(
                min_pixels=images["size"]["shortest_edge"],
                max_pixels=images["size"]["longest_edge"],
            )
        _write_json(out / "preprocessor_config.json", images)
        if set(processor) == {"processor_class"}:
            (out / "processor_config.json").unlink()
        else:
            _write_json(out / "processor_config.json", processor)


VL_RECIPES: dict[str, VLRecipe] = {
    "tiny-qwen2.5-vl": VLRecipe(name="tiny-qwen2.5-vl", family="qwen2_5_vl", seed=2031),
    "tiny-llava-next": VLRecipe(name="tiny-llava-next", family="llava_next", seed=2032),
}


def _flatten_qwen_config(path: Path) -> None:
    """Text fields at the top level and rope as `rope_scaling: {type: mrope}`, as Qwen's
    config.json has them."""
    config = json.loads(path.read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "dtype", "architectures"):
        text.pop(key, None)
    config.update({k: v for k, v in text.items() if k not in config})
    config["rope_theta"] = rope["rope_theta"]
    config["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    _write_json(path, config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _tokenizer(
    recipe: VLRecipe, specials: list[str], named: dict[str, str], template: str, **tokens
):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(recipe, specials),
        extra_special_tokens=named,
        chat_template=template,
        model_max_length=recipe.max_positions,
        clean_up_tokenization_spaces=False,
        **tokens,
    )


def _qwen_vl(recipe: VLRecipe):
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    named = {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    }
    tokenizer = _tokenizer(
        recipe,
        QWEN_VL_SPECIALS,
        named,
        QWEN_VL_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
    )
    ids = tokenizer.convert_tokens_to_ids
    head_dim = recipe.text_hidden // recipe.text_heads
    third = head_dim // 2 // 4  # mrope sections (t, h, w) over head_dim / 2 rotary frequencies
    config = Qwen2_5_VLConfig(
        vision_config=qwen_vision_config(recipe, tokens_per_second=2),
        text_config=text_config_fields(
            recipe,
            tokenizer,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [head_dim // 2 - 2 * third, third, third],
            },
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    pixels = 28 * 28
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            min_pixels=4 * pixels, max_pixels=recipe.image_max_tokens * pixels
        ),
        video_processor=Qwen2VLVideoProcessor(
            min_pixels=4 * pixels, max_pixels=recipe.image_max_tokens * pixels
        ),
        tokenizer=tokenizer,
        chat_template=QWEN_VL_TEMPLATE,
    )
    return Qwen2_5_VLForConditionalGeneration(config), processor, tokenizer, len(QWEN_VL_SPECIALS)


def anyres_pinpoints(tile: int) -> list[list[int]]:
    """LLaVA-v1.6's grid (1x2, 2x1, 2x2, 3x1, 1x3 tiles), in tiles of `tile` pixels."""
    return [[tile * h, tile * w] for h, w in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]


def _llava_next(recipe: VLRecipe):
    from transformers import (
        CLIPVisionConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    tokenizer = _tokenizer(
        recipe,
        SPECIAL_TOKENS,
        {"image_token": "<image>"},
        LLAVA_NEXT_TEMPLATE,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        add_bos_token=False,
        add_eos_token=False,
    )  # the template supplies <s>
    pinpoints = anyres_pinpoints(recipe.tile_size)
    vision = CLIPVisionConfig(
        hidden_size=recipe.vision_hidden,
        intermediate_size=2 * recipe.vision_hidden,
        num_hidden_layers=recipe.vision_layers,
        num_attention_heads=recipe.vision_heads,
        image_size=recipe.tile_size,
        patch_size=recipe.patch_size,
    )
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text_config_fields(
            recipe, tokenizer, bos_token_id=tokenizer.bos_token_id, model_type="mistral"
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=(recipe.tile_size // recipe.patch_size) ** 2,
    )
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": recipe.tile_size},
        crop_size={"height": recipe.tile_size, "width": recipe.tile_size},
        image_grid_pinpoints=pinpoints,
    )
    processor = LlavaNextProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=recipe.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_NEXT_TEMPLATE,
        image_token="<image>",
    )
    return LlavaNextForConditionalGeneration(config), processor, tokenizer, len(SPECIAL_TOKENS)


def build_vl(recipe: VLRecipe):
    """(model, processor) of a VL recipe, every weight drawn from the recipe's seed."""
    import torch

    model, processor, tokenizer, num_specials = (
        _qwen_vl if recipe.family == "qwen2_5_vl" else _llava_next
    )(recipe)
    model = model.to(torch.float32).eval()
    init_weights(
        model,
        recipe,
        {r"language_model\..*\.[qk]_proj": 2.0, r"embeddings\.position_embedding": 0.2},
    )
    newline = getattr(model.model, "image_newline", None)
    if (
        newline is not None
    ):  # 1-D, so init_weights skips it: drawn from the seed too, not the global RNG
        with torch.no_grad():
            newline.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(recipe.seed + 1))
    mute_unprintable(model, tokenizer, num_specials)
    model.generation_config = greedy_generation_config(tokenizer)
    return model, processor
