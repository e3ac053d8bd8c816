"""Build small, seeded LLaVA checkpoints locally (no downloads) for tests and benchmarks.

`python -m actors.checkpoints RECIPE OUT_DIR` writes a dir that `AutoProcessor` and
`LlavaForConditionalGeneration.from_pretrained` load. Conventions callers rely on:
* The chat template starts with `<s>`; the tokenizer never adds bos/eos (add_bos_token=False),
  so a rendered prompt has exactly one bos with add_special_tokens False (recommended) or True.
* vision_feature_layer=-1 (random weights: no reason to prefer the penultimate layer) and
  strategy "default" (CLS dropped): an image becomes (image_size // patch_size) ** 2 tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:  # heavy imports stay lazy: `train_bpe` runs without torch/transformers
    import tokenizers
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>", "<image>", "<video>", "<audio>"]

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
    """Sizes of one synthetic checkpoint (weight scales: see `_init_weights`)."""

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


_WORDS = (
    "the a an this that one two three many some every no all each other small big old new red green blue "
    "black white yellow bright dark tall short long quiet happy fast slow warm cold cat dog bird fish horse "
    "child man woman friend teacher team city river lake sea mountain tree flower garden house window door "
    "road car train boat picture image photo scene sky sun moon star night morning day year time water bread "
    "apple table book word number color shape person people animal bridge field stone sees likes shows finds "
    "carries describes watches paints counts opens reads writes holds takes makes gives walks runs sits looks "
    "wants knows is are was were has have had will can could would should may do does did not in on at of to "
    "from with near under over behind between into through after before and or but because while when where "
    "what which who why how yes very also only just still here there now then today above below left right"
).split()
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["ch", "sh", "th", "qu", "ng"]


def _lcg(x: int) -> Iterator[int]:
    """Tiny LCG: the same stream on every platform and Python version, unlike `random`."""
    while True:
        x = (1103515245 * x + 12345) % 2**31
        yield x


def _corpus(n_sentences: int) -> list[str]:
    """Fixed English-like text: real words plus syllable pseudo-words, digits, punctuation, newlines."""
    rnd = _lcg(7)
    pseudo = ["".join(_SYLLABLES[next(rnd) % len(_SYLLABLES)] for _ in range(2 + next(rnd) % 3)) for _ in range(3000)]
    vocab = _WORDS * 12 + pseudo  # real words dominate, pseudo-words add merge diversity
    ends = [".", ".", ".", "?", "!", ",", ":"]
    sentences = []
    for i in range(n_sentences):
        words = [vocab[next(rnd) % len(vocab)] for _ in range(4 + next(rnd) % 10)]
        if i % 5 == 0:
            words.insert(next(rnd) % len(words), str(next(rnd) % 2000))
        s = " ".join(words)
        sentences.append(s[0].upper() + s[1:] + ends[next(rnd) % len(ends)])
    fixed = "SYSTEM: Be kind.\nUSER: What is in this image?\nASSISTANT: A lake.\ndef f(x):\n    return x\n"
    # Newline-joined "documents" so newlines and indentation get merges too.
    return ["\n".join(sentences[i : i + 8]) for i in range(0, len(sentences), 8)] + [fixed] * 50


def train_bpe(recipe, specials: list[str] = SPECIAL_TOKENS) -> tokenizers.Tokenizer:
    """Byte-level BPE trained on `_corpus()`; `specials` get ids 0..n-1 in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))  # byte-level: every string is encodable
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=2,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(recipe.vocab_size * 10), trainer=trainer)
    return tok


def build_tokenizer(recipe: Recipe) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(recipe),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>", "audio_token": "<audio>"},
        add_bos_token=False,
        add_eos_token=False,  # the chat template supplies <s>
        chat_template=CHAT_TEMPLATE,
        model_max_length=recipe.max_positions,
        clean_up_tokenization_spaces=False,
    )


def text_config_fields(recipe, tokenizer, **extra) -> dict:
    """The language model's config fields every recipe family sets the same way (a recipe with
    text_hidden, text_intermediate, text_layers, text_heads, text_kv_heads, max_positions)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=recipe.text_hidden,
        intermediate_size=recipe.text_intermediate,
        num_hidden_layers=recipe.text_layers,
        num_attention_heads=recipe.text_heads,
        num_key_value_heads=recipe.text_kv_heads,
        max_position_embeddings=recipe.max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **extra,
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


# Regex on parameter name -> gain; every other matrix gets gain 1, i.e. std 1/sqrt(fan_in).
_GAINS: dict[str, float] = {
    r"vision_tower\.embeddings\.position_embedding": 0.2,  # keep pixel content dominant
    r"language_model\..*\.[qk]_proj": 2.0,  # sharper attention: without it bench-llava ignores the
    # prompt (196 image tokens swamp it) and falls into 1-2 token loops
}


def _init_weights(model, recipe, gains: dict[str, float] = _GAINS) -> None:
    """Redraw every matrix (and CLIP's class embedding) with std gain/sqrt(fan_in), not HF's 0.02.

    Why: at std 0.02 the residual stream is little more than the token embedding and
    attention is near uniform, so greedy decoding loops on one or two tokens whatever
    the prompt or image. Unit-variance activations make the image features and the
    prompt steer the argmax. Embeddings use std=gain (fan_in 1); norms stay 1, biases 0.
    """
    import torch

    gen = torch.Generator().manual_seed(recipe.seed)  # private RNG: callers' global seed untouched
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (p.ndim < 2 and not name.endswith("class_embedding")) or p.numel() == 0:
                continue
            fan_in = 1 if "embed" in name and "patch" not in name else p[0].numel()
            gain = next((g for key, g in gains.items() if re.search(key, name)), 1.0)
            p.normal_(0.0, gain / math.sqrt(fan_in), generator=gen)


def _mute_unprintable(model, tokenizer: PreTrainedTokenizerFast, num_specials: int = len(SPECIAL_TOKENS)) -> None:
    """Zero lm_head rows of specials (except </s>) and of non-printable byte tokens.

    Why: a zero logit sits mid-distribution, so greedy never emits <image>/<s> (which would
    confuse placeholder counting) and outputs decode to ASCII, not half UTF-8 sequences.
    """
    import torch

    with torch.no_grad():
        for tid in range(num_specials, len(tokenizer)):
            text = tokenizer.decode([tid])
            if not (text.isascii() and (text.isprintable() or text == "\n")):
                model.lm_head.weight[tid].zero_()
        muted = [i for i in range(num_specials) if i != tokenizer.eos_token_id]
        model.lm_head.weight[muted] = 0.0


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


def greedy_generation_config(tokenizer: PreTrainedTokenizerFast):
    """Only the special ids and greedy: nothing that would bend plain argmax decoding."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )


def build_model(recipe: Recipe, tokenizer: PreTrainedTokenizerFast) -> LlavaForConditionalGeneration:
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(llava_config(recipe, tokenizer)).to(torch.float32).eval()
    _init_weights(model, recipe)
    _mute_unprintable(model, tokenizer)
    model.generation_config = greedy_generation_config(tokenizer)
    return model


def build_llava(recipe: Recipe):
    """(model, processor) of a LLaVA recipe."""
    tokenizer = build_tokenizer(recipe)
    return build_model(recipe, tokenizer), build_processor(recipe, tokenizer)


def _recipes() -> dict:
    """Every recipe by name: LLaVA ones here, Qwen-family ones (audio, omni) and trained ones beside them."""
    from actors.checkpoint_qwen import QWEN_RECIPES
    from actors.checkpoint_shapes import SHAPES_RECIPES
    from actors.checkpoint_vl import VL_RECIPES

    return {**RECIPES, **QWEN_RECIPES, **VL_RECIPES, **SHAPES_RECIPES}


def _build(recipe, progress: bool):
    """(model, processor) of any recipe; only the trained ones are slow enough to show progress."""
    if isinstance(recipe, Recipe):
        return build_llava(recipe)
    from actors.checkpoint_shapes import TrainedRecipe, build_shapes

    if isinstance(recipe, TrainedRecipe):
        return build_shapes(recipe, progress=progress)
    from actors.checkpoint_vl import VLRecipe, build_vl

    if isinstance(recipe, VLRecipe):
        return build_vl(recipe)
    from actors.checkpoint_qwen import build_qwen

    return build_qwen(recipe)


def _save(recipe, model, processor, out: Path) -> None:
    if getattr(recipe, "family", None) == "qwen2_5_omni":
        from actors.checkpoint_omni import save_published

        return save_published(model, processor, out, recipe.seed)
    model.save_pretrained(out)
    processor.save_pretrained(out)  # also writes the tokenizer and chat_template.jinja
    getattr(recipe, "publish_layout", lambda _: None)(out)  # recipes that mirror a Hub repo's file names


def build_checkpoint(recipe: str, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Build `recipe` into `out_dir` (absent or empty) via a hidden sibling dir renamed at the
    end, so a crash never leaves a half-written dir that `ensure_checkpoint` would accept."""
    recipes = _recipes()
    if recipe not in recipes:
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {', '.join(sorted(recipes))}")
    r, out = recipes[recipe], Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        with tqdm(total=2, desc=f"build {recipe}: model", disable=not progress, unit="step") as bar:
            model, processor = _build(r, progress)
            bar.update()
            bar.set_description(f"build {recipe}: save")
            _save(r, model, processor, tmp)
            bar.update()
        try:
            os.rename(tmp, out)  # atomic; replaces `out` only if it is an empty dir
        except OSError:
            if not (out / "config.json").is_file():
                raise  # else a concurrent builder won the race with an identical build
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_checkpoint(out_dir: str | Path, recipe: str | None, *, progress: bool = True) -> Path:
    """Return `out_dir` if it holds a checkpoint, else build `recipe` there."""
    out = Path(out_dir).expanduser()
    if (out / "config.json").is_file():
        return out.resolve()
    if recipe is None:
        raise FileNotFoundError(
            f"no checkpoint at {out} (config.json missing) and no recipe given to build one; "
            f"run `python -m actors.checkpoints RECIPE {out}` with RECIPE in {sorted(_recipes())}"
        )
    return build_checkpoint(recipe, out, progress=progress)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m actors.checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", choices=sorted(_recipes()))
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = build_checkpoint(args.recipe, args.out_dir)
    size_mb = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    print(f"built {args.recipe} at {path} in {time.perf_counter() - start:.1f}s ({size_mb:.1f} MiB)")


if __name__ == "__main__":
    main()
