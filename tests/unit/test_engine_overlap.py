"""Encode/prefill overlap in the real prefill engine (no Ray) on the tiny checkpoint: a request
is added before its items' embeddings; the text before the first missing item is
prefilled meanwhile, items arrive after some steps (out of order too) and are spliced in,
and the result is token-exact against HF `generate` and equal to the engine with every
item up front. Prefix-cache hits need no late item; an abort while waiting frees all."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from actors.engine import kv  # noqa: E402
from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.prefill import PrefillEngine, PrefillOutput  # noqa: E402
from actors.types import MediaItem, PrefillRequest  # noqa: E402
from router.types import Modality  # noqa: E402
from router.worker_settings import PrefillSettings  # noqa: E402
from tests.unit.test_lm_runner import (
    GREEDY,
    encoder,  # noqa: F401 (a fixture)
    hf_greedy,
    hf_model,  # noqa: F401 (a fixture)
    lm,  # noqa: F401 (a fixture)
    placeholder_ranges,
    processor,  # noqa: F401 (a fixture)
)

LONG_TEXT = "Here is a long description of the scene that comes before the picture itself. " * 4
BIG_CACHE_MB = 1024


def _cached(max_chunk_tokens: int) -> PrefillSettings:
    return PrefillSettings(max_chunk_tokens, prefix_block_tokens=4, prefix_cache_mb=BIG_CACHE_MB)


def text_then_images(
    processor, image_token_id: int, arrays: list[np.ndarray], question: str = "What is in it?"
):
    content = [{"type": "text", "text": LONG_TEXT}]
    for i, _ in enumerate(arrays):  # text between images: their placeholder runs stay apart
        content += [{"type": "text", "text": " and "}] * (i > 0) + [{"type": "image"}]
    content.append({"type": "text", "text": question})
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    inputs = processor(text=text, images=[Image.fromarray(a) for a in arrays], return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    return tuple(token_ids), placeholder_ranges(token_ids, image_token_id), inputs


def prefill_late(
    engine: PrefillEngine, request: PrefillRequest, late: dict[int, tuple[int, torch.Tensor]]
):
    """Step an engine holding `request` without the `late` items: item slot -> (step before
    which it arrives, embeddings); an engine with nothing to do gets the next item at once.
    Returns the output, num_computed after each step, the step each item arrived before
    and the step at which each other request finished."""
    pending = sorted(late.items(), key=lambda kv_: kv_[1][0])
    progress, arrived, others, step = [], {}, {}, 0
    while True:
        while pending and (pending[0][1][0] <= step or not engine.has_work):
            slot, (_, embeddings) = pending.pop(0)
            engine.add_item(request.request_id, slot, embeddings)
            arrived[slot] = step
        outs = engine.step()
        others.update({o.request_id: step for o in outs})
        job = engine.jobs.get(request.request_id)
        progress.append(job.num_computed if job else len(request.prompt_token_ids))
        if outs := [o for o in outs if o.request_id == request.request_id]:
            return outs[0], progress, arrived, others
        step += 1


def decode_tokens(
    runner: LMRunner, out: PrefillOutput, num_prompt_tokens: int, num_tokens: int
) -> list[int]:
    batch, tokens = kv.BatchedKV(), [out.first.token_id]
    batch.join(out.packed_kv)
    for i in range(num_tokens - 1):
        tokens += [
            s.token_id
            for s in runner.decode_step(
                batch, [tokens[-1]], [GREEDY], [num_prompt_tokens + i], [out.rope_delta]
            )
        ]
    return tokens


def up_front(lm, request: PrefillRequest, items: list[torch.Tensor], budget: int) -> PrefillOutput:
    engine = PrefillEngine(LMRunner(lm), PrefillSettings(budget))
    engine.add(request, items)
    while not (outs := engine.step()):
        pass
    return outs[0]


def embed(encoder, arrays: list[np.ndarray]) -> list[torch.Tensor]:
    return [
        encoder.encode([MediaItem(Modality.IMAGE, f"img{i}", data=a)])[0]
        for i, a in enumerate(arrays)
    ]


@pytest.mark.parametrize("budget", [16, 512])
def test_text_before_the_image_goes_while_the_encoder_runs(
    lm, encoder, hf_model, processor, budget
):
    array = np.random.default_rng(3).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    ids, ranges, inputs = text_then_images(processor, hf_model.config.image_token_id, [array])
    [emb] = embed(encoder, [array])
    request = PrefillRequest("r", ids, ranges, GREEDY, media_identifiers=("img0",))
    engine = PrefillEngine(LMRunner(lm), PrefillSettings(budget))
    engine.add(request)
    while engine.has_work:
        engine.step()
    assert engine.jobs["r"].num_computed == ranges[0].offset > 0, (
        "the text before the image is prefilled, not a token of the image"
    )
    assert engine.stats()["waiting_for_items"] == 1 and engine.step() == [], (
        "it waits without busying the loop"
    )

    out, *_ = prefill_late(engine, request, {0: (0, emb)})
    want = up_front(lm, request, [emb], budget)
    assert out.first.token_id == want.first.token_id and out.item_wait_ms > 0
    torch.testing.assert_close(out.packed_kv, want.packed_kv, rtol=1e-5, atol=1e-5)
    assert decode_tokens(engine.runner, out, len(ids), 6) == hf_greedy(hf_model, 6, **inputs)
    assert not engine.jobs and not engine.has_work


def test_a_prefix_shorter_than_overlap_min_tokens_waits_and_goes_in_one_forward(
    lm, encoder, hf_model, processor
):
    """overlap_min_tokens above the text before the image: the request costs no step until the
    image comes, then the prompt goes in one chunk, token-exact; the wait is item wait, not
    queue. An abort while it is held leaves nothing."""
    array = np.random.default_rng(6).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    ids, ranges, inputs = text_then_images(processor, hf_model.config.image_token_id, [array])
    [emb] = embed(encoder, [array])
    request = PrefillRequest("r", ids, ranges, GREEDY, media_identifiers=("img0",))
    engine = PrefillEngine(
        LMRunner(lm), PrefillSettings(512, overlap_min_tokens=ranges[0].offset + 1)
    )
    engine.add(request)
    assert not engine.has_work and not engine.jobs, "held aside: not a step until the image comes"
    assert engine.stats()["waiting_for_items"] == 1 and engine.stats()["queued"] == 1, (
        "parked: seen by drain checks"
    )
    time.sleep(0.3)  # long beside a loaded host's stalls (a 50 ms sleep once took 90)
    out, progress, *_ = prefill_late(engine, request, {0: (0, emb)})
    assert progress == [len(ids)], "one step: the whole prompt"
    assert out.item_wait_ms >= 300 and out.queue_ms < out.item_wait_ms / 2, (
        "the wait for the image is item wait, not queueing"
    )
    assert decode_tokens(engine.runner, out, len(ids), 6) == hf_greedy(hf_model, 6, **inputs)
    engine.add(PrefillRequest("gone", ids, ranges, GREEDY, media_identifiers=("img0",)))
    engine.abort("gone")
    engine.add_item("gone", 0, emb)  # a late item of an aborted request goes nowhere
    while engine.has_work:
        assert engine.step() == []
    assert (
        not engine.jobs
        and engine.stats()["waiting_for_items"] == 0
        and engine.stats()["queued"] == 0
    )


def test_items_out_of_order_and_a_text_request_is_not_held(lm, encoder, hf_model, processor):
    """Two images; the second arrives first and waits for the first, while a text-only
    request added later finishes in the meantime."""
    rng = np.random.default_rng(4)
    arrays = [
        rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        rng.integers(0, 256, (48, 40, 3), dtype=np.uint8),
    ]
    ids, ranges, inputs = text_then_images(
        processor, hf_model.config.image_token_id, arrays, "Compare them."
    )
    embs = embed(encoder, arrays)
    request = PrefillRequest("r", ids, ranges, GREEDY, media_identifiers=("img0", "img1"))
    engine = PrefillEngine(LMRunner(lm), PrefillSettings(16))
    engine.add(request)
    engine.add(PrefillRequest("text", tuple(range(20, 60)), (), GREEDY))
    assert len(ranges) == 2
    out, progress, arrived, others = prefill_late(
        engine, request, {1: (1, embs[1]), 0: (30, embs[0])}
    )
    assert arrived[1] < others["text"] < arrived[0], (
        "the text request finished while the image request waited"
    )
    assert max(progress[: arrived[0]]) == ranges[0].offset, (
        "the text goes, nothing of the first image's span before it arrives"
    )
    assert not engine.jobs
    want = up_front(lm, request, embs, 16)
    torch.testing.assert_close(out.packed_kv, want.packed_kv, rtol=1e-5, atol=1e-5)
    assert decode_tokens(engine.runner, out, len(ids), 6) == hf_greedy(hf_model, 6, **inputs)


def test_a_prefix_hit_needs_no_late_item_and_one_arriving_after_the_end_is_dropped(
    lm, encoder, hf_model, processor
):
    array = np.random.default_rng(5).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    ids, ranges, _ = text_then_images(processor, hf_model.config.image_token_id, [array])
    [emb] = embed(encoder, [array])
    engine = PrefillEngine(LMRunner(lm), _cached(64))
    engine.add(PrefillRequest("turn1", ids, ranges, GREEDY, media_identifiers=("img0",)), [emb])
    while engine.has_work:
        engine.step()
    follow_up = ids + (21, 22, 23, 24, 25, 26, 27)
    turn2 = PrefillRequest("turn2", follow_up, ranges, GREEDY, media_identifiers=("img0",))
    engine.add(turn2)  # its image is still being encoded (an encoder-cache miss, say)
    while not (outs := engine.step()):
        assert engine.has_work, "the cached prefix covers the image: nothing to wait for"
    [out] = outs
    assert out.num_cached_tokens > ranges[0].offset + ranges[0].length and out.item_wait_ms == 0
    engine.add_item("turn2", 0, emb)  # arrives after the end: dropped, nothing kept
    engine.step()
    assert not engine.jobs and engine.pool.num_referenced() == 0
    want_ids = hf_greedy(
        hf_model,
        6,
        input_ids=torch.tensor([follow_up]),
        pixel_values=processor(images=[Image.fromarray(array)], return_tensors="pt")[
            "pixel_values"
        ],
    )
    assert decode_tokens(engine.runner, out, len(follow_up), 6) == want_ids


def test_an_image_first_turn_whose_image_is_cached_runs_without_waiting_for_it(
    lm, encoder, hf_model, processor
):
    """A follow-up turn about the same image: the image comes first, so nothing ran ahead of
    it, and the request waited for an encoder round trip whose embeddings it never used."""
    array = np.random.default_rng(8).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.fromarray(array)], return_tensors="pt")
    ids = tuple(inputs["input_ids"][0].tolist())
    ranges = placeholder_ranges(list(ids), hf_model.config.image_token_id)
    [emb] = embed(encoder, [array])
    # as served (prefill.overlap_min_tokens): the few tokens before the image wait with it
    settings = dataclasses.replace(_cached(512), overlap_min_tokens=64)
    engine = PrefillEngine(LMRunner(lm), settings)
    engine.add(PrefillRequest("turn1", ids, ranges, GREEDY, media_identifiers=("img0",)), [emb])
    while engine.has_work:
        engine.step()
    follow_up = ids + (21, 22, 23, 24, 25)
    engine.add(PrefillRequest("turn2", follow_up, ranges, GREEDY, media_identifiers=("img0",)))
    assert engine.has_work, "its image is in the cached prefix: it runs now"
    while not (outs := engine.step()):
        assert engine.has_work
    [out] = outs
    assert out.num_cached_tokens >= ranges[0].offset + ranges[0].length and out.item_wait_ms == 0
    engine.add_item("turn2", 0, emb)  # the encoder's answer, after the end: dropped
    engine.step()
    assert not engine.jobs and engine.pool.num_referenced() == 0
    want = hf_greedy(
        hf_model, 6, input_ids=torch.tensor([follow_up]), pixel_values=inputs["pixel_values"]
    )
    assert decode_tokens(engine.runner, out, len(follow_up), 6) == want
    # another image behind the same token ids is not in the cache: that turn waits for it
    other = PrefillRequest("other", follow_up, ranges, GREEDY, media_identifiers=("img1",))
    engine.add(other)
    assert not engine.has_work and engine.stats()["waiting_for_items"] == 1


def test_abort_while_waiting_for_an_item_frees_everything(lm, encoder, hf_model, processor):
    array = np.random.default_rng(6).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    ids, ranges, _ = text_then_images(processor, hf_model.config.image_token_id, [array])
    [emb] = embed(encoder, [array])
    engine = PrefillEngine(LMRunner(lm), _cached(512))
    engine.add(
        PrefillRequest("warm", ids[: ranges[0].offset], (), GREEDY)
    )  # its blocks become this request's cached prefix
    while engine.has_work:
        engine.step()
    engine.add(PrefillRequest("r", ids, ranges, GREEDY, media_identifiers=("img0",)))
    engine.step()
    assert engine.pool.num_referenced() > 0 and not engine.has_work, (
        "waiting for its image, holding cached blocks"
    )
    engine.abort("r")
    assert engine.has_work
    engine.step()
    engine.add_item("r", 0, emb)  # the encoder finished after the request ended
    engine.step()
    assert not engine.jobs and not engine.has_work and engine.pool.num_referenced() == 0
    assert engine.stats()["waiting_for_items"] == 0


def served_late(encoder, runner: LMRunner, plan, num_tokens: int, budget: int = 8) -> list[int]:
    """`test_families.served` through the prefill engine with every item arriving late, the
    last first (3-D rotary families: positions come from the plan, not the embeddings)."""
    embeddings = [encoder.encode([item])[0] for item in plan.items]
    engine = PrefillEngine(runner, PrefillSettings(budget))
    request = PrefillRequest("r", plan.token_ids, plan.placeholders, GREEDY)
    engine.add(request)
    late = {slot: (4 * (len(embeddings) - slot), e) for slot, e in enumerate(embeddings)}
    out, progress, arrived, _ = prefill_late(engine, request, late)
    assert 0 < max(progress[: arrived[0]]) <= plan.placeholders[0].offset, (
        "text first, no item before it arrives"
    )
    return decode_tokens(runner, out, len(plan.token_ids), num_tokens)


def test_an_item_that_does_not_fit_fails_its_request_alone(lm, encoder, hf_model, processor):
    """An item with the wrong number of embeddings (or slot) fails its own request; another
    request in the same worker finishes as if nothing happened."""
    array = np.random.default_rng(7).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    ids, ranges, _ = text_then_images(processor, hf_model.config.image_token_id, [array])
    [emb] = embed(encoder, [array])
    engine = PrefillEngine(LMRunner(lm), _cached(64))
    engine.add(PrefillRequest("bad", ids, ranges, GREEDY, media_identifiers=("img0",)))
    engine.add(PrefillRequest("slot", ids, ranges, GREEDY, media_identifiers=("img0",)))
    engine.add(PrefillRequest("text", tuple(range(20, 60)), (), GREEDY))
    engine.add_item("bad", 0, emb[:-4])
    engine.add_item("slot", 3, emb)
    outs: dict[str, PrefillOutput] = {}
    while engine.has_work:
        outs.update({o.request_id: o for o in engine.step()})
    assert "embeddings for its" in outs["bad"].error and "out of range" in outs["slot"].error
    assert outs["text"].error is None and outs["text"].first is not None
    assert not engine.jobs and engine.pool.num_referenced() == 0
