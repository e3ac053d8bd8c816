"""Service-time variability in the simulator (router/sim/variability.py): contention, noise,
the ingress overhead, and fitting them back from a trace."""

from __future__ import annotations

import numpy as np
import pytest

from router.sim.cluster_model import ClusterShapeError, SimCluster, SimCosts
from router.sim.loop import simulate
from router.sim.variability import Multipliers, Variability, busy, fit_service, fit_trace, in_flight
from router.sim.workload import Workload, make_workload
from router.types import MediaJob, Placement, RequestProfile

FREE = {pl: 0.0 for pl in Placement}


def text_cluster(prefill: int = 2, **costs) -> SimCluster:
    base = SimCosts(
        prefill_fixed_ms=5.0,
        prefill_tokens_per_ms=10.0,
        transfer_latency_ms=FREE,
        bandwidth_bytes_per_ms={pl: 1e12 for pl in Placement},
    )
    return SimCluster.build(
        1, prefill, 1, costs=SimCosts(**{**base.__dict__, **costs}), name="hand"
    )


def text(n: int, gaps_s: list[float]) -> Workload:
    return Workload("hand", [RequestProfile(200) for _ in range(n)], np.cumsum([0.0] + gaps_s))


def test_contention_slows_a_service_by_the_requests_in_flight():
    # r0 at 0 on an idle host: 5 + 200/10 = 25 ms. r1 at 1 ms goes to the idle prefill worker
    # with r0 in flight: 25 x (1 + 0.5 x 1) = 37.5 ms
    r = simulate(text_cluster(variability=Variability(contention=0.5)), text(2, [0.001]), "joint")
    assert r.ttft_ms == pytest.approx([25.0, 37.5])
    assert simulate(text_cluster(), text(2, [0.001]), "joint").ttft_ms == pytest.approx(
        [25.0, 25.0]
    )


def test_ingress_overhead_delays_routing_and_adds_to_ttft():
    image = MediaJob("x", "image", 0.0, 10, 1000)
    wl = Workload(
        "hand", [RequestProfile(200), RequestProfile(200, (image,))], np.array([0.0, 1.0])
    )
    r = simulate(text_cluster(ingress_ms=10.0, ingress_media_ms=4.0), wl, "joint")
    encode = SimCosts().encode["image"].solo_ms(0.0)  # 2 ms
    assert r.ttft_ms == pytest.approx([10.0 + 25.0, 14.0 + encode + 25.0])


def test_noise_keeps_the_mean_and_spreads_the_tail():
    cluster = SimCluster.parse("4x4x4")
    wl = make_workload("poisson", 4000, seed=2)
    wl = wl.at_rate(0.3 * 1000.0 / 17)  # light load: service times show through
    plain = simulate(cluster, wl, "joint", seed=2)
    noisy_costs = cluster.with_costs(variability=Variability(sigma=0.5, seed=1))
    noisy = simulate(noisy_costs, wl, "joint", seed=2)
    again = simulate(noisy_costs, wl, "joint", seed=2)
    assert np.array_equal(noisy.ttft_ms, again.ttft_ms)  # seeded
    assert np.mean(noisy.service_ms) == pytest.approx(np.mean(plain.service_ms), rel=0.05)
    assert np.percentile(noisy.service_ms, 99) > 1.3 * np.percentile(plain.service_ms, 99)


def test_multipliers_have_mean_one():
    m = Multipliers(Variability(sigma=0.6, seed=3))
    draws = np.array([m.service(0) for _ in range(40_000)])
    assert draws.mean() == pytest.approx(1.0, rel=0.02) and np.log(draws).std() == pytest.approx(
        0.6, rel=0.02
    )
    assert Multipliers(Variability(contention=0.25)).service(4) == 2.0
    assert (
        Multipliers(Variability(contention=0.25, max_others=2)).service(4) == 1.5
    )  # held beyond what a fit saw


def test_in_flight_counts_requests_between_arrival_and_first_token():
    arrival, ttft = (
        np.array([0.0, 0.1, 0.2]),
        np.array([150.0, 50.0, 500.0]),
    )  # in flight [0, .15), [.1, .15), [.2, .7)
    at = np.array([0.05, 0.12, 0.16, 0.3, 0.7])
    assert in_flight(arrival, ttft, at).tolist() == [1, 2, 0, 1, 0]
    # the third waits in a prefill queue over [0.25, 0.6) (prefill 100 ms, queued 350 ms): not
    # busy then
    assert busy(
        arrival, ttft, np.array([10.0, 10.0, 100.0]), np.array([0.0, 0.0, 350.0]), at
    ).tolist() == [1, 2, 0, 0, 0]


def test_fit_service_recovers_contention_noise_and_costs():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 1500, 3000).astype(float)
    others = rng.integers(0, 8, 3000)
    noise = np.exp(0.3 * rng.standard_normal(3000) - 0.045)
    measured = (4.0 + 0.05 * tokens) * (1 + 0.3 * others) * noise
    fit = fit_service(tokens, measured, others)
    assert fit.contention == pytest.approx(0.3, abs=0.03) and fit.sigma == pytest.approx(
        0.3, abs=0.02
    )
    assert fit.per_unit_ms == pytest.approx(0.05, rel=0.1) and fit.samples == 3000
    flat = fit_service(tokens, (4.0 + 0.05 * tokens) * noise, others)
    assert flat.contention <= 0.02


def simulated_trace(truth: Variability) -> list[dict]:
    """What the live cluster writes for a round-robin run of 4 equal text workers with known
    variability: arrival, TTFT, stage times (a text request's service is its prefill, the rest of
    its TTFT the prefill queue), route."""
    cluster = text_cluster(prefill=4, variability=truth)
    wl = make_workload(
        "poisson", 3000, seed=4, mix={"text": 1.0}, rate_rps=20.0
    )  # ~50% load: busy workers vary
    from router.sim.loop import make_router, run_router

    router = make_router(cluster, "round_robin", seed=1)
    decisions = []
    route = router.route
    router.route = lambda profile, now_s: decisions.append(route(profile, now_s)) or decisions[-1]
    sim = run_router(
        cluster,
        wl,
        router,
        "round_robin",
        slo_ms=1e3,
        progress=False,
        record_decisions=False,
        load=None,
    )
    return [
        {
            "arrival_s": a,
            "ttft_ms": t,
            "num_prompt_tokens": p.num_prompt_tokens,
            "items": [],
            "route": [None, d.prefill, 0],
            "encode_ms": 0.0,
            "prefill_ms": s,
            "prefill_queue_ms": t - s,
        }
        for a, t, p, d, s in zip(wl.arrival_s, sim.ttft_ms, wl.profiles, decisions, sim.service_ms)
    ]


def test_fit_trace_on_a_simulated_trace():
    """Record a trace from a simulation with known variability, fit it back."""
    fit = fit_trace(simulated_trace(Variability(contention=0.2, sigma=0.25, seed=5)))
    assert fit.prefill.contention == pytest.approx(
        0.2, abs=0.05
    ) and fit.prefill.sigma == pytest.approx(0.25, abs=0.05)
    assert fit.prefill.base_ms(1000) == pytest.approx(5 + 1000 / 10, rel=0.1)
    assert fit.speeds[1] == pytest.approx(1.0, rel=0.1)
    assert (
        fit.ingress_ms == pytest.approx(0.0, abs=1e-6)
        and fit.variability(3).max_others == fit.max_others > 0
    )


def test_fit_trace_takes_the_busiest_worker_as_its_reference():
    """A worker the router avoided has a few warm-up requests: too few to fit the host by. The fit
    takes the worker that served most; an explicit reference is still honoured."""
    records = simulated_trace(Variability(contention=0.2, sigma=0.25, seed=5))
    # the workers are equal, so worker 0's requests but 4 may be told as worker 2's (the busy
    # counts stay)
    for r in [r for r in records if r["route"][1] == 0][4:]:
        r["route"] = [None, 2, 0]
    fit = fit_trace(records)
    assert fit.reference == 2 and fit.prefill.base_ms(1000) == pytest.approx(5 + 1000 / 10, rel=0.1)
    assert (
        0 in fit.speeds and 2 not in fit.speeds
    )  # worker 0's speed is measured relative to worker 2
    assert fit_trace(records, reference=0).reference == 0


def test_variability_from_yaml_and_bad_values(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text(
        "encoders: 1\nprefill: 1\ndecode: 1\ncosts:\n  ingress_ms: 3\n"
        "  variability: {contention: 0.2, sigma: 0.3}\n"
    )
    c = SimCluster.from_yaml(yml)
    assert (
        c.costs.variability == Variability(contention=0.2, sigma=0.3) and c.costs.ingress_ms == 3.0
    )
    yml.write_text("encoders: 1\nprefill: 1\ndecode: 1\ncosts:\n  variability: {sigma: -1}\n")
    with pytest.raises(ClusterShapeError, match="sigma"):
        SimCluster.from_yaml(yml)
    yml.write_text(
        "encoders: 1\nprefill: 1\ndecode: 1\ncosts:\n"
        "  variability: {contention: 0.1, count_decoding: 'yes'}\n"
    )
    with pytest.raises(ClusterShapeError, match="count_decoding"):
        SimCluster.from_yaml(yml)
    yml.write_text("encoders: 1\nprefill: 1\ndecode: 1\ncosts:\n  variability: {spread: 1}\n")
    with pytest.raises(ClusterShapeError, match="variability"):
        SimCluster.from_yaml(yml)


def test_host_slowness_is_shared_correlated_and_mean_one():
    m = Multipliers(Variability(host_sigma=0.5, host_tau_s=1.0, seed=2))
    times = np.arange(0, 20_000, 0.5)
    h = np.array([m.host(t) for t in times])
    assert h.mean() == pytest.approx(1.0, rel=0.05) and np.log(h).std() == pytest.approx(
        0.5, rel=0.05
    )
    lag1 = np.corrcoef(np.log(h[:-1]), np.log(h[1:]))[0, 1]
    assert lag1 == pytest.approx(np.exp(-0.5), abs=0.03)  # exp(-dt / tau)
    assert (
        m.host(times[-1]) == h[-1]
    )  # the same time, the same slowness (services starting together)


def test_a_measured_host_profile_is_interpolated():
    m = Multipliers(Variability(host_profile=((0.0, 0.0), (1.0, np.log(4.0)))))
    assert [m.host(t) for t in (-1.0, 0.5, 2.0)] == pytest.approx([1.0, 2.0, 4.0])
    assert Variability(host_profile=((0.0, 0.1),)).enabled


def test_fit_host_and_the_measured_host_recover_a_slow_spell():
    """Services slowed 4x between 20 and 30 s (a background burst), no contention: the stationary
    fit sees correlated residuals; the measured host finds the spell and no contention."""
    rng = np.random.default_rng(1)
    t = np.sort(rng.uniform(0, 60, 600))
    tokens = rng.integers(100, 1500, 600).astype(float)
    others = rng.integers(0, 4, 600)
    spell = np.where((t > 20) & (t < 30), 4.0, 1.0)
    measured = (0.05 * tokens) * spell * np.exp(0.2 * rng.standard_normal(600))
    from router.sim.variability import fit_host, fit_measured_host

    flat = fit_service(tokens, measured, np.zeros(600))
    share, tau = fit_host(t, np.log(measured / flat.base_ms(tokens)))
    assert share > 0.5 and tau > 1.0
    host = fit_measured_host(tokens, measured, others, t)
    knots = dict(host.profile)
    inside, outside = (
        np.mean([v for k, v in knots.items() if 22 < k < 28]),
        np.mean([v for k, v in knots.items() if k < 15 or k > 35]),
    )
    assert np.exp(inside - outside) == pytest.approx(4.0, rel=0.15)
    assert host.prefill.contention <= 0.04 and host.prefill.sigma == pytest.approx(0.2, abs=0.05)


def test_requests_decoding_count_as_busy_where_decode_times_are_given():
    arrival, ttft = np.array([0.0, 0.1]), np.array([50.0, 50.0])  # first tokens at .05 and .15
    no_queue, at = np.zeros(2), np.array([0.06, 0.12, 0.2, 0.4])
    assert busy(arrival, ttft, ttft, no_queue, at).tolist() == [0, 1, 0, 0]
    # decoding for 100 ms after the first token: [.05, .15) and [.15, .25)
    assert busy(arrival, ttft, ttft, no_queue, at, decode_ms=np.array([100.0, 100.0])).tolist() == [
        1,
        2,
        1,
        0,
    ]


def test_the_simulator_counts_decoding_requests_as_contention_when_asked():
    # r0 at 0: 25 ms, then decodes 8 x 10 ms until 105 ms. r1 at 50 ms, on the other prefill
    # worker: 25 ms alone; with decoding counted, r0's decode is one other busy request:
    # 25 x (1 + 0.5) = 37.5 ms
    wl = Workload(
        "hand", [RequestProfile(200, max_tokens=8) for _ in range(2)], np.array([0.0, 0.05])
    )
    plain = text_cluster(decode_step_ms=10.0, variability=Variability(contention=0.5))
    counted = text_cluster(
        decode_step_ms=10.0, variability=Variability(contention=0.5, count_decoding=True)
    )
    assert simulate(plain, wl, "joint").ttft_ms == pytest.approx([25.0, 25.0])
    assert simulate(counted, wl, "joint").ttft_ms == pytest.approx([25.0, 37.5])


def test_fit_trace_counts_decoding_only_when_every_record_has_its_decode_time():
    rng = np.random.default_rng(1)
    records = [
        {
            "arrival_s": 0.2 * i,
            "ttft_ms": 60.0,
            "num_prompt_tokens": int(rng.integers(100, 900)),
            "items": [],
            "route": [None, 0, 0],
            "encode_ms": 0.0,
            "prefill_ms": 50.0,
            "prefill_queue_ms": 0.0,
            "decode_ms": 300.0,
        }
        for i in range(40)
    ]
    assert fit_trace(records).count_decoding and fit_trace(records).variability().count_decoding
    assert (
        fit_trace(records).max_others >= 1
    )  # the previous requests still decoding when each one's prefill starts
    del records[3]["decode_ms"]
    assert not fit_trace(records).count_decoding and fit_trace(records).max_others == 0
