"""The decode step over fixed buffers (actors/engine/step_graphs.py), the body a CUDA graph
records. On CPU the same body runs eagerly: its tokens equal the eager step's and `generate`'s
under joins, departures, 3-D positions and buffer growth, reading the device once a step. The
captured graphs themselves need a GPU (marked `gpu`, skipped here)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from actors.engine import kv, step_graphs  # noqa: E402
from actors.engine.decode import DecodeEngine  # noqa: E402
from actors.engine.host_syncs import counting_syncs  # noqa: E402
from actors.engine.lm_runner import LMRunner  # noqa: E402
from actors.engine.step_graphs import FixedStep, bucket_sizes  # noqa: E402
from actors.models.adapter import Part, load_adapter  # noqa: E402
from actors.types import DecodeRequest, SamplingParams  # noqa: E402
from router.worker_settings import CudaGraphs, DecodeSettings  # noqa: E402

SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12)


def _runner(path, device: str = "cpu") -> LMRunner:
    return LMRunner(load_adapter(path, part=Part.LANGUAGE_MODEL, dtype="float32", device=device))


@pytest.fixture(scope="module")
def runner(ckpt):
    return _runner(ckpt)


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(1) == (1,)
    step = FixedStep.__new__(FixedStep)
    step.sizes = bucket_sizes(20)
    assert [step.bucket(n) for n in (1, 3, 5, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]


def _engine(
    runner: LMRunner, fixed: bool, max_batch_size: int = 6, spare_slots: int = 5
) -> DecodeEngine:
    """`fixed`: what a GPU worker gets from for_settings, without the capture; few spare
    columns, so that a run grows the slab more than once."""
    engine = DecodeEngine(runner, DecodeSettings(max_batch_size), max_model_len=512)
    if fixed:
        engine.fixed = FixedStep(runner.adapter, max_batch_size, capture=False)
        engine.batch = kv.BatchedKV(spare_slots, keep_when_empty=True)
    return engine


def _serve(engine: DecodeEngine, runner: LMRunner, params: list[SamplingParams]):
    """Prompts of mixed lengths joining over the first steps, each ending at its own
    max_tokens; every request's tokens, and the slabs the fixed step's buckets were built on."""
    rnd = random.Random(7)
    prompts = [tuple(rnd.randrange(3, 200) for _ in range(rnd.randint(3, 30))) for _ in params]
    tokens: dict[str, list[int]] = {}
    slabs, step = set(), 0
    while step < len(params) or engine.has_work:
        if step < len(params):
            first, packed, _ = runner.prefill(prompts[step], (), [], params[step])
            tokens[f"r{step}"] = [first.token_id]
            engine.add(
                DecodeRequest(f"r{step}", len(prompts[step]), first.token_id, params[step]), packed
            )
        for out in engine.step():
            tokens[out.request_id] += out.chunk.token_ids
        if engine.fixed and engine.batch._slab is not None:
            slabs.add(id(engine.batch._slab))
        step += 1
    assert engine.batch.num_rows == 0, "finished rows leaked"
    return tokens, slabs


def _mixed_params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in (14, 3, 9, 20, 6)]
    logprobs = SamplingParams(temperature=0.0, max_tokens=8, num_logprobs=2)
    return [*greedy[:2], SEEDED, *greedy[2:], logprobs]


def test_fixed_steps_give_the_eager_steps_tokens(runner):
    params = _mixed_params()
    eager, _ = _serve(_engine(runner, fixed=False), runner, params)
    fixed_engine = _engine(runner, fixed=True)
    fixed, slabs = _serve(fixed_engine, runner, params)
    assert fixed == eager
    assert len(slabs) >= 3, "the slab should have grown under the fixed step"
    assert set(fixed_engine.fixed._buckets) <= set(fixed_engine.fixed.sizes)


def test_fixed_steps_match_generate(runner, ckpt):
    from transformers import LlavaForConditionalGeneration

    from tests.unit.test_lm_runner import hf_greedy

    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    engine = _engine(runner, fixed=True)
    prompts = {"a": (5, 17, 80, 4), "b": tuple(range(20, 47)), "c": (9, 9, 30)}
    lengths = {"a": 10, "b": 4, "c": 16}
    for name, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=lengths[name])
        first, packed, _ = runner.prefill(prompt, (), [], params)
        engine.add(DecodeRequest(name, len(prompt), first.token_id, params), packed)
        prompts[name] = (prompt, [first.token_id])
    while engine.has_work:
        for out in engine.step():
            prompts[out.request_id][1].extend(out.chunk.token_ids)
    for name, (prompt, got) in prompts.items():
        assert got == hf_greedy(model, lengths[name], input_ids=torch.tensor([prompt])), name


def test_a_fixed_step_reads_the_device_once(runner):
    engine = _engine(runner, fixed=True)
    for i, n in enumerate((4, 13, 7)):
        params = SamplingParams(temperature=0.0, max_tokens=8)
        first, packed, _ = runner.prefill(tuple(range(3, 3 + n)), (), [], params)
        engine.add(DecodeRequest(f"r{i}", n, first.token_id, params), packed)
    counts = []
    while engine.has_work:
        with counting_syncs() as seen:
            engine.step()
        counts.append(sum(seen.values()))
    assert max(counts) == 1, counts


def _one_request(engine: DecodeEngine, runner: LMRunner, name: str, max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first, packed, _ = runner.prefill((7, 8, 9, 10), (), [], params)
    engine.add(DecodeRequest(name, 4, first.token_id, params), packed)
    while engine.has_work:
        engine.step()


def test_an_emptied_batch_keeps_its_slab_and_its_buckets(runner):
    """Graphs hold the slab's memory: a request after an idle spell reuses them."""
    engine = _engine(runner, fixed=True, spare_slots=64)
    _one_request(engine, runner, "first", 5)
    slab, buckets = engine.batch._slab, dict(engine.fixed._buckets)
    assert engine.batch.num_rows == 0 and engine.stats()["rows"] == 0
    _one_request(engine, runner, "second", 5)
    assert engine.batch._slab is slab
    assert all(engine.fixed._buckets[size] is b for size, b in buckets.items())


@pytest.mark.parametrize("fixture", ["ckpt", "qwen_vl_ckpt", "omni_ckpt"])
def test_the_recorded_body_makes_no_host_sync(request, fixture):
    """What a graph records must not read the device (a capture would fail there): the
    body alone, counted on CPU, for each family with full-window attention."""
    family_runner = _runner(request.getfixturevalue(fixture))
    engine = _engine(family_runner, fixed=True)
    _one_request(engine, family_runner, "warm", 3)  # builds a bucket on the slab
    (bucket,) = engine.fixed._buckets.values()
    with torch.inference_mode(), counting_syncs() as seen:
        engine.fixed._body(bucket)
    assert sum(seen.values()) == 0, dict(seen)


def test_qwen_vl_rows_with_their_own_rope_deltas_match_generate(qwen_vl_ckpt):
    """3-D positions: each row's position is its length plus its own rope delta."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.unit.test_families import generate_batched
    from tests.unit.test_vl_families import QWEN_VL_CASES, _family

    family = _family(Qwen2_5_VLForConditionalGeneration, qwen_vl_ckpt)
    cases = [QWEN_VL_CASES[name]() for name in sorted(QWEN_VL_CASES)]
    fixed = FixedStep(family[4].adapter, len(cases) + 3, capture=False)  # a bucket above them
    got, want, deltas = generate_batched(family, cases, 6, fixed=fixed)
    assert len(set(deltas)) > 2
    assert got == want


def test_graphs_are_refused_by_name_where_they_cannot_run(runner, llava_next_ckpt):
    on = DecodeSettings(max_batch_size=4, cuda_graphs=CudaGraphs.ON)
    auto = DecodeSettings(max_batch_size=4, cuda_graphs=CudaGraphs.AUTO)
    with pytest.raises(ValueError, match="CUDA device"):
        step_graphs.for_settings(runner.adapter, on)
    assert step_graphs.for_settings(runner.adapter, auto) is None  # CPU: eager
    sliding = _runner(llava_next_ckpt).adapter
    with pytest.raises(ValueError, match="sliding-window"):
        FixedStep(sliding, 4, capture=False)


def test_the_config_refuses_graphs_on_without_a_gpu():
    from cluster.config import ClusterConfig

    model = {"checkpoint": "tiny-llava", "served_name": "tiny-llava"}
    with pytest.raises(ValueError, match="cuda_graphs: on needs model.device: cuda"):
        ClusterConfig.model_validate({"model": model, "decode": {"cuda_graphs": "on"}})
    assert ClusterConfig.model_validate({"model": model}).decode.cuda_graphs is CudaGraphs.AUTO


# -- on a GPU: the captured graphs --------------------------------------------------------------

gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (what a GPU run checks: docs/GPU_CHECKS.md)",
)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fixture", ["ckpt", "qwen_vl_ckpt"])
def test_captured_graphs_replay_the_eager_tokens_on_a_gpu(request, fixture):
    """Graphs captured per bucket and replayed, rows joining and leaving and the slab growing:
    the same tokens as eager steps on the same GPU, one device read a step, no failed capture."""
    gpu_runner = _runner(request.getfixturevalue(fixture), "cuda")
    params = _mixed_params()
    eager, _ = _serve(_engine(gpu_runner, fixed=False), gpu_runner, params)
    engine = DecodeEngine(
        gpu_runner,
        DecodeSettings(6, cuda_graphs=CudaGraphs.ON),
        max_model_len=512,
    )
    engine.batch = kv.BatchedKV(5, keep_when_empty=True)
    graphed, _ = _serve(engine, gpu_runner, params)
    stats = engine.stats()
    assert graphed == eager
    assert stats["cuda_graphs"] == 1 and not stats["graph_capture_failed"]
    assert stats["graph_replays"] > stats["graph_captures"] > 1
