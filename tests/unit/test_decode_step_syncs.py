"""A decode step reads the device once (its sampled tokens), whatever the batch does: rows
of different lengths, rows joining, rows finishing and leaving. Counted on CPU with the
dispatch counter (actors/engine/host_syncs.py), as a GPU's sync debug mode would see it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from actors.engine.decode import DecodeEngine  # noqa: E402
from actors.engine.host_syncs import counting_syncs  # noqa: E402
from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from actors.types import DecodeRequest, SamplingParams  # noqa: E402
from router.worker_settings import DecodeSettings  # noqa: E402


@pytest.fixture(scope="module")
def runner(ckpt):
    return LMRunner(load_adapter(ckpt, part=Part.LANGUAGE_MODEL, dtype="float32", device="cpu"))


def _add(engine: DecodeEngine, runner: LMRunner, name: str, prompt_len: int, params) -> None:
    first, packed, _ = runner.prefill(tuple(range(3, 3 + prompt_len)), (), [], params)
    engine.add(DecodeRequest(name, prompt_len, first.token_id, params), packed)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=6, num_logprobs=3, repetition_penalty=1.2),
    ],
    ids=["greedy", "seeded", "logprobs_penalties"],
)
def test_each_step_reads_the_device_once(runner, params):
    engine = DecodeEngine(runner, DecodeSettings(max_batch_size=8), max_model_len=256)
    for i, n in enumerate((5, 11, 8)):
        _add(engine, runner, f"a{i}", n, params)
    counts_per_step, tokens = [], 0
    for step in range(12):
        if step == 2:  # rows join mid-stream, longer than the others
            _add(engine, runner, "late", 17, params)
        with counting_syncs() as counts:
            outputs = engine.step()
        counts_per_step.append(sum(counts.values()))
        tokens += sum(len(o.chunk.token_ids) for o in outputs)
        if not engine.has_work:
            break
    assert tokens == 4 * (params.max_tokens - 1)  # every row ran to its end and left
    assert engine.batch.num_rows == 0
    assert max(counts_per_step) == 1, counts_per_step
