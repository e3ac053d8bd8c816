r"""Held-out accuracy of a trained shapes checkpoint through plain HF `generate`, per kind of
question.

    .venv/bin/python scripts/eval_shapes.py ~/.cache/epd/models/shapes-llava-v2 \
        --recipe shapes-llava-v2

The reference for the HTTP figure of tests/integration/test_default_model.py: the same
prompts and greedy decoding, without the cluster.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from actors.checkpoints import scenes
from actors.checkpoints.shapes import SHAPES_RECIPES, generate_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--recipe", default="shapes-llava-v2", choices=sorted(SHAPES_RECIPES))
    parser.add_argument(
        "--seed",
        type=int,
        default=4242,
        help="held-out pictures (training uses the recipe's data_seed)",
    )
    parser.add_argument("--num-questions", type=int, default=200)
    args = parser.parse_args()
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    start = time.perf_counter()
    model = LlavaForConditionalGeneration.from_pretrained(args.checkpoint.expanduser()).eval()
    processor = AutoProcessor.from_pretrained(args.checkpoint.expanduser())
    load_s = time.perf_counter() - start
    right, asked = Counter(), Counter()
    for s in scenes.samples(args.seed, args.num_questions, asks=SHAPES_RECIPES[args.recipe].asks):
        answer = processor.tokenizer.decode(
            generate_answer(model, processor, s), skip_special_tokens=True
        )
        asked[s.ask] += 1
        right[s.ask] += answer == " " + s.answer
    by_kind = ", ".join(f"{a.value} {right[a]}/{asked[a]}" for a in asked)
    print(f"load {load_s:.1f}s; accuracy {sum(right.values())}/{sum(asked.values())} ({by_kind})")


if __name__ == "__main__":
    main()
