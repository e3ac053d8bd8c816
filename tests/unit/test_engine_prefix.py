"""The prefill engine's prefix cache on the tiny checkpoint (no Ray): greedy output stays
token-exact against HF `generate` with the cache cold and warm, with block and chunk
boundaries inside and beside an image's placeholder span, and two images behind equal
token ids never share KV."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402

from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.prefill import PrefillEngine  # noqa: E402
from actors.types import MediaItem, PrefillRequest  # noqa: E402
from router.types import Modality  # noqa: E402
from router.worker_settings import MIB, PrefillSettings  # noqa: E402
from tests.unit.test_lm_runner import (
    GREEDY,
    encoder,  # noqa: F401 (a fixture)
    engines,
    hf_greedy,
    hf_model,  # noqa: F401 (a fixture)
    lm,  # noqa: F401 (a fixture)
    placeholder_ranges,
    processor,  # noqa: F401 (a fixture)
    run_engines,
)

BIG_CACHE_MB = 1024


def image_prompt(processor, image_token_id: int, array: np.ndarray, question: str):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[Image.fromarray(array)], return_tensors="pt")
    token_ids = inputs["input_ids"][0].tolist()
    return token_ids, placeholder_ranges(token_ids, image_token_id), inputs


@pytest.mark.parametrize(
    "prefix_block_tokens,max_chunk_tokens,cache_blocks",
    [(4, 7, None), (5, 512, None), (16, 16, None), (4, 7, 6)],
)
def test_warm_prefix_matches_generate(
    lm, encoder, hf_model, processor, prefix_block_tokens, max_chunk_tokens, cache_blocks
):
    """Turn 2 repeats turn 1's prompt and image and adds text; turn 3 repeats turn 1 exactly.
    `cache_blocks`: a budget of that many blocks, so eviction runs while prefixes are in use."""
    array = np.random.default_rng(1).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    token_ids, ranges, inputs = image_prompt(
        processor, hf_model.config.image_token_id, array, "What is in this image?"
    )
    [emb] = encoder.encode([MediaItem(Modality.IMAGE, "a", data=array)])
    follow_up = token_ids + [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    prompts = [
        (tuple(token_ids), ranges, [emb], 6),
        (tuple(follow_up), ranges, [emb], 6),
        (tuple(token_ids), ranges, [emb], 6),
    ]
    cfg = lm.config.text_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * prefix_block_tokens * 4
    )  # float32
    cache = BIG_CACHE_MB * MIB if cache_blocks is None else cache_blocks * block_bytes
    prefill, decode = engines(lm, max_chunk_tokens, cache / MIB, prefix_block_tokens)
    got, cached = run_engines(
        prompts, [0, 60, 120], prefill, decode, [("id-a",)] * 3, expect_batching=False
    )

    for i, (ids, _, _, max_tokens) in enumerate(prompts):
        want = hf_greedy(
            hf_model, max_tokens, input_ids=torch.tensor([ids]), pixel_values=inputs["pixel_values"]
        )
        assert got[f"r{i}"] == want, f"turn {i + 1}"
    assert cached["r0"] == 0
    if cache_blocks is None:
        full = (len(token_ids) // prefix_block_tokens) * prefix_block_tokens
        assert cached["r1"] == full > ranges[0].offset + ranges[0].length, (
            "turn 2 reuses turn 1's blocks, image included"
        )
        assert (
            cached["r2"] == ((len(token_ids) - 1) // prefix_block_tokens) * prefix_block_tokens
        ), "a full hit still computes the last token"
    else:
        assert prefill.pool.stats.evictions > 0 and prefill.pool.num_bytes <= cache
    assert prefill.stats()["prefix_hit_blocks"] == sum(cached.values()) // prefix_block_tokens


def test_equal_token_ids_different_images_never_share_kv(lm, encoder, hf_model, processor):
    """Same-size images give identical token ids; only the media identifier in the block
    hash tells them apart. Dropping it would let image B reuse image A's KV."""
    arrays = [np.array(Image.new("RGB", (32, 32), color)) for color in ((255, 0, 0), (0, 0, 255))]
    prompts = [image_prompt(processor, hf_model.config.image_token_id, a, "What?") for a in arrays]
    assert prompts[0][0] == prompts[1][0], "the test needs equal token ids"
    token_ids, ranges, _ = prompts[0]
    embs = [
        encoder.encode([MediaItem(Modality.IMAGE, f"img{i}", data=a)])[0]
        for i, a in enumerate(arrays)
    ]

    def prefill_once(engine, name, emb, identifier):
        engine.add(
            PrefillRequest(name, tuple(token_ids), ranges, GREEDY, media_identifiers=(identifier,)),
            [emb],
        )
        while not (outs := engine.step()):
            pass
        return outs[0]

    warm = PrefillEngine(
        LMRunner(lm), PrefillSettings(8, prefix_block_tokens=4, prefix_cache_mb=BIG_CACHE_MB)
    )
    a = prefill_once(warm, "a", embs[0], "id-red")
    b = prefill_once(warm, "b", embs[1], "id-blue")
    cold = PrefillEngine(LMRunner(lm), PrefillSettings(8, prefix_block_tokens=4))
    cold_b = prefill_once(cold, "b", embs[1], "id-blue")
    warm.pool.check_integrity()
    assert 0 < b.num_cached_tokens <= ranges[0].offset, (
        "only the text before the image may be shared"
    )
    torch.testing.assert_close(b.packed_kv, cold_b.packed_kv, rtol=1e-5, atol=1e-5)
    image_end = ranges[0].offset + ranges[0].length
    assert not torch.allclose(a.packed_kv[..., :image_end, :], b.packed_kv[..., :image_end, :])
    want = hf_greedy(
        hf_model,
        1,
        **processor(
            text=processor.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "text", "text": "What?"}],
                    }
                ],
                add_generation_prompt=True,
            ),
            images=[Image.fromarray(arrays[1])],
            return_tensors="pt",
        ),
    )
    assert [b.first.token_id] == want
