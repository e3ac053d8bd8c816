"""The synthetic shapes data and the trained `shapes-llava` checkpoint: pictures are seeded and
show what their scene says; training batches score the answer tokens only; training is
deterministic; the trained checkpoint answers held-out questions through plain HF `generate`."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from actors.checkpoints import scenes
from actors.checkpoints.llava import build_processor, build_tokenizer
from actors.checkpoints.shapes import (
    IGNORE,
    SHAPES_RECIPES,
    BatchMaker,
    build_shapes,
    generate_answer,
)

RECIPE = SHAPES_RECIPES["shapes-llava-v2"]


def test_samples_are_seeded_and_vary():
    a, b, other = scenes.samples(5, 30), scenes.samples(5, 30), scenes.samples(6, 30)
    assert [(s.scene, s.question, s.image.tobytes()) for s in a] == [
        (s.scene, s.question, s.image.tobytes()) for s in b
    ]
    assert [s.image.tobytes() for s in a] != [s.image.tobytes() for s in other]
    answerable = {a for a in scenes.Ask if a is not scenes.Ask.COUNT or scenes.MAX_COUNT > 1}
    assert {s.ask for s in scenes.samples(5, 200)} == answerable
    assert {s.ask for s in scenes.samples(5, 50, asks=(scenes.Ask.SIDE,))} == {scenes.Ask.SIDE}


@pytest.mark.parametrize("seed", range(20))
def test_picture_shows_its_scene(seed):
    rng = np.random.default_rng(seed)
    scene = scenes.random_scene(rng, max_count=3)
    pixels = np.asarray(scenes.render(scene, rng)).astype(int)
    coloured = (
        np.abs(pixels - pixels.mean(axis=2, keepdims=True)).sum(axis=2) > 60
    )  # the grey background is not
    if scene.colour == "white":
        coloured = pixels.min(axis=2) > 150
    assert coloured.sum() > 30
    mean = pixels[coloured].mean(axis=0)
    nearest = min(scenes.COLOURS, key=lambda c: np.abs(np.array(scenes.COLOURS[c]) - mean).sum())
    assert nearest == scene.colour
    if scene.side is not None:
        centre_x = np.nonzero(coloured)[1].mean() / pixels.shape[1]
        assert (centre_x < 0.5) == (scene.side == "left")


def test_only_one_shape_has_a_side():
    rng = np.random.default_rng(1)
    for scene in [scenes.random_scene(rng, max_count=3) for _ in range(100)]:
        assert (scene.side is None) == (scene.count > 1)
    for s in scenes.samples(1, 100):
        if s.ask is scenes.Ask.SIDE:
            assert s.answer in scenes.SIDES
    with pytest.raises(ValueError, match="side"):
        scenes.Scene("red", "circle", 2, None).answer(scenes.Ask.SIDE)


def test_batches_score_only_the_answer_and_match_the_served_prompt():
    processor = build_processor(RECIPE.arch, build_tokenizer(RECIPE.arch))
    tok = processor.tokenizer
    batch_samples = scenes.samples(3, 6)
    batch = BatchMaker(processor, RECIPE.render_px)(batch_samples)
    for row, s in enumerate(batch_samples):
        text = processor.apply_chat_template(
            s.messages({"type": "image"}), add_generation_prompt=True, tokenize=False
        )
        served = processor(text=text, images=[s.image], return_tensors="pt")
        prompt = served["input_ids"][0].tolist()
        scored = batch.labels[row] != IGNORE
        assert batch.input_ids[row, : len(prompt)].tolist() == prompt
        assert not scored[: len(prompt)].any()
        assert tok.decode(batch.labels[row][scored]) == " " + s.answer + tok.eos_token
        assert torch.equal(batch.pixel_values[row], served["pixel_values"][0])


def test_training_is_deterministic_and_leaves_global_state_alone():
    short = replace(RECIPE, num_steps=2, batch_size=4, warmup_steps=1)
    torch.manual_seed(99)
    before = torch.get_num_threads(), torch.get_rng_state()
    (m1, _), (m2, _) = build_shapes(short), build_shapes(short)
    assert (torch.get_num_threads(), torch.get_rng_state().tolist()) == (
        before[0],
        before[1].tolist(),
    )
    for (name, p1), p2 in zip(m1.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(p1, p2), name


@pytest.fixture(scope="module")
def trained(default_model_built):
    """The default config's trained model from the shared cache (trained there on first use,
    as `epd serve` does)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from cluster.config import load_config

    name, path = load_config().model.builtin, default_model_built
    return (
        SHAPES_RECIPES[name],
        LlavaForConditionalGeneration.from_pretrained(path).eval(),
        AutoProcessor.from_pretrained(path),
    )


def test_trained_checkpoint_answers_held_out_questions_with_generate(trained):
    recipe, model, processor = trained
    held_out = scenes.samples(777, 40, asks=recipe.asks)  # not the training seed
    assert scenes.Ask.SHAPE in {s.ask for s in held_out}, "the default names shapes too"
    right = 0
    for s in held_out:
        new = generate_answer(model, processor, s)
        assert new[-1] == processor.tokenizer.eos_token_id, (
            "answers end with </s>, not at max_new_tokens"
        )
        right += processor.tokenizer.decode(new, skip_special_tokens=True) == " " + s.answer
    assert right / len(held_out) >= 0.9, f"{right}/{len(held_out)}"
