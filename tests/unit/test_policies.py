"""Unit tests for router/policies.py: the joint fast path against brute force, and what
defines each baseline."""

from __future__ import annotations

import random

import pytest

from router.calibration import CalibrationConfig
from router.cost_model import CostModel, CostPriors
from router.policies import POLICIES, Affinity, Joint, LeastLoaded, make_policy
from router.types import Placement, RequestProfile, WorkerInfo, WorkerKind
from router.view import ClusterView, NoWorkerError
from tests.unit.conftest import fleet, media

E, P, D = WorkerKind.ENCODER, WorkerKind.PREFILL, WorkerKind.DECODE
MODS = ("image", "video", "audio")


def setup(workers: list[WorkerInfo]) -> tuple[ClusterView, CostModel]:
    view = ClusterView(workers)
    view.refresh(0.0)
    return view, CostModel.for_view(None, view)


IMAGE = RequestProfile(600, (media("a"),))
TEXT = RequestProfile(100)


# -- joint: the O(E + P) path must find the brute-force E x P minimum ----------------------------


def random_instance(
    rng: random.Random, spread_z: float = 0.0
) -> tuple[ClusterView, CostModel, RequestProfile]:
    nodes = [f"n{k}" for k in range(rng.randint(1, 4))]
    workers = []
    for i in range(rng.randint(1, 7)):
        mods = frozenset(m for m in MODS if rng.random() < 0.7) | {"image"}
        process = (
            f"proc{i}" if rng.random() < 0.3 else None
        )  # some encoders share a process with prefill i
        workers.append(WorkerInfo(E, i, rng.choice(nodes), mods, process))
    for i in range(rng.randint(1, 7)):
        workers.append(
            WorkerInfo(P, i, rng.choice(nodes), process=f"proc{i}" if rng.random() < 0.5 else None)
        )
    workers += [WorkerInfo(D, i, rng.choice(nodes)) for i in range(rng.randint(1, 3))]
    view = ClusterView(workers)
    priors = CostPriors.from_dict(
        {
            "bandwidth_gbps": {
                "same_node": rng.choice([0.05, 1.0, 600.0]),
                "cross_node": rng.choice([0.01, 0.5, 50.0]),
            }
        }
    )
    cost = CostModel.for_view(
        priors, view, CalibrationConfig(spread_z=spread_z)
    )  # 0: the plain argmin
    ids = [f"id{k}" for k in range(6)]
    hashes = tuple(f"h{k}" for k in range(12))
    now = rng.uniform(0, 3)
    for e in range(len(view.workers[E])):
        view.begin(E, e, 1, rng.uniform(0, 80))
        if rng.random() < 0.5:
            view.publish(
                E, e, now_s=now, cached_identifiers=frozenset(rng.sample(ids, rng.randint(1, 4)))
            )
        for _ in range(rng.randint(0, 6)):  # per-worker calibration: some encoders slower
            size = rng.uniform(0.05, 2)
            cost.observe_encode(e, "image", size, (1 + size * 30) * rng.uniform(0.5, 3))
    for p in range(len(view.workers[P])):
        view.begin(P, p, rng.randint(1, 3), rng.uniform(0, 200))
        if rng.random() < 0.5:
            view.publish(P, p, now_s=now, prefix_hashes=frozenset(hashes[: rng.randint(0, 12)]))
        for _ in range(rng.randint(0, 6)):
            tokens = rng.randint(10, 3000)
            cost.observe_prefill(p, tokens, (2 + tokens / 20) * rng.uniform(0.5, 3))
    if rng.random() < 0.5:
        cost.observe_transfer(Placement.SAME_PROCESS, 10**6, rng.uniform(0.0, 5.0))
    modality = rng.choice(["image", "image", "video", "audio"])
    items = tuple(
        media(
            rng.choice(ids),
            rng.choice(["image", modality]),
            rng.uniform(0.05, 30),
            rng.randint(1, 3000),
        )
        for _ in range(rng.randint(0, 4))
    )
    profile = RequestProfile(rng.randint(1, 4000), items, hashes[: rng.randint(0, 12)])
    view.refresh(now)
    return view, cost, profile


def brute_force_min(view: ClusterView, cost: CostModel, profile: RequestProfile) -> float:
    encoders = view.candidates(E, profile.modalities) if profile.items else [None]
    return min(
        cost.evaluate(profile, view, e, p)[0].total_ms for e in encoders for p in view.candidates(P)
    )


def test_joint_equals_brute_force_minimum_on_random_clusters():
    checked = 0
    for seed in range(400):
        view, cost, profile = random_instance(random.Random(seed))
        try:
            expected = brute_force_min(view, cost, profile)
        except (
            NoWorkerError
        ):  # no encoder hosts all its modalities: split (test_split.py), or none hosts one
            if not profile.items or not all(
                any(it.modality in w.modalities for w in view.workers[E]) for it in profile.items
            ):
                with pytest.raises(NoWorkerError):
                    Joint().pick(profile, view, cost, view.now_s)
            else:
                assert Joint().pick(profile, view, cost, view.now_s).shares
            continue
        decision = Joint().pick(profile, view, cost, view.now_s)
        assert decision.estimated_ttft_ms == pytest.approx(expected, rel=1e-9, abs=1e-9), seed
        assert (
            decision.estimate == cost.evaluate(profile, view, decision.encoder, decision.prefill)[0]
        )
        if profile.items:
            assert profile.modalities <= view.workers[E][decision.encoder].modalities
        checked += 1
    assert checked > 250  # most instances have a feasible encoder


def test_joint_spreads_near_ties_to_the_least_booked_worker():
    """With spread_z = 1 joint takes, of the pairs estimated within (1 + the prefill fit's error) of
    the best, one whose prefill worker has the fewest jobs booked: never worse than that bound."""
    spread_seen = 0
    for seed in range(300):
        view, cost, profile = random_instance(random.Random(seed), spread_z=1.0)
        try:
            best = brute_force_min(view, cost, profile)
        except NoWorkerError:
            continue
        decision = Joint().pick(profile, view, cost, view.now_s)
        limit = best * (1 + cost.prefill_error)
        assert decision.estimated_ttft_ms <= limit * (1 + 1e-9) + 1e-9, seed
        encoders = view.candidates(E, profile.modalities) if profile.items else [None]
        near = [
            p
            for e in encoders
            for p in view.candidates(P)
            if cost.evaluate(profile, view, e, p)[0].total_ms <= limit
        ]
        assert view.outstanding[P][decision.prefill] <= min(view.outstanding[P][p] for p in near), (
            seed
        )
        spread_seen += decision.estimated_ttft_ms > best * (1 + 1e-9)
    assert spread_seen > 10  # the rule did choose other than the argmin


def test_joint_spread_by_hand():
    view, cost = setup(fleet(1, 2, 1))
    view.begin(P, 0, 2, ms=5.0)  # worker 0: 2 jobs, 5 ms booked; worker 1: 3 jobs, 3 ms: the argmin
    view.begin(P, 1, 3, ms=3.0)
    cost.prefill_fit.err2 = 0.3**2  # the fit has seen 30% error
    assert (
        Joint().decision(TEXT, view, cost).prefill == 0
    )  # 5 + 7 vs 3 + 7 ms: within 30%, fewer jobs
    cost.prefill_fit.err2 = 0.01**2  # an exact fit: the argmin
    assert Joint().decision(TEXT, view, cost).prefill == 1
    cost.prefill_fit.err2 = 0.3**2
    assert (
        Joint()
        .decision(TEXT, view, CostModel.for_view(None, view, CalibrationConfig(spread_z=0)))
        .prefill
        == 1
    )


def test_joint_equals_brute_force_minimum_with_jobs_in_service():
    """The same, with prefill workers part-way through a job (the queue credit in play)."""
    checked = 0
    for seed in range(200):
        rng = random.Random(1000 + seed)
        view, cost, profile = random_instance(rng)
        for p in range(len(view.workers[P])):  # as ClusterView.end / begin_route set them
            if rng.random() < 0.7:
                view.service_started_ms[p] = view.now_s * 1e3 - rng.uniform(-50, 300)
                view.service_ms[p] = view.outstanding_ms[P][p] * rng.uniform(0, 1)
        try:
            expected = brute_force_min(view, cost, profile)
        except NoWorkerError:
            continue
        decision = Joint().pick(profile, view, cost, view.now_s)
        assert decision.estimated_ttft_ms == pytest.approx(expected, rel=1e-9, abs=1e-9), seed
        assert (
            decision.estimate == cost.evaluate(profile, view, decision.encoder, decision.prefill)[0]
        )
        checked += 1
    assert checked > 120


def test_joint_trades_encoder_queue_against_prefill_cache():
    view, cost = setup(fleet(2, 2, 1))
    view.publish(E, 1, now_s=0.0, cached_identifiers=frozenset({"a"}))
    view.publish(P, 1, now_s=0.0, prefix_hashes=frozenset({"h0", "h1"}))
    view.begin(E, 0, 1, 100.0)
    profile = RequestProfile(600, (media("a"),), ("h0", "h1"), block_size=256)
    decision = Joint().pick(profile, view, cost, 0.0)
    assert (decision.encoder, decision.prefill) == (1, 1)
    assert decision.encode_items == () and decision.uncached_tokens == 600 - 512


def test_joint_text_only_picks_the_cheapest_prefill():
    view, cost = setup(fleet(0, 3, 1))
    view.begin(P, 0, 1, 50.0)
    view.publish(P, 2, now_s=0.0, prefix_hashes=frozenset({"h0"}))
    decision = Joint().pick(RequestProfile(100, prefix_hashes=("h0",)), view, cost, 0.0)
    assert (decision.encoder, decision.prefill) == (None, 2)


# -- every policy --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_reports_the_cost_models_estimate_of_its_pair(name):
    view, cost = setup(fleet(4, 4, 2))
    view.begin(E, 2, 1, 30.0)
    policy = make_policy(name, seed=5)
    for profile in (IMAGE, TEXT, RequestProfile(900, (media("a"), media("b", "video", 30, 4000)))):
        decision = policy.pick(profile, view, cost, 0.0)
        estimate, misses, uncached = cost.evaluate(
            profile, view, decision.encoder, decision.prefill
        )
        assert (
            decision.estimate == estimate
            and decision.encode_items == misses
            and decision.uncached_tokens == uncached
        )
        assert decision.items == profile.items and (decision.encoder is None) == (not profile.items)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_only_uses_encoders_hosting_the_modalities(name):
    view, cost = setup(
        fleet(4, 2, 2, e0=frozenset({"image"}), e1=frozenset({"audio"}), e3=frozenset({"image"}))
    )
    audio = RequestProfile(100, (media("s", "audio", 30, 1500),))
    both = RequestProfile(100, (media("s", "audio", 30, 1500), media("i")))
    policy = make_policy(name, seed=1)
    assert {policy.pick(audio, view, cost, 0.0).encoder for _ in range(20)} <= {1, 2}
    assert {policy.pick(both, view, cost, 0.0).encoder for _ in range(20)} == {2}
    view.set_healthy(E, 2, False)  # now no encoder hosts both: the request is split by modality
    for _ in range(10):
        split = policy.pick(both, view, cost, 0.0)
        assert split.encoder_for("audio") == 1 and split.encoder_for("image") in {0, 3}
    view.set_healthy(E, 1, False)
    with pytest.raises(NoWorkerError, match="hosts audio"):  # nobody hosts audio any more
        policy.pick(both, view, cost, 0.0)
    with pytest.raises(NoWorkerError, match="video"):
        policy.pick(RequestProfile(100, (media("v", "video", 30),)), view, cost, 0.0)
    assert policy.pick(TEXT, view, cost, 0.0).encoder is None  # text needs no encoder


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_worker_of_a_stage_raises(name):
    for dead in (P, D):
        view, cost = setup(fleet(2, 2, 2))
        for i in range(2):
            view.set_healthy(dead, i, False)
        with pytest.raises(NoWorkerError, match=dead.value):
            make_policy(name).pick(IMAGE, view, cost, 0.0)


# -- the baselines -------------------------------------------------------------------------------


def test_round_robin_cycles_through_each_stage():
    view, cost = setup(fleet(2, 3, 4))
    policy = make_policy("round_robin")
    picks = [policy.pick(IMAGE, view, cost, 0.0) for _ in range(12)]
    assert [d.encoder for d in picks] == [0, 1] * 6
    assert [d.prefill for d in picks] == [0, 1, 2] * 4
    assert [d.decode for d in picks] == [0, 1, 2, 3] * 3


def test_random_is_deterministic_per_seed():
    def run(seed: int) -> list[tuple]:
        view, cost = setup(fleet(8, 8, 8))
        policy = make_policy("random", seed=seed)
        return [
            (d.encoder, d.prefill, d.decode)
            for d in (policy.pick(IMAGE, view, cost, 0.0) for _ in range(50))
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len({pick[1] for pick in run(7)}) > 4  # it does spread


def test_least_loaded_takes_the_less_loaded_of_two_samples():
    view, cost = setup(fleet(2, 2, 2))
    view.begin(E, 0, 1, 40.0)
    view.begin(P, 1, 1, 10.0)
    view.begin(D, 0, 3)
    policy = LeastLoaded(seed=3)
    for _ in range(20):  # with two workers both are always sampled: the less loaded wins
        decision = policy.pick(IMAGE, view, cost, 0.0)
        assert (decision.encoder, decision.prefill, decision.decode) == (1, 0, 1)
    # with many workers the most loaded one can never win (it loses to whichever it is paired with)
    view, cost = setup(fleet(8, 8, 8))
    for i in range(8):
        view.begin(P, i, 1, 10.0 * i)
    assert 7 not in {policy.pick(IMAGE, view, cost, 0.0).prefill for _ in range(200)}


def test_least_loaded_breaks_ties_at_random_whatever_the_numbering():
    view, cost = setup(fleet(2, 2, 2))  # all idle: every pick is a tie
    policy = LeastLoaded(seed=5)
    picks = [policy.pick(IMAGE, view, cost, 0.0) for _ in range(400)]
    for stage in ("encoder", "prefill", "decode"):
        share = sum(getattr(d, stage) == 1 for d in picks) / len(picks)
        assert 0.4 < share < 0.6, (stage, share)


def test_affinity_prefers_the_cache_holder_even_when_busier():
    view, cost = setup(fleet(3, 3, 1))
    view.publish(E, 2, now_s=0.0, cached_identifiers=frozenset({"a", "b"}))
    view.publish(E, 1, now_s=0.0, cached_identifiers=frozenset({"a"}))
    view.begin(E, 2, 5, 500.0)
    view.publish(P, 1, now_s=0.0, prefix_hashes=frozenset({"h0", "h1", "h2"}))
    view.publish(P, 2, now_s=0.0, prefix_hashes=frozenset({"h0"}))
    view.begin(P, 1, 5, 500.0)
    profile = RequestProfile(500, (media("a"), media("b")), ("h0", "h1", "h2", "h3"))
    decision = Affinity().pick(profile, view, cost, 0.0)
    assert (decision.encoder, decision.prefill) == (2, 1)  # most items held, longest prefix
    # nobody holds anything: the least loaded
    view.begin(E, 0, 1, 5.0)
    decision = Affinity().pick(RequestProfile(500, (media("zz"),), ("q0",)), view, cost, 0.0)
    assert (decision.encoder, decision.prefill) == (1, 0)


def test_make_policy_and_unknown_names():
    for name, cls in POLICIES.items():
        policy = make_policy(name)
        assert isinstance(policy, cls) and policy.name == name
    assert set(POLICIES) == {"joint", "random", "round_robin", "least_loaded", "affinity"}
    with pytest.raises(ValueError) as info:
        make_policy("round_robin_typo")
    assert "round_robin_typo" in str(info.value) and all(
        name in str(info.value) for name in POLICIES
    )
