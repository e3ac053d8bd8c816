"""Audio and all-modality families without Ray: the ingress's plan equals the model's own
processor token for token, and encoder adapter + LMRunner (splice, 3-D positions, rope delta
carried to decode, batched decode) give exactly the greedy tokens of the model's `generate`."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402
from transformers import AutoProcessor, Qwen2_5OmniThinkerForConditionalGeneration  # noqa: E402

from actors.engine import kv  # noqa: E402
from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.prefill import PrefillEngine  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from actors.types import MediaItem, PrefillRequest, SamplingParams  # noqa: E402
from cluster.media.identifiers import media_identifier  # noqa: E402
from cluster.prompt_plan import PromptPlanner  # noqa: E402
from router.types import Modality  # noqa: E402
from router.worker_settings import PrefillSettings  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
RNG = np.random.default_rng(7)


def tone(seconds: float, hz: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t) + 0.05 * RNG.standard_normal(t.size)).astype(
        np.float32
    )


def item(modality: Modality, data: np.ndarray, fps: float | None = None) -> MediaItem:
    return MediaItem(
        modality,
        media_identifier("test", modality, data),
        data,
        16000 if modality == Modality.AUDIO else None,
        fps,
    )


def image(h: int, w: int) -> MediaItem:
    return item(Modality.IMAGE, (RNG.random((h, w, 3)) * 255).astype(np.uint8))


def video(t: int, h: int, w: int, fps: float = 2.0) -> MediaItem:
    return item(Modality.VIDEO, (RNG.random((t, h, w, 3)) * 255).astype(np.uint8), fps)


def media(parts) -> list[MediaItem]:
    return [p for p in parts if isinstance(p, MediaItem)]


def message(*parts) -> list[dict]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": p.modality.value}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def reference(
    model, processor, messages: list[dict], items: list[MediaItem], max_new_tokens: int
) -> list[int]:
    """The model's own processor + chat template + greedy generate."""
    by = {m: [i for i in items if i.modality == m] for m in Modality}
    kwargs = {}
    if by[Modality.IMAGE]:
        kwargs["images"] = [Image.fromarray(i.data) for i in by[Modality.IMAGE]]
    if by[Modality.VIDEO]:
        kwargs["videos"] = [i.data for i in by[Modality.VIDEO]]
        # fps for the Omni processor, per-video metadata for Qwen2.5-VL's (which else assumes
        # 24 fps)
        kwargs["videos_kwargs"] = {
            "fps": by[Modality.VIDEO][0].frames_per_s,
            "video_metadata": [
                {"total_num_frames": len(i.data), "fps": i.frames_per_s} for i in by[Modality.VIDEO]
            ],
        }
    if by[Modality.AUDIO]:
        kwargs["audio"] = [i.data for i in by[Modality.AUDIO]]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], return_tensors="pt", **kwargs)
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1] :].tolist()


def served(encoder, runner: LMRunner, plan, max_new_tokens: int) -> list[int]:
    embeddings = [encoder.encode([i])[0] for i in plan.items]
    first, packed, delta = runner.prefill(plan.token_ids, plan.placeholders, embeddings, GREEDY)
    batch, tokens = kv.BatchedKV(), [first.token_id]
    batch.join(packed)
    for step in range(max_new_tokens - 1):
        tokens += [
            s.token_id
            for s in runner.decode_step(
                batch, [tokens[-1]], [GREEDY], [len(plan.token_ids) + step], [delta]
            )
        ]
    return tokens


@pytest.fixture(scope="module")
def omni(omni_ckpt):
    return (
        Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(omni_ckpt).eval(),
        AutoProcessor.from_pretrained(omni_ckpt),
        PromptPlanner(omni_ckpt),
        load_adapter(omni_ckpt, part=Part.ENCODER, dtype="float32", device="cpu"),
        LMRunner(
            load_adapter(omni_ckpt, part=Part.LANGUAGE_MODEL, dtype="float32", device="cpu"),
            max_chunk_tokens=64,
        ),
    )


OMNI_CASES = {
    "image": lambda: ["Look ", image(60, 90), " what?"],
    "video": lambda: [video(6, 40, 56), "Describe it."],
    "audio": lambda: ["Hear ", item(Modality.AUDIO, tone(1.5, 440))],
    "image+audio+text": lambda: [
        "A ",
        image(50, 50),
        " then ",
        item(Modality.AUDIO, tone(2.0, 880)),
        " and text.",
    ],
    "two videos": lambda: [video(4, 30, 30, fps=1.0), " vs ", video(5, 56, 40, fps=1.0)],
    "long audio": lambda: ["Long: ", item(Modality.AUDIO, tone(9.0, 330))],
}


def check_matches_generate(family, parts) -> None:
    """The plan equals the processor's tokens and the served tokens equal `generate`'s."""
    model, processor, planner, encoder, runner = family
    plan = planner.plan(message(*parts), media(parts))
    windowed = planner.window_audio(message(*parts), media(parts))[
        0
    ]  # the reference gets the same windows
    want_ids, want = reference(model, processor, windowed, list(plan.items), 8)
    assert list(plan.token_ids) == want_ids
    assert served(encoder, runner, plan, 8) == want


@pytest.mark.parametrize("case", sorted(OMNI_CASES))
def test_omni_matches_generate(omni, case):
    check_matches_generate(omni, OMNI_CASES[case]())


def test_omni_items_arriving_after_the_text_match_generate(omni):
    """Encode/prefill overlap on the Omni thinker (3-D positions, audio): items come late, last
    first."""
    from tests.unit.test_engine_overlap import served_late

    model, processor, planner, encoder, runner = omni
    parts = OMNI_CASES["image+audio+text"]()
    plan = planner.plan(message(*parts), media(parts))
    assert (
        served_late(encoder, runner, plan, 8)
        == reference(model, processor, message(*parts), list(plan.items), 8)[1]
    )


def encode_batched(encoder, plans) -> list[list[torch.Tensor]]:
    """Every item of every plan encoded in one batch per modality, as the encoder pool batches."""
    flat = [(p, k, i) for p, plan in enumerate(plans) for k, i in enumerate(plan.items)]
    out = [[None] * len(plan.items) for plan in plans]
    for modality in Modality:
        mine = [(p, k, i) for p, k, i in flat if i.modality == modality]
        if mine:
            for (p, k, _), rows in zip(mine, encoder.encode([i for _, _, i in mine]), strict=True):
                out[p][k] = rows
    return out


def generate_batched(
    family, cases: list[list], num_tokens: int, packed: bool = False, fixed=None
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Every case at once: one encoder batch per modality, one decode batch with each row's
    own rope delta; (served tokens, each case's own generate, the rope deltas). `packed`:
    every prompt prefilled in one forward (actors/engine/prompt_pack.py), else one by one;
    `fixed`: decode steps on fixed buffers (actors/engine/step_graphs.py)."""
    model, processor, planner, encoder, runner = family
    plans = [planner.plan(message(*parts), media(parts)) for parts in cases]
    wants = [
        reference(
            model,
            processor,
            planner.window_audio(message(*parts), media(parts))[0],
            list(plan.items),
            num_tokens,
        )[1]
        for parts, plan in zip(cases, plans)
    ]
    batch, tokens, deltas = kv.BatchedKV(), [], []
    prefill = prefill_packed if packed else prefill_apart
    for first, packed_kv, delta in prefill(runner, plans, encode_batched(encoder, plans)):
        batch.join(packed_kv)
        tokens.append([first.token_id])
        deltas.append(delta)
    for step in range(num_tokens - 1):
        nxt = runner.decode_step(
            batch,
            [t[-1] for t in tokens],
            [GREEDY] * len(plans),
            [len(p.token_ids) + step for p in plans],
            deltas,
            fixed=fixed,
        )
        for t, token in zip(tokens, nxt):
            t.append(token.token_id)
    return tokens, wants, deltas


def prefill_apart(runner: LMRunner, plans, embeddings) -> list[tuple]:
    return [
        runner.prefill(plan.token_ids, plan.placeholders, items, GREEDY)
        for plan, items in zip(plans, embeddings)
    ]


def prefill_packed(runner: LMRunner, plans, embeddings) -> list[tuple]:
    """The prompts through a prefill engine whose one step computes all it can pack."""
    budget = sum(len(plan.token_ids) for plan in plans)
    settings = PrefillSettings(budget, pack_prompts=True)
    engine = PrefillEngine(LMRunner(runner.adapter, budget), settings)
    for i, (plan, items) in enumerate(zip(plans, embeddings)):
        engine.add(PrefillRequest(f"r{i}", plan.token_ids, plan.placeholders, GREEDY), items)
    steps = []
    while engine.has_work:
        steps.append(engine.step())
    assert max(len(step) for step in steps) > 1, "some prompts shared a forward"
    outs = {o.request_id: o for step in steps for o in step}
    ordered = [outs[f"r{i}"] for i in range(len(plans))]
    return [(o.first, o.packed_kv, o.rope_delta) for o in ordered]


@pytest.mark.parametrize("packed", [False, True], ids=["prefilled apart", "packed"])
def test_omni_batched_encode_and_decode(omni, packed):
    """All cases at once: each row still equals its own generate."""
    tokens, wants, deltas = generate_batched(
        omni, [OMNI_CASES[name]() for name in sorted(OMNI_CASES)], 6, packed
    )
    assert len(set(deltas)) > 2, "the cases should exercise different rope deltas"
    assert tokens == wants


@pytest.mark.parametrize("height,width", [(1, 1), (1, 200), (3, 100)])
def test_omni_frames_one_or_three_pixels_high_encode_as_planned(omni, height, width):
    """Frames 1 or 3 pixels high look channels-first to the processor's layout guess. The
    reference gets frames channels-first, which it cannot misread: the encoder must give
    its rows, as many as the plan has placeholders (a 1x1 GIF once gave 140 for 144)."""
    model, processor, planner, encoder, _ = omni
    clip = video(2, height, width)
    plan = planner.plan(message("Watch", clip), [clip])
    frames = torch.from_numpy(clip.data).permute(0, 3, 1, 2)  # T x C x H x W
    inputs = processor.video_processor([frames], return_tensors="pt")
    want = model.model.get_video_features(
        inputs["pixel_values_videos"], inputs["video_grid_thw"]
    ).pooler_output[0]
    assert inputs["video_grid_thw"].tolist() == [list(plan.placeholders[0].grid_thw)]
    rows = encoder.encode([clip])[0]
    assert rows.shape[0] == plan.num_embeddings[0] == want.shape[0]
    torch.testing.assert_close(rows, want)


def test_long_audio_is_split_into_windows(omni):
    _, _, planner, _, _ = omni
    clip = item(Modality.AUDIO, tone(9.0, 330))
    plan = planner.plan(message("x", clip), [clip])
    window = planner.spec.audio_window_samples
    assert len(plan.items) == 3 and all(len(i.data) <= window for i in plan.items)
    assert np.array_equal(np.concatenate([i.data for i in plan.items]), clip.data)


@pytest.fixture(scope="module")
def qwen2_audio(audio_ckpt):
    return (
        _audio_model(audio_ckpt),
        AutoProcessor.from_pretrained(audio_ckpt),
        PromptPlanner(audio_ckpt),
        load_adapter(audio_ckpt, part=Part.ENCODER, dtype="float32", device="cpu"),
        LMRunner(
            load_adapter(audio_ckpt, part=Part.LANGUAGE_MODEL, dtype="float32", device="cpu"),
            max_chunk_tokens=64,
        ),
    )


def _audio_model(path):
    from transformers import Qwen2AudioForConditionalGeneration

    return Qwen2AudioForConditionalGeneration.from_pretrained(path).eval()


AUDIO_CASES = {
    "one clip": lambda: [item(Modality.AUDIO, tone(2.5, 440)), "What is this?"],
    "two clips": lambda: [
        "First ",
        item(Modality.AUDIO, tone(1.0, 300)),
        " second ",
        item(Modality.AUDIO, tone(3.0, 600)),
    ],
    "long clip": lambda: [item(Modality.AUDIO, tone(10.5, 500)), "Summarise."],
}


@pytest.mark.parametrize("case", sorted(AUDIO_CASES))
def test_qwen2_audio_matches_generate(qwen2_audio, case):
    check_matches_generate(qwen2_audio, AUDIO_CASES[case]())


def test_qwen2_audio_refuses_images(qwen2_audio):
    with pytest.raises(ValueError, match="does not take image input"):
        qwen2_audio[2].spec.layout(image(20, 20))
