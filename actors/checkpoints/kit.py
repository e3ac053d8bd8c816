"""What every checkpoint builder shares: a seeded BPE tokenizer, the text model's config
fields, and weights drawn so that a random model still follows its prompt.

Plain Python until a builder needs torch or transformers: `train_bpe` runs without them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay lazy
    import tokenizers
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>", "<image>", "<video>", "<audio>"]


_WORDS = (
    "the a an this that one two three many some every no all each other small big old new red "
    "green blue black white yellow bright dark tall short long quiet happy fast slow warm cold cat "
    "dog bird fish horse child man woman friend teacher team city river lake sea mountain tree "
    "flower garden house window door road car train boat picture image photo scene sky sun moon "
    "star night morning day year time water bread apple table book word number color shape person "
    "people animal bridge field stone sees likes shows finds carries describes watches paints "
    "counts opens reads writes holds takes makes gives walks runs sits looks wants knows is are "
    "was were has have had will can could would should may do does did not in on at of to from "
    "with near under over behind between into through after before and or but because while when "
    "where what which who why how yes very also only just still here there now then today above "
    "below left right"
).split()


_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["ch", "sh", "th", "qu", "ng"]


def _lcg(x: int) -> Iterator[int]:
    """Tiny LCG: the same stream on every platform and Python version, unlike `random`."""
    while True:
        x = (1103515245 * x + 12345) % 2**31
        yield x


def _corpus(n_sentences: int) -> list[str]:
    """Fixed English-like text: real words, syllable pseudo-words, digits, punctuation, newlines."""
    rnd = _lcg(7)
    pseudo = [
        "".join(_SYLLABLES[next(rnd) % len(_SYLLABLES)] for _ in range(2 + next(rnd) % 3))
        for _ in range(3000)
    ]
    vocab = _WORDS * 12 + pseudo  # real words dominate, pseudo-words add merge diversity
    ends = [".", ".", ".", "?", "!", ",", ":"]
    sentences = []
    for i in range(n_sentences):
        words = [vocab[next(rnd) % len(vocab)] for _ in range(4 + next(rnd) % 10)]
        if i % 5 == 0:
            words.insert(next(rnd) % len(words), str(next(rnd) % 2000))
        s = " ".join(words)
        sentences.append(s[0].upper() + s[1:] + ends[next(rnd) % len(ends)])
    fixed = (
        "SYSTEM: Be kind.\nUSER: What is in this image?\nASSISTANT: A lake.\n"
        "def f(x):\n    return x\n"
    )
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


# Regex on parameter name -> gain; every other matrix gets gain 1, i.e. std 1/sqrt(fan_in).
GAINS: dict[str, float] = {
    r"vision_tower\.embeddings\.position_embedding": 0.2,  # keep pixel content dominant
    r"language_model\..*\.[qk]_proj": 2.0,  # sharper attention: without it bench-llava ignores the
    # prompt (196 image tokens swamp it) and falls into 1-2 token loops
}


def init_weights(model, recipe, gains: dict[str, float] = GAINS) -> None:
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


def mute_unprintable(
    model, tokenizer: PreTrainedTokenizerFast, num_specials: int = len(SPECIAL_TOKENS)
) -> None:
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


def greedy_generation_config(tokenizer: PreTrainedTokenizerFast):
    """Only the special ids and greedy: nothing that would bend plain argmax decoding."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
