"""Unit tests for router/cost_model.py: each TTFT term by hand, cache hits, prefixes,
calibration."""

from __future__ import annotations

import math
import random

import pytest

from router.calibration import CalibrationConfig, LinearCost, OnlineLinear
from router.cost_model import CostModel, CostPriors
from router.prefill_wait import shortest_first_wait_ms
from router.types import MediaJob, Placement, RequestProfile, WorkerInfo, WorkerKind
from router.view import ClusterView

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
IMG = frozenset({"image"})

# Round numbers so every term can be checked by hand.
PRIORS = CostPriors(
    encode={"image": LinearCost(2.0, 10.0)},
    prefill_tokens_per_ms=10.0,
    prefill_fixed_ms=1.0,
    bandwidth_gbps={
        Placement.SAME_PROCESS: 4.0,
        Placement.SAME_NODE: 1.0,
        Placement.CROSS_NODE: 0.5,
    },
)
A = MediaJob("img-a", "image", 0.5, 100, 1_000_000)  # 2 + 5 = 7 ms
B = MediaJob("img-b", "image", 1.0, 100, 1_000_000)  # 2 + 10 = 12 ms
HASHES = tuple(f"h{i}" for i in range(10))
REQUEST = RequestProfile(1000, (A, B), HASHES, block_size=16)


def setup() -> tuple[ClusterView, CostModel]:
    """Encoder 0 and prefill 0 on node a, encoder 1 and prefill 1 on node b."""
    workers = [
        WorkerInfo(E, 0, "a", IMG),
        WorkerInfo(E, 1, "b", IMG),
        WorkerInfo(P, 0, "a"),
        WorkerInfo(P, 1, "b"),
        WorkerInfo(D, 0, "a"),
    ]
    view = ClusterView(workers)
    view.refresh(0.0)
    return view, CostModel.for_view(PRIORS, view)


def test_default_priors_reproduce_the_seed_table():
    cost = CostModel(num_encoders=1, num_prefill=1)
    assert cost.encode_ms(0, "image", 0.113) == pytest.approx(5.0, abs=0.1)  # 336x336, ViT-L/14
    assert cost.encode_ms(0, "video", 30) == pytest.approx(48.0, abs=0.5)  # 10 s @ 3 fps
    assert cost.encode_ms(0, "audio", 30) == pytest.approx(85.0, abs=0.5)  # 30 s, Whisper-small
    assert (
        cost.encode_ms(0, "hologram", 1) == CostPriors().unknown_modality.fixed_ms
    )  # unknown: a flat guess, not a crash


def test_every_term_by_hand():
    view, cost = setup()
    view.begin(E, 0, 1, ms=7.0)
    view.begin(P, 0, 1, ms=30.0)
    view.prefix_cache.publish(
        0, frozenset(HASHES[:3]), 0.0
    )  # prefill 0 holds 3 leading blocks = 48 tokens
    est, misses, uncached = cost.evaluate(REQUEST, view, 0, 0)
    assert est.encoder_queue_ms == 7.0
    assert est.encode_ms == pytest.approx(19.0)  # 7 + 12
    assert est.transfer_ms == pytest.approx(2.0)  # 2 MB over 1 GB/s (same node)
    assert est.prefill_queue_ms == 30.0
    assert uncached == 1000 - 48
    assert est.prefill_ms == pytest.approx(1.0 + 952 / 10)
    assert est.total_ms == pytest.approx(7 + 19 + 2 + 30 + 96.2)
    assert misses == (A, B)
    # encoder 1 (node b) to prefill 1 (node b): idle, uncached; to prefill 0 (node a): the
    # transfer doubles
    est = cost.evaluate(REQUEST, view, 1, 1)[0]
    assert (est.encoder_queue_ms, est.transfer_ms, est.prefill_queue_ms, est.prefill_ms) == (
        0.0,
        pytest.approx(2.0),
        0.0,
        pytest.approx(101.0),
    )
    assert cost.evaluate(REQUEST, view, 1, 0)[0].transfer_ms == pytest.approx(
        4.0
    )  # 0.5 GB/s cross-node
    assert (
        view.placement(1, 0) is Placement.CROSS_NODE and view.placement(0, 0) is Placement.SAME_NODE
    )


def test_text_only_has_no_encoder_terms():
    view, cost = setup()
    est, misses, uncached = cost.evaluate(RequestProfile(500), view, None, 1)
    assert (est.encoder_queue_ms, est.encode_ms, est.transfer_ms) == (0.0, 0.0, 0.0)
    assert est.total_ms == pytest.approx(1.0 + 50.0) and uncached == 500 and misses == ()


def test_cache_hits_zero_the_encode_term():
    view, cost = setup()
    view.begin(E, 0, 1, ms=7.0)
    view.encoder_cache.publish(0, frozenset({"img-b"}), 0.0)
    est, misses, _ = cost.evaluate(REQUEST, view, 0, 0)
    assert est.encode_ms == pytest.approx(7.0) and misses == (A,) and est.encoder_queue_ms == 7.0
    view.encoder_cache.publish(0, frozenset({"img-a", "img-b"}), 0.0)
    est, misses, _ = cost.evaluate(REQUEST, view, 0, 0)
    # all hits: no encoding and no queue (the encoder answers hits before batching); embeddings
    # still move
    assert (est.encode_ms, est.encoder_queue_ms, misses) == (0.0, 0.0, ())
    assert est.transfer_ms == pytest.approx(2.0)
    assert cost.evaluate(REQUEST, view, 1, 0)[0].encode_ms == pytest.approx(
        19.0
    )  # the other encoder holds nothing


def test_an_identifier_twice_in_one_request_is_encoded_once():
    view, cost = setup()
    est = cost.evaluate(RequestProfile(100, (A, A)), view, 0, 0)[0]
    assert est.encode_ms == pytest.approx(7.0) and est.transfer_ms == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("held", "blocks"),
    [
        (HASHES[:3], 3),
        (HASHES, 10),
        ((), 0),
        (HASHES[1:], 0),  # a hole at the start matches nothing
        (HASHES[:2] + HASHES[3:], 2),  # a hole in the middle ends the run
    ],
)
def test_longest_leading_run_of_prefix_blocks(held, blocks):
    view, cost = setup()
    view.prefix_cache.publish(1, frozenset(held), 0.0)
    assert view.prefix_blocks(1, HASHES) == blocks
    assert view.prefix_matches(HASHES).get(1, 0) == blocks
    assert cost.evaluate(REQUEST, view, None, 1)[2] == 1000 - 16 * blocks


def test_cached_blocks_beyond_the_prompt_leave_nothing_negative():
    view, cost = setup()
    view.prefix_cache.publish(0, frozenset(HASHES), 0.0)
    profile = RequestProfile(100, prefix_hashes=HASHES, block_size=16)  # 160 tokens of blocks > 100
    est, _, uncached = cost.evaluate(profile, view, None, 0)
    assert uncached == 0 and est.prefill_ms == pytest.approx(1.0)


def test_fast_paths_agree_with_the_pair_estimate():
    rng = random.Random(3)
    view, cost = setup()
    view.encoder_cache.publish(1, frozenset({"img-a"}), 0.0)
    view.prefix_cache.publish(1, frozenset(HASHES[:4]), 0.0)
    for i in range(2):
        view.begin(E, i, 1, ms=rng.uniform(0, 50))
        view.begin(P, i, 1, ms=rng.uniform(0, 50))
    enc, pre = cost.encoder_costs(REQUEST, view), cost.prefill_costs(REQUEST, view)
    for e in range(2):
        for p in range(2):
            est = cost.evaluate(REQUEST, view, e, p)[0]
            assert enc[e] == pytest.approx(est.encoder_queue_ms + est.encode_ms)
            assert pre[p] == pytest.approx(est.prefill_queue_ms + est.prefill_ms)


# -- calibration -------------------------------------------------------------------------------


def test_calibration_moves_the_estimate_toward_observations():
    cost = CostModel(PRIORS, num_encoders=2, num_prefill=2)
    before = cost.encode_ms(0, "image", 0.5)
    for _ in range(5):
        cost.observe_encode(0, "image", 0.5, 3 * before)
    assert before < cost.encode_ms(0, "image", 0.5) <= 3 * before
    # the pool curve moved: the other encoder's estimate follows, the observed one's a little more
    assert before < cost.encode_ms(1, "image", 0.5) < cost.encode_ms(0, "image", 0.5)
    for _ in range(5):
        cost.observe_prefill(1, 1000, 500.0)  # prior: 101 ms
    assert cost.prefill_ms(1, 1000) > 300 and cost.prefill_ms(0, 1000) > 250


def _drive(
    cost: CostModel,
    rng: random.Random,
    workers: list[int],
    slowness: list[float],
    rounds: int,
    host: float = 1.0,
    sigma: float = 0.3,
) -> None:
    """Prefill observations on `workers` (each `slowness` x the truth, x `host`, x lognormal
    noise)."""
    for _ in range(rounds):
        for p in workers:
            tokens = rng.randint(200, 3000)
            cost.observe_prefill(
                p, tokens, host * slowness[p] * (5 + tokens / 8) * math.exp(rng.gauss(0, sigma))
            )


def test_a_burst_moves_the_pool_curve_not_one_workers_estimate():
    cost, rng = CostModel(PRIORS, num_encoders=1, num_prefill=4), random.Random(1)
    _drive(cost, rng, [0, 1, 2, 3], [1.0] * 4, rounds=60, sigma=0.05)
    steady = [cost.prefill_ms(p, 1000) for p in range(4)]
    _drive(
        cost, rng, [0], [1.0] * 4, rounds=20, host=3.0, sigma=0.05
    )  # the host slows 3x while only worker 0 runs
    burst = [cost.prefill_ms(p, 1000) for p in range(4)]
    assert all(
        b > 2.0 * s for b, s in zip(burst, steady)
    )  # every worker's estimate follows the host
    times = cost.relative_times(P)
    assert times[0] < 1.35 and math.prod(times) == pytest.approx(
        1.0
    )  # worker 0 is not blamed for it
    _drive(cost, rng, [0, 1, 2, 3], [1.0] * 4, rounds=10, sigma=0.05)  # the burst is over
    assert all(cost.prefill_ms(p, 1000) == pytest.approx(s, rel=0.35) for p, s in enumerate(steady))


def test_equal_workers_estimates_converge_and_a_slow_one_is_told_apart():
    cost, rng = CostModel(PRIORS, num_encoders=1, num_prefill=8), random.Random(2)
    slowness = [1.0] * 7 + [4.0]
    for _ in range(300):  # noisy timings, workers in random order and unequal numbers
        _drive(cost, rng, [rng.randrange(8)], slowness, rounds=1, sigma=0.3)
    equal = [cost.prefill_ms(p, 1000) for p in range(7)]
    assert (
        max(equal) / min(equal) < 1.35
    )  # per-worker fits of the same data disagreed by up to 1.8x
    assert cost.prefill_ms(7, 1000) / (sum(equal) / 7) == pytest.approx(4.0, rel=0.3)


def test_a_stale_slow_estimate_heals():
    cost, rng = CostModel(PRIORS, num_encoders=1, num_prefill=4), random.Random(3)
    _drive(
        cost, rng, [0, 1, 2, 3], [4.0, 1.0, 1.0, 1.0], rounds=80, sigma=0.05
    )  # worker 0 was slow (a burst of its own)
    assert cost.relative_times(P)[0] > 2.5
    _drive(cost, rng, [1, 2, 3], [1.0] * 4, rounds=120, sigma=0.05)  # the router then avoids it
    times = cost.relative_times(P)
    assert times[0] < 1.3 and cost.prefill_ms(0, 1000) / cost.prefill_ms(1, 1000) < 1.3


def test_encoders_share_relative_times_across_modalities():
    cost, rng = CostModel(PRIORS, num_encoders=2, num_prefill=1), random.Random(4)
    for _ in range(200):
        size = rng.uniform(0.1, 2.0)
        for e, slow in ((0, 1.0), (1, 2.0)):
            cost.observe_encode(e, "image", size, slow * (3 + 20 * size))
    assert cost.encode_ms(1, "image", 1.0) / cost.encode_ms(0, "image", 1.0) == pytest.approx(
        2.0, rel=0.15
    )
    assert cost.encode_ms(1, "audio", 30) / cost.encode_ms(0, "audio", 30) == pytest.approx(
        2.0, rel=0.15
    )  # never seen


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("pool_memory", 0),
        ("error_memory", 0.5),
        ("speed_rate", 0),
        ("speed_rate", 1.5),
        ("heal_rounds", -1),
        ("spread_z", -1),
        ("max_relative", 1.0),
        ("pool_memory", math.nan),
    ],
)
def test_a_calibration_that_cannot_hold_is_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=setting):
        CalibrationConfig.from_dict({setting: value})
    with pytest.raises(ValueError, match="pool_mem"):
        CalibrationConfig.from_dict({"pool_mem": 3})


@pytest.mark.parametrize("vary_sizes", [True, False])
def test_a_2x_slower_worker_is_estimated_2x_slower(vary_sizes):
    cost = CostModel(PRIORS, num_encoders=2, num_prefill=2)
    rng = random.Random(0)
    truth = LinearCost(3.0, 20.0)  # neither worker matches the prior
    for _ in range(60):  # relative times are learned slowly (CalibrationConfig.speed_rate)
        size = rng.uniform(0.1, 2.0) if vary_sizes else 0.5
        cost.observe_encode(0, "image", size, truth.fixed_ms + truth.per_unit_ms * size)
        cost.observe_encode(1, "image", size, 2 * (truth.fixed_ms + truth.per_unit_ms * size))
        tokens = rng.randint(10, 4000) if vary_sizes else 1000
        cost.observe_prefill(0, tokens, 5 + tokens / 8)
        cost.observe_prefill(1, tokens, 2 * (5 + tokens / 8))
    probe = [0.5] if not vary_sizes else [0.2, 0.5, 1.5]
    for size in probe:
        fast, slow = cost.encode_ms(0, "image", size), cost.encode_ms(1, "image", size)
        assert slow / fast == pytest.approx(2.0, rel=0.1)
        assert fast == pytest.approx(truth.fixed_ms + truth.per_unit_ms * size, rel=0.1)
    tokens = 1000
    assert cost.prefill_ms(1, tokens) / cost.prefill_ms(0, tokens) == pytest.approx(2.0, rel=0.1)


def test_fits_never_go_negative_or_nan():
    fit = OnlineLinear(LinearCost(2.0, 10.0))
    rng = random.Random(1)
    garbage = [
        (math.nan, 5.0),
        (1.0, math.nan),
        (1.0, math.inf),
        (-1.0, 5.0),
        (1.0, -5.0),
        (0.0, 0.0),
        (1e12, 1e-9),
    ]
    for _ in range(200):
        x, y = (
            rng.choice(garbage) if rng.random() < 0.3 else (rng.uniform(0, 3), rng.uniform(0, 100))
        )
        fit.observe(x, y)
        for probe in (0.0, 0.01, 1.0, 1e6):
            value = fit.predict(probe)
            assert math.isfinite(value) and value >= 0
        assert fit.a >= 0 and fit.b >= 0


def test_decreasing_observations_never_give_a_negative_slope():
    fit = OnlineLinear(LinearCost(2.0, 10.0))
    for size in (0.1, 0.5, 1.0, 2.0, 3.0) * 4:
        fit.observe(size, 40.0 - 10 * size)  # bigger is faster: nonsense, must not give b < 0
    assert fit.b >= 0 and fit.a >= 0 and all(fit.predict(x) >= 0 for x in (0, 1, 100))


def test_transfer_calibration_and_monotone_placements():
    cost = CostModel(PRIORS)
    assert cost.transfer_ms(Placement.CROSS_NODE, 2_000_000) == pytest.approx(4.0)
    for _ in range(10):
        cost.observe_transfer(Placement.CROSS_NODE, 2_000_000, 40.0)
    assert cost.transfer_ms(Placement.CROSS_NODE, 2_000_000) > 20
    for _ in range(
        10
    ):  # a same-node link measured slower than cross-node is still priced no higher
        cost.observe_transfer(Placement.SAME_NODE, 2_000_000, 400.0)
    t = cost.transfers(2_000_000)
    assert t[Placement.SAME_PROCESS] <= t[Placement.SAME_NODE] <= t[Placement.CROSS_NODE]


def test_priors_from_dict():
    priors = CostPriors.from_dict(
        {
            "encode": {"image": {"fixed_ms": 1, "per_unit_ms": 2}, "depth": {"fixed_ms": 9}},
            "prefill_tokens_per_ms": 5,
            "bandwidth_gbps": {"cross_node": 10},
        }
    )
    assert priors.encode["image"] == LinearCost(1.0, 2.0) and priors.encode["depth"] == LinearCost(
        9.0, 0.0
    )
    assert priors.encode["video"] == CostPriors().encode["video"]  # the rest keep their defaults
    assert (
        priors.prefill_tokens_per_ms == 5.0 and priors.bandwidth_gbps[Placement.CROSS_NODE] == 10.0
    )
    assert (
        priors.bandwidth_gbps[Placement.SAME_NODE]
        == CostPriors().bandwidth_gbps[Placement.SAME_NODE]
    )
    assert CostPriors.from_dict({}) == CostPriors()
    with pytest.raises(ValueError, match="prefill_tokens_per_sec"):
        CostPriors.from_dict({"prefill_tokens_per_sec": 1})
    with pytest.raises(ValueError, match="prefill_tokens_per_ms"):
        CostPriors.from_dict({"prefill_tokens_per_ms": 0})
    with pytest.raises(ValueError, match="fixed_ms"):
        CostPriors.from_dict({"encode": {"image": {"fixed_ms": -1}}})
    with pytest.raises(ValueError):
        CostPriors.from_dict({"bandwidth_gbps": {"same_rack": 5}})


def test_lazy_fit_equals_a_fit_after_every_observation():
    rng = random.Random(5)
    eager, lazy = OnlineLinear(LinearCost(2.0, 10.0)), OnlineLinear(LinearCost(2.0, 10.0))
    for _ in range(60):
        x = rng.choice([0.5, 0.5, rng.uniform(0, 3)])
        y = 2 + 11 * x + rng.uniform(-1, 1)
        eager.observe(x, y)
        lazy.observe(x, y)
        eager.coefficients()  # refit now; `lazy` only when read below
    assert lazy.coefficients() == eager.coefficients() and (lazy.a, lazy.b) == eager.coefficients()
    cost = CostModel(PRIORS, num_encoders=1, num_prefill=1)
    cost.observe_prefill(0, 1000, 500.0)
    assert (
        cost.prefill_ms(0, 1000) == cost.prefill_fit.curve.predict(1000) > 101
    )  # the flat copy follows the fit


def test_prefill_queue_credits_the_job_in_service():
    view, cost = setup()
    text = RequestProfile(1000)  # 1 + 1000/10 = 101 ms of prefill
    from router.types import RouteDecision

    est = cost.evaluate(text, view, None, 0)[0]
    view.begin_route(RouteDecision(None, 0, 0, est), 0)  # idle worker: starts at once (no encoding)
    view.refresh(0.040)
    assert cost.prefill_queue_ms(view, 0) == pytest.approx(101.0 - 40.0)  # 40 ms of it done
    second = RouteDecision(None, 0, 0, est)
    view.begin_route(second, 0)  # queued behind it
    assert cost.prefill_queue_ms(view, 0) == pytest.approx(202.0 - 40.0)
    view.refresh(0.500)  # the first overran its estimate: still all of the second ahead
    assert cost.prefill_queue_ms(view, 0) == pytest.approx(101.0)
    view.end(P, 0, 1, 101.0)  # the first is done at 0.5 s: the second starts
    view.refresh(0.510)
    assert cost.prefill_queue_ms(view, 0) == pytest.approx(101.0 - 10.0)
    assert cost.prefill_costs(text, view)[0] == pytest.approx(91.0 + 101.0)
    assert cost.evaluate(text, view, None, 0)[0].prefill_queue_ms == cost.prefill_queue_ms(view, 0)
    view.end(P, 0, 1, 101.0)
    assert cost.prefill_queue_ms(view, 0) == 0.0 and view.service_started_ms[0] == math.inf
    # a media request booked on an idle worker starts once its embeddings are in
    media = cost.evaluate(REQUEST, view, 1, 1)[0]
    view.refresh(1.0)
    view.begin_route(RouteDecision(1, 1, 0, media), 2)
    ahead = media.encoder_queue_ms + media.encode_ms + media.transfer_ms
    view.refresh(1.0 + ahead / 2e3)
    assert cost.prefill_queue_ms(view, 1) == pytest.approx(media.prefill_ms)  # not started yet
    view.refresh(1.0 + (ahead + 5.0) / 1e3)
    assert cost.prefill_queue_ms(view, 1) == pytest.approx(media.prefill_ms - 5.0)


def test_shortest_first_wait_counts_shorter_prompts_and_one_chunk_of_a_longer():
    assert shortest_first_wait_ms([], 50.0, 30.0) == 0.0
    assert shortest_first_wait_ms([20.0, 50.0], 50.0, 30.0) == 70.0  # ties came first
    assert shortest_first_wait_ms([20.0, 2000.0], 50.0, 30.0) == 50.0
    assert shortest_first_wait_ms([2000.0, 3000.0], 50.0, 0.0) == 0.0  # none in service


@pytest.mark.parametrize("chunk_tokens", [0, 128])
def test_a_text_prompt_goes_to_the_worker_whose_video_is_still_encoding(chunk_tokens):
    """Worker 0 serves a video's prefill (started 0.5 s ago, 1.5 s left), worker 1 holds one
    still being encoded. First come first served, worker 0 had less left; by shortest first
    (chunked) a text prompt waits one chunk at worker 0 and nothing at worker 1."""
    view, _ = setup()
    cost = CostModel.for_view(PRIORS, view, prefill_chunk_tokens=chunk_tokens)
    from router.types import RouteDecision, TTFTEstimate

    video = TTFTEstimate.of(0.0, 500.0, 1.0, 0.0, 2000.0)
    view.begin_route(RouteDecision(0, 0, 0, video), 1)  # embeddings in at 0.501 s
    view.refresh(1.0)
    view.begin_route(RouteDecision(1, 1, 0, video), 1)  # embeddings in at 1.501 s
    text = RequestProfile(100)  # 1 + 100/10 = 11 ms of prefill
    costs = cost.prefill_costs(text, view)
    if not chunk_tokens:
        assert costs == pytest.approx([2000.0 - 499.0 + 11.0, 2000.0 + 11.0])
        return
    chunk_ms = 1.0 + 128 / 10
    assert costs == pytest.approx([chunk_ms + 11.0, 11.0])
    for p in range(2):  # the decision's own estimate says the same
        est = cost.evaluate(text, view, None, p)[0]
        assert est.prefill_queue_ms + est.prefill_ms == pytest.approx(costs[p])
    view.end(P, 1, 1, 2000.0)
    assert view.prefill_jobs_ms == [[2000.0], []]


def test_a_rarely_probed_slow_worker_keeps_its_estimate():
    """Joint avoids a 4x worker, so healing re-probes it only now and then: each probe that finds
    it still slow must restore what was learned, not start from the healed estimate."""
    cost, rng = CostModel(PRIORS, num_encoders=1, num_prefill=4), random.Random(5)
    slowness = [4.0, 1.0, 1.0, 1.0]
    _drive(cost, rng, [0, 1, 2, 3], slowness, rounds=80, sigma=0.1)
    for _ in range(15):  # a probe of worker 0 after each long stretch on the others
        _drive(cost, rng, [1, 2, 3], slowness, rounds=60, sigma=0.1)
        _drive(cost, rng, [0], slowness, rounds=1, sigma=0.1)
    assert cost.relative_times(P)[0] / cost.relative_times(P)[1] > 3.2


@pytest.mark.parametrize("num_tokens", [100, 300])
def test_where_workers_preempt_a_prompt_that_fits_a_chunk_skips_the_one_in_service(num_tokens):
    """Workers that run a short prompt between a chunk's layers (actors/engine/preempt.py): a
    100-token prompt (one 128-token chunk) waits nothing at the worker serving a video; a
    300-token one still waits a chunk there (it does not jump)."""
    view, _ = setup()
    cost = CostModel.for_view(PRIORS, view, prefill_chunk_tokens=128, prefill_preempts=True)
    from router.types import RouteDecision, TTFTEstimate

    video = TTFTEstimate.of(0.0, 500.0, 1.0, 0.0, 2000.0)
    view.begin_route(RouteDecision(0, 0, 0, video), 1)  # its chunks run from 0.501 s
    view.refresh(1.0)
    prompt = RequestProfile(num_tokens)
    own_ms, chunk_ms = 1.0 + num_tokens / 10, 1.0 + 128 / 10
    wait_ms = 0.0 if num_tokens <= 128 else chunk_ms
    assert cost.prefill_costs(prompt, view)[0] == pytest.approx(wait_ms + own_ms)
    est = cost.evaluate(prompt, view, None, 0)[0]
    assert est.prefill_queue_ms == pytest.approx(wait_ms)
