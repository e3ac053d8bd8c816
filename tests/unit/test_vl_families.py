"""Qwen2.5-VL and LLaVA-NeXT without Ray: the tiny checkpoints have the published repos'
layout; the ingress's placeholder counts equal the HF processor's own (odd sizes, frame
counts) and the tower's real output; encoder adapter + LMRunner give exactly the greedy
tokens of the model's `generate`, one request at a time and batched."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402
from transformers import (
    AutoProcessor,
    LlavaNextForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
)  # noqa: E402

from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from cluster.prompt_plan import PromptPlanner  # noqa: E402
from tests.unit.test_families import (  # noqa: E402
    check_matches_generate,
    generate_batched,
    image,
    media,
    video,
)


def _family(model_class, path):
    return (
        model_class.from_pretrained(path).eval(),
        AutoProcessor.from_pretrained(path),
        PromptPlanner(path),
        load_adapter(path, part=Part.ENCODER, dtype="float32", device="cpu"),
        LMRunner(
            load_adapter(path, part=Part.LANGUAGE_MODEL, dtype="float32", device="cpu"),
            max_chunk_tokens=64,
        ),
    )


@pytest.fixture(scope="module")
def qwen_vl(qwen_vl_ckpt):
    return _family(Qwen2_5_VLForConditionalGeneration, qwen_vl_ckpt)


@pytest.fixture(scope="module")
def llava_next(llava_next_ckpt):
    return _family(LlavaNextForConditionalGeneration, llava_next_ckpt)


COMMON_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "chat_template.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def test_qwen_vl_checkpoint_has_the_published_layout(qwen_vl_ckpt):
    assert {p.name for p in qwen_vl_ckpt.iterdir()} == COMMON_FILES
    config = json.loads((qwen_vl_ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and config["architectures"] == [
        "Qwen2_5_VLForConditionalGeneration"
    ]
    assert (
        "text_config" not in config and config["hidden_size"] == 64
    )  # text fields flat, as Qwen's repos have them
    assert config["vision_config"]["model_type"] == "qwen2_5_vl_vision"
    assert (
        config["rope_scaling"]["type"] == "mrope"
        and sum(config["rope_scaling"]["mrope_section"]) == 8
    )
    preprocessor = json.loads((qwen_vl_ckpt / "preprocessor_config.json").read_text())
    assert (
        preprocessor["processor_class"] == "Qwen2_5_VLProcessor"
        and preprocessor["max_pixels"] == 16 * 28 * 28
    )


def test_llava_next_checkpoint_has_the_published_layout(llava_next_ckpt):
    assert {p.name for p in llava_next_ckpt.iterdir()} == COMMON_FILES | {"processor_config.json"}
    config = json.loads((llava_next_ckpt / "config.json").read_text())
    assert config["model_type"] == "llava_next" and config["text_config"]["model_type"] == "mistral"
    assert config["image_grid_pinpoints"] == [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
    processor = json.loads((llava_next_ckpt / "processor_config.json").read_text())
    assert processor["processor_class"] == "LlavaNextProcessor" and processor["patch_size"] == 8


def _processor_count(processor, token_id: int, **media_kwargs) -> int:
    """Placeholders the HF processor itself expands one image or video into."""
    kind = "video" if "videos" in media_kwargs else "image"
    messages = [{"role": "user", "content": [{"type": kind}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return int(
        (processor(text=[text], return_tensors="pt", **media_kwargs)["input_ids"] == token_id).sum()
    )


ODD_SIZES = [
    (37, 211),
    (211, 37),
    (300, 40),
    (40, 300),
    (1, 1),
    (3, 100),
    (5, 500),
    (29, 57),
    (97, 13),
    (32, 32),
    (64, 64),
]


@pytest.mark.parametrize("family", ["llava_next", "qwen_vl"])
@pytest.mark.parametrize("height,width", ODD_SIZES)
def test_image_counts_equal_the_processor_and_the_tower(request, family, height, width):
    model, processor, planner, encoder, _ = request.getfixturevalue(family)
    picture = image(height, width)
    want = _processor_count(
        processor, model.config.image_token_id, images=[Image.fromarray(picture.data)]
    )
    assert planner.spec.num_embeddings(picture) == want
    assert encoder.encode([picture])[0].shape[0] == want  # the model's own packing agrees


@pytest.mark.parametrize(
    "frames,height,width",
    [(1, 30, 30), (2, 40, 56), (3, 17, 90), (5, 64, 48), (7, 1, 1), (8, 100, 20)],
)
def test_qwen_vl_video_counts_equal_the_processor(qwen_vl, frames, height, width):
    model, processor, planner, encoder, _ = qwen_vl
    clip = video(frames, height, width)
    want = _processor_count(
        processor,
        model.config.video_token_id,
        videos=[torch.from_numpy(clip.data).permute(0, 3, 1, 2)],
    )
    assert planner.spec.num_embeddings(clip) == want
    assert encoder.encode([clip])[0].shape[0] == want


QWEN_VL_CASES = {
    "image": lambda: ["Look ", image(60, 90), " what?"],
    "two images": lambda: [image(37, 211), " and ", image(300, 40), " compare."],
    "video": lambda: [video(6, 40, 56), "Describe it."],
    "video at 1 fps": lambda: ["Slow: ", video(5, 56, 40, fps=1.0)],
    "image and video": lambda: [
        "A ",
        image(50, 50),
        " then ",
        video(4, 30, 30, fps=3.0),
        " and text.",
    ],
}
LLAVA_NEXT_CASES = {
    "tall": lambda: [image(211, 37), "What is it?"],
    "wide": lambda: ["Look: ", image(40, 300)],
    "two odd images": lambda: [image(37, 211), image(5, 500), "Compare."],
}


@pytest.mark.parametrize("case", sorted(QWEN_VL_CASES))
def test_qwen_vl_matches_generate(qwen_vl, case):
    check_matches_generate(qwen_vl, QWEN_VL_CASES[case]())


@pytest.mark.parametrize("case", sorted(LLAVA_NEXT_CASES))
def test_llava_next_matches_generate(llava_next, case):
    check_matches_generate(llava_next, LLAVA_NEXT_CASES[case]())


def test_qwen_vl_items_arriving_after_the_text_match_generate(qwen_vl):
    """Encode/prefill overlap: the 3-D positions are computed from the plan before any item
    arrives; the image and the video come late, the video first."""
    from tests.unit.test_engine_overlap import served_late
    from tests.unit.test_families import message, reference

    model, processor, planner, encoder, runner = qwen_vl
    parts = QWEN_VL_CASES["image and video"]()
    plan = planner.plan(message(*parts), media(parts))
    assert (
        served_late(encoder, runner, plan, 8)
        == reference(model, processor, message(*parts), list(plan.items), 8)[1]
    )


@pytest.mark.parametrize("packed", [False, True], ids=["prefilled apart", "packed"])
def test_qwen_vl_batched_encode_and_decode(qwen_vl, packed):
    """Mixed media in one encoder batch and one decode batch, each row with its own rope delta;
    `packed`: every prompt prefilled in one forward."""
    got, want, deltas = generate_batched(
        qwen_vl, [QWEN_VL_CASES[name]() for name in sorted(QWEN_VL_CASES)], 6, packed
    )
    assert len(set(deltas)) > 2, "the cases should exercise different rope deltas"
    assert got == want


def test_llava_next_batched_encode_and_decode(llava_next):
    # Its tiny checkpoint's language model is not one-mask SDPA: its prompts are never packed.
    got, want, _ = generate_batched(
        llava_next, [LLAVA_NEXT_CASES[name]() for name in sorted(LLAVA_NEXT_CASES)], 6
    )
    assert got == want


def test_vl_models_refuse_audio(qwen_vl, llava_next):
    from router.types import Modality
    from tests.unit.test_families import item, tone

    for family in (qwen_vl, llava_next):
        with pytest.raises(ValueError, match="does not take audio input"):
            family[2].spec.layout(item(Modality.AUDIO, tone(0.5, 440)))
    with pytest.raises(ValueError, match="does not take video input"):
        llava_next[2].spec.layout(video(2, 20, 20))
