"""Unit tests for actors.engine.lm_runner + actors.models.adapter on the tiny checkpoint (no Ray).

The reference is Hugging Face's own `generate` on the whole LlavaForConditionalGeneration:
chunked prefill, KV packing, the left-padded decode batch with requests joining and
leaving between steps, and splicing encoder embeddings must give exactly its greedy tokens.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from transformers import AutoProcessor, LlavaForConditionalGeneration  # noqa: E402

from actors.checkpoints.kit import SPECIAL_TOKENS  # noqa: E402
from actors.engine.decode import DecodeEngine  # noqa: E402
from actors.engine.lm_runner import LMRunner, splice  # noqa: E402
from actors.engine.prefill import PrefillEngine  # noqa: E402
from actors.models.adapter import Part  # noqa: E402
from actors.models.llava import LlavaAdapter
from actors.types import (  # noqa: E402
    DecodeRequest,
    MediaItem,
    PlaceholderRange,
    PrefillRequest,
    SamplingParams,
)
from router.types import Modality  # noqa: E402
from router.worker_settings import MIB, DecodeSettings, PrefillSettings  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    return LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lm(ckpt):
    return LlavaAdapter(ckpt, part=Part.LANGUAGE_MODEL, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def encoder(ckpt):
    return LlavaAdapter(ckpt, part=Part.ENCODER, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def processor(ckpt):
    return AutoProcessor.from_pretrained(ckpt)


def hf_greedy(model, max_new_tokens: int, **inputs) -> list[int]:
    """HF greedy generation for exactly max_new_tokens (EOS does not stop it)."""
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None
        )
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new) == max_new_tokens, "the reference stopped early"
    return new


def run_engines(
    prompts: list[tuple[tuple[int, ...], tuple[PlaceholderRange, ...], list[torch.Tensor], int]],
    arrivals: list[int],
    prefill: PrefillEngine,
    decode: DecodeEngine,
    identifiers: list[tuple[str, ...]] | None = None,
    expect_batching: bool = True,
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Drive the workers' real loops: prompt i reaches the prefill engine before step
    arrivals[i]; its first token and KV go to the decode engine, which batches continuously.
    Returns each request's tokens and how many prompt tokens came from the prefix cache."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    step, pending = 0, sorted(range(len(prompts)), key=lambda i: arrivals[i])
    max_rows, events = 0, set()
    while pending or prefill.has_work or decode.has_work:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            token_ids, ranges, items, _ = prompts[i]
            prefill.add(
                PrefillRequest(
                    f"r{i}",
                    token_ids,
                    ranges,
                    GREEDY,
                    media_identifiers=identifiers[i] if identifiers else (),
                ),
                items,
            )
        for out in prefill.step():
            i = int(out.request_id[1:])
            params = SamplingParams(
                temperature=0.0, max_tokens=prompts[i][3]
            )  # no stop ids: run to max_tokens
            first = out.first.token_id
            tokens[out.request_id], cached[out.request_id] = [first], out.num_cached_tokens
            decode.add(
                DecodeRequest(out.request_id, len(prompts[i][0]), first, params, out.rope_delta),
                out.packed_kv,
            )
        rows_before = decode.batch.num_rows
        for out in decode.step():
            tokens[out.request_id] += out.chunk.token_ids
            if out.chunk.finished and decode.scheduler.running:
                events.add("left mid-flight")
        if rows_before and decode.batch.num_rows > rows_before:
            events.add("joined mid-flight")
        max_rows = max(max_rows, decode.batch.num_rows)
        step += 1
    assert decode.batch.num_rows == 0, "finished requests leaked their rows"
    assert not prefill.jobs and prefill.pool.num_referenced() == 0, (
        "finished prefills still hold blocks"
    )
    prefill.pool.check_integrity()
    if expect_batching:
        assert max_rows > 1, "the test never batched"
        assert events == {"joined mid-flight", "left mid-flight"}, events
    return tokens, cached


def engines(
    lm, max_chunk_tokens: int, prefix_cache_mb: float = 0.0, prefix_block_tokens: int = 4
) -> tuple[PrefillEngine, DecodeEngine]:
    settings = PrefillSettings(
        max_chunk_tokens, prefix_block_tokens=prefix_block_tokens, prefix_cache_mb=prefix_cache_mb
    )
    prefill = PrefillEngine(LMRunner(lm), settings)
    return prefill, DecodeEngine(LMRunner(lm), DecodeSettings(max_batch_size=4), 10_000)


@pytest.mark.parametrize("max_chunk_tokens", [4, 512])
def test_text_only_continuous_batching_matches_hf_generate(lm, hf_model, max_chunk_tokens):
    rnd = random.Random(max_chunk_tokens)
    vocab = hf_model.config.text_config.vocab_size
    prompts, arrivals = [], []
    for i in range(10):
        length = rnd.randint(3, 40)
        token_ids = tuple(rnd.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(length))
        prompts.append((token_ids, (), [], rnd.randint(1, 16)))
        arrivals.append(rnd.randint(0, 12))
    prompts[0] = ((50, 60, 70), (), [], 16)  # the shortest length, a long generation
    prompts[1] = (
        tuple(rnd.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(40)),
        (),
        [],
        1,
    )  # prefill only
    arrivals[0] = 0

    got, _ = run_engines(prompts, arrivals, *engines(lm, max_chunk_tokens))

    for i, (token_ids, _, _, max_tokens) in enumerate(prompts):
        want = hf_greedy(hf_model, max_tokens, input_ids=torch.tensor([token_ids]))
        assert got[f"r{i}"] == want, f"prompt {i} (length {len(token_ids)})"


def test_chunked_prefill_matches_one_pass(lm):
    token_ids = tuple(range(10, 47))  # 37 tokens: chunks of 5 leave a remainder
    first_a, kv_a, _ = LMRunner(lm, max_chunk_tokens=5).prefill(token_ids, (), [], GREEDY)
    first_b, kv_b, _ = LMRunner(lm, max_chunk_tokens=512).prefill(token_ids, (), [], GREEDY)
    assert first_a == first_b
    layers = lm.config.text_config.num_hidden_layers
    kv_heads = lm.config.text_config.num_key_value_heads
    assert kv_a.shape == kv_b.shape
    assert kv_a.shape[:4] == (layers, 2, kv_heads, len(token_ids))
    torch.testing.assert_close(kv_a, kv_b, rtol=1e-5, atol=1e-5)


def test_compute_ms_is_a_requests_own_forwards_not_those_sharing_its_steps(lm):
    """The router calibrates prefill cost from compute_ms: under shortest-remaining-first a long
    prompt's first-chunk-to-done time also holds the short prompts' forwards."""
    engine = PrefillEngine(LMRunner(lm), PrefillSettings(max_chunk_tokens=16))
    engine.add(PrefillRequest("long", tuple(range(10, 74)), (), GREEDY))  # 64 tokens: 4 steps alone
    engine.add(
        PrefillRequest("short", tuple(range(10, 22)), (), GREEDY)
    )  # 12: first in every step it is in
    started, outs = time.perf_counter(), []
    while engine.has_work:
        outs += engine.step()
    wall_ms = (time.perf_counter() - started) * 1e3
    out = {o.request_id: o for o in outs}
    assert 0 < out["short"].compute_ms <= out["short"].prefill_ms
    assert out["long"].compute_ms < out["long"].prefill_ms, (
        "the short prompt's forward ran inside the long one's span"
    )
    assert out["long"].compute_ms + out["short"].compute_ms <= wall_ms


def test_a_prompt_that_finishes_leaves_before_the_chunks_planned_behind_it(lm):
    """A short prompt sharing a step with a long one: its first token leaves after its own
    forward, not after the long prompt's chunk (on a 2-core host that chunk doubled text TTFT
    beside video); the long one gets the whole budget from the next step on."""
    engine = PrefillEngine(LMRunner(lm), PrefillSettings(max_chunk_tokens=16))
    engine.add(PrefillRequest("long", tuple(range(10, 74)), (), GREEDY))  # 64 tokens
    engine.add(PrefillRequest("short", tuple(range(10, 22)), (), GREEDY))  # 12: planned first
    first = engine.step()
    assert [o.request_id for o in first] == ["short"]
    assert engine.jobs["long"].num_computed == 0, "the long prompt's chunk ran before it left"
    computed = []
    while engine.has_work:
        outs = engine.step()
        computed.append(engine.jobs["long"].num_computed if "long" in engine.jobs else 64)
    assert computed == [16, 32, 48, 64] and [o.request_id for o in outs] == ["long"]
    alone, _, _ = LMRunner(lm, max_chunk_tokens=16).prefill(tuple(range(10, 74)), (), [], GREEDY)
    assert outs[0].first.token_id == alone.token_id


def test_a_first_token_leaves_before_its_prompt_enters_the_prefix_cache(lm):
    """Inserting a finished prompt's blocks (a clone each) follows its first token: the step
    that finishes it returns with the cache unchanged, and the next step, which the engine asks
    for at once, puts them in before any new request looks for its prefix."""
    settings = PrefillSettings(16, prefix_block_tokens=4, prefix_cache_mb=64)
    engine = PrefillEngine(LMRunner(lm), settings)
    prompt = tuple(range(10, 22))  # 12 tokens: 3 blocks
    engine.add(PrefillRequest("first", prompt, (), GREEDY))
    assert [o.request_id for o in engine.step()] == ["first"]
    assert not engine.pool.blocks and engine.has_work
    engine.add(PrefillRequest("again", prompt + (30, 31), (), GREEDY))
    (out,) = engine.step()  # the blocks go in first, so the repeat hits them
    assert out.request_id == "again" and out.num_cached_tokens == 12
    assert len(engine.pool.blocks) == 3 and engine.has_work  # and its own wait for the next step
    assert engine.step() == [] and not engine.has_work
    engine.pool.check_integrity()


@pytest.mark.parametrize("aging", [0.0, 100.0])
def test_aging_puts_a_prompt_that_waited_ahead_of_a_shorter_newcomer(lm, aging):
    """The engine orders by remaining tokens less aging x seconds waited: a 64-token prompt
    that came 10 s before a 12-token one goes first at 100 tokens/s; the answers do not move."""
    engine = PrefillEngine(
        LMRunner(lm), PrefillSettings(max_chunk_tokens=16, aging_tokens_per_s=aging)
    )
    engine.add(PrefillRequest("long", tuple(range(10, 74)), (), GREEDY))
    engine._intake[
        -1
    ].added_s -= 10.0  # it came 10 s ago (e.g. passed over by shorter prompts since)
    engine.add(PrefillRequest("short", tuple(range(10, 22)), (), GREEDY))
    outs, finished = [], []
    while engine.has_work:
        step = engine.step()
        outs += step
        finished += [o.request_id for o in step]
    assert finished == (["long", "short"] if aging else ["short", "long"])
    for o in outs:  # the same first token and KV as the prompt prefilled alone
        first, kv, _ = LMRunner(lm, max_chunk_tokens=16).prefill(
            tuple(range(10, 74 if o.request_id == "long" else 22)), (), [], GREEDY
        )
        assert o.first.token_id == first.token_id
        torch.testing.assert_close(o.packed_kv, kv, rtol=1e-5, atol=1e-5)


def test_splice_writes_items_over_their_ranges():
    embeds = torch.zeros(1, 10, 3)
    ranges = (PlaceholderRange(1, 2), PlaceholderRange(6, 3))
    items = [torch.full((2, 3), 1.0), torch.full((3, 3), 2.0)]
    out = splice(embeds, ranges, items)
    assert out[0, :, 0].tolist() == [0, 1, 1, 0, 0, 0, 2, 2, 2, 0]
    assert not embeds.any(), "splice must not modify its input"
    assert splice(embeds, (), []) is embeds


def test_splice_wrong_embedding_count_names_the_offset():
    embeds = torch.zeros(1, 10, 3)
    ranges = (PlaceholderRange(1, 2), PlaceholderRange(6, 3))
    with pytest.raises(ValueError, match="offset 6"):
        splice(embeds, ranges, [torch.ones(2, 3), torch.ones(4, 3)])
    with pytest.raises(ValueError):
        splice(embeds, ranges, [torch.ones(2, 3)])  # one item short


def placeholder_ranges(token_ids: list[int], image_token_id: int) -> tuple[PlaceholderRange, ...]:
    ranges, start = [], None
    for i, t in enumerate(token_ids + [None]):
        if t == image_token_id and start is None:
            start = i
        elif t != image_token_id and start is not None:
            ranges.append(PlaceholderRange(start, i - start))
            start = None
    return tuple(ranges)


@pytest.mark.parametrize("max_chunk_tokens", [7, 512])
def test_image_prompt_matches_hf_generate(lm, encoder, hf_model, processor, max_chunk_tokens):
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 256, (40, 50, 3), dtype=np.uint8),
        rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
    ]
    image_id = hf_model.config.image_token_id
    prompts, refs = [], []
    for n, (array, question) in enumerate(zip(arrays, ["What is in this image?", "Describe it."])):
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=text, images=[Image.fromarray(array)], return_tensors="pt")
        token_ids = inputs["input_ids"][0].tolist()
        ranges = placeholder_ranges(token_ids, image_id)
        assert len(ranges) == 1 and ranges[
            0
        ].length == encoder.config.vision_config.image_size**2 // (
            encoder.config.vision_config.patch_size**2
        )
        [embeddings] = encoder.encode([MediaItem(Modality.IMAGE, f"img{n}", data=array)])
        assert embeddings.shape == (ranges[0].length, lm.config.text_config.hidden_size)
        max_tokens = 10 + 3 * n
        prompts.append((tuple(token_ids), ranges, [embeddings], max_tokens))
        refs.append(hf_greedy(hf_model, max_tokens, **inputs))

    # a text-only request shares the batch with the image ones
    prompts.append(((11, 12, 13, 14, 15), (), [], 8))
    refs.append(hf_greedy(hf_model, 8, input_ids=torch.tensor([[11, 12, 13, 14, 15]])))

    got, _ = run_engines(prompts, [0, 2, 1], *engines(lm, max_chunk_tokens))
    for i, want in enumerate(refs):
        assert got[f"r{i}"] == want, f"prompt {i}"


def test_image_embeddings_change_the_output(lm, encoder, processor):
    """The spliced embeddings are used: two different images give different first tokens
    or caches (guards against a splice that silently writes nowhere)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.new("RGB", (32, 32))], return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    ranges = placeholder_ranges(token_ids, lm.config.image_token_id)
    runner = LMRunner(lm)
    caches = []
    for color in ((255, 0, 0), (0, 0, 255)):
        array = np.array(Image.new("RGB", (32, 32), color))
        [emb] = encoder.encode([MediaItem(Modality.IMAGE, str(color), data=array)])
        caches.append(runner.prefill(tuple(token_ids), ranges, [emb], GREEDY)[1])
    assert not torch.allclose(caches[0], caches[1])


def test_kv_bytes_per_token_from_the_config_is_what_prefill_packs(lm):
    """The ingress sizes a request's KV from the config, the decode worker from the packed KV."""
    from actors.engine import kv

    _, packed, _ = LMRunner(lm).prefill((10, 11, 12, 13, 14), (), [], GREEDY)
    assert kv.bytes_per_token(
        lm.config.get_text_config(), packed.element_size()
    ) == kv.packed_bytes_per_token(packed)
    assert kv.packed_bytes_per_token(packed) * 5 == packed.numel() * packed.element_size()


def test_a_kv_budget_queues_a_burst_and_stays_token_exact(lm, hf_model):
    """Six requests arrive at once; the decode KV budget holds about two: the rest wait
    their turn, the reservation never exceeds the budget, and every answer is HF's."""
    from actors.engine import kv

    rnd = random.Random(11)
    vocab = hf_model.config.text_config.vocab_size
    prompts = [
        (
            tuple(rnd.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(rnd.randint(5, 30))),
            (),
            [],
            rnd.randint(3, 10),
        )
        for _ in range(6)
    ]
    per_token = kv.bytes_per_token(lm.config.get_text_config(), 4)
    budget = 2 * per_token * max(len(p[0]) + p[3] for p in prompts)
    prefill, _ = engines(lm, 512)
    decode = DecodeEngine(
        LMRunner(lm), DecodeSettings(max_batch_size=8, kv_cache_mb=budget / MIB), 10_000
    )
    reserved, waited, step = [], [], decode.step

    def watched_step():
        out = step()
        reserved.append(decode.scheduler.kv_reserved_bytes)
        waited.append(len(decode.scheduler.waiting))
        return out

    decode.step = watched_step
    got, _ = run_engines(prompts, [0] * len(prompts), prefill, decode)
    assert max(reserved) <= budget and max(waited) > 0, "the budget never made anyone wait"
    assert decode.scheduler.kv_reserved_bytes == 0 and decode.stats()["kv_reserved_bytes"] == 0
    for i, (token_ids, _, _, max_tokens) in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(
            hf_model, max_tokens, input_ids=torch.tensor([token_ids])
        ), f"prompt {i}"


def test_a_second_burst_reuses_the_batchs_buffers_and_stays_token_exact(lm, hf_model):
    """The batch keeps its buffers when it empties (within the KV budget), so the next burst
    allocates nothing; with 2 spare columns its window slides and grows often on the way.
    Both bursts return HF's tokens."""
    from actors.engine import kv

    rnd = random.Random(5)
    vocab = hf_model.config.text_config.vocab_size
    prompts = [
        (tuple(rnd.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n)), (), [], m)
        for n, m in ((40, 3), (4, 30), (9, 26), (6, 24))
    ]  # the long prompt leaves first: the window then slides into its columns
    arrivals = [0, 0, 1, 2]
    prefill, decode = engines(lm, 512)
    decode.batch = kv.BatchedKV(spare_slots=2, keep_when_empty=True)
    first, _ = run_engines(prompts, arrivals, prefill, decode)
    held, regrowths = decode.stats()["kv_buffer_bytes"], decode.stats()["kv_regrowths"]
    assert held > 0 and decode.stats()["kv_slides"] > 0, decode.stats()
    second, _ = run_engines(prompts, arrivals, prefill, decode)
    assert second == first
    assert decode.stats()["kv_regrowths"] == regrowths, "the second burst fit the kept buffers"
    for i, (token_ids, _, _, max_tokens) in enumerate(prompts):
        want = hf_greedy(hf_model, max_tokens, input_ids=torch.tensor([token_ids]))
        assert first[f"r{i}"] == want, f"prompt {i}"


def test_buffers_above_the_kv_budget_go_when_the_batch_empties(lm):
    prefill, _ = engines(lm, 512)
    decode = DecodeEngine(LMRunner(lm), DecodeSettings(max_batch_size=4, kv_cache_mb=1e-3), 10_000)
    prompts = [((50, 60, 70), (), [], 3)]
    run_engines(prompts, [0], prefill, decode, expect_batching=False)
    assert decode.stats()["kv_buffer_bytes"] == 0
