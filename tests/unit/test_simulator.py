"""Unit tests for router/sim: the discrete-event simulator around the real Router."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from router.prefill_schedule import PrefillState, plan_step
from router.sim.cli import main as cli_main
from router.sim.cluster_model import (
    PREFILL_ORDERS,
    ClusterShapeError,
    EncodeCost,
    SimCluster,
    SimCosts,
    capacity_rps,
)
from router.sim.loop import simulate
from router.sim.trace_file import load_trace, write_trace
from router.sim.workload import Workload, WorkloadError, make_workload
from router.types import MediaJob, Placement, RequestProfile
from tests.unit.conftest import sim_run

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------- engine


def test_same_seed_same_result():
    a = sim_run("4x4x4-hetero", 3000, 0.8, "joint")
    b = sim_run("4x4x4-hetero", 3000, 0.8, "joint")
    assert np.array_equal(a.ttft_ms, b.ttft_ms)
    assert np.array_equal(a.estimate_ms, b.estimate_ms)
    c = sim_run("4x4x4-hetero", 3000, 0.8, "joint", seed=4)
    assert not np.array_equal(a.ttft_ms, c.ttft_ms)


@pytest.mark.parametrize("policy", ["joint", "least_loaded", "random", "round_robin", "affinity"])
def test_every_request_finishes_and_ttft_covers_its_service(policy):
    r = sim_run("3x4x2-hetero", 2000, 0.7, policy, prefix_share=0.5)
    assert r.completed == len(r.ttft_ms) == 2000
    assert np.all(r.ttft_ms > 0)
    assert np.all(r.ttft_ms >= r.service_ms - 1e-6)  # waiting only adds
    s = r.summary()
    assert 0 < s["utilisation"]["prefill"] <= 1.0
    assert 0 < s["goodput"]["fraction"] <= 1.0


def _hand_cluster() -> SimCluster:
    costs = SimCosts(
        encode={"image": EncodeCost(fixed_ms=2.0, per_unit_ms=10.0, batch_exponent=0.5)},
        prefill_fixed_ms=5.0,
        prefill_tokens_per_ms=10.0,
        bandwidth_bytes_per_ms={
            Placement.SAME_PROCESS: 1e6,
            Placement.SAME_NODE: 1e6,
            Placement.CROSS_NODE: 1e6,
        },
        transfer_latency_ms={
            Placement.SAME_PROCESS: 0.0,
            Placement.SAME_NODE: 0.0,
            Placement.CROSS_NODE: 0.0,
        },
    )
    return SimCluster.build(1, 1, 1, costs=costs, name="hand")


def _image(ident: str, size: float) -> MediaJob:
    return MediaJob(ident, "image", size, num_embeddings=10, embedding_bytes=1000)


def test_single_worker_matches_hand_computed_ttft():
    # r0 t=0    image 1.0 MP: encode 2 + 10*1.0 = 12 ms, transfer 0.001 ms,
    #           prefill 5 + 100/10 = 15 ms
    # r1 t=5ms  text, 200 tokens: prefill idle -> 5..30 ms                         TTFT 25
    # r0 reaches prefill at 12.001, waits for r1: 30..45                           TTFT 45
    # r2 t=6ms, r3 t=7ms  images 0.5 MP each: queued behind r0's batch, batched at 12 ms:
    #    2 + 10 * (0.5 + 0.5) * 2**(0.5 - 1) = 9.0711 ms -> 21.0711, prefill 45..60, 60..75
    #                                                                TTFT 54 and 68
    profiles = [
        RequestProfile(100, (_image("a", 1.0),)),
        RequestProfile(200),
        RequestProfile(100, (_image("b", 0.5),)),
        RequestProfile(100, (_image("c", 0.5),)),
    ]
    wl = Workload("hand", profiles, np.array([0.0, 0.005, 0.006, 0.007]))
    r = simulate(_hand_cluster(), wl, "joint", slo_ms=50)
    assert r.ttft_ms == pytest.approx([45.0, 25.0, 54.0, 68.0], abs=1e-6)
    assert r.service_ms == pytest.approx(
        [12.001 + 15, 25.0, 9.0711 + 0.001 + 15, 9.0711 + 0.001 + 15], abs=1e-3
    )
    assert r.summary()["goodput"]["fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("order", ["shortest_first", "fifo"])
def test_prefill_queue_order_is_the_engines_shortest_first_or_fifo(order):
    # 300 tokens at t=0 (5 + 30 = 35 ms), then 300 and 20 queue behind it (at 1 and 2 ms).
    # shortest first: the 20-token prompt at 35 ms (7 ms: TTFT 40), the long one at 42 (TTFT 76);
    # fifo: the long one at 35 (TTFT 69), the short one at 70 (TTFT 75).
    profiles = [RequestProfile(300), RequestProfile(300), RequestProfile(20)]
    cluster = _hand_cluster().with_costs(prefill_order=order)
    r = simulate(
        cluster, Workload("order", profiles, np.array([0.0, 0.001, 0.002])), "joint", slo_ms=50
    )
    expected = [35.0, 76.0, 40.0] if order == "shortest_first" else [35.0, 69.0, 75.0]
    assert r.ttft_ms == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "order,aging,expected",
    [
        ("shortest_first", 0.0, [2, 4, 6, 5, 1, 3]),
        ("shortest_first", 5000.0, [2, 4, 1, 5, 6, 3]),  # keys 130, 70, 250, 115, 190, 210
        ("fifo", 0.0, [1, 2, 3, 4, 5, 6]),
    ],
)
def test_the_simulator_serves_a_queue_in_the_engines_own_order(order, aging, expected):
    # r0 (300 tokens: 35 ms) holds the worker while six prompts queue behind it; the simulator
    # serves them one by one, the engine's scheduler (plan_step) orders their states in a step.
    sizes, arrivals = [300, 120, 40, 200, 40, 90, 60], [0.0, 0.002, 0.006, 0.01, 0.015, 0.02, 0.03]
    cluster = _hand_cluster().with_costs(prefill_order=order).with_prefill(aging_tokens_per_s=aging)
    wl = Workload("queue", [RequestProfile(n) for n in sizes], np.array(arrivals))
    r = simulate(cluster, wl, "joint", slo_ms=50)
    served = np.argsort(np.array(arrivals) + r.ttft_ms / 1e3)[1:].tolist()
    states = [
        PrefillState(str(i), n, 0, arrival=i, added_s=t)
        for i, (n, t) in enumerate(zip(sizes, arrivals))
    ][1:]
    planned = plan_step(states, sum(sizes), order=PREFILL_ORDERS[order], aging_tokens_per_s=aging)
    assert served == [int(c.request_id) for c in planned] == expected


@pytest.mark.parametrize("aging", [0.0, 10_000.0])
def test_aging_bounds_how_long_shorter_arrivals_pass_a_long_prompt(aging):
    # An overloaded stream of 20-token prompts (7 ms each, one every 5 ms from t=2 ms) and a
    # 300-token one (35 ms) at t=1 ms, behind a 20-token one in service (0-7 ms). Shortest first,
    # the long one waits for all 20 of the stream: it starts at 21 x 7 = 147 ms (TTFT 181). With
    # aging 10,000 tokens/s its key is 300 + 10 and stream prompt k's is 20 + 10 x (2 + 5k): prompts
    # 0-5 go first (keys 40-290), then it runs 49-84 ms (TTFT 83).
    profiles = [RequestProfile(20), RequestProfile(300)] + [RequestProfile(20)] * 20
    arrivals = np.array([0.0, 0.001] + [0.002 + 0.005 * k for k in range(20)])
    cluster = _hand_cluster().with_prefill(aging_tokens_per_s=aging)
    r = simulate(cluster, Workload("aging", profiles, arrivals), "joint", slo_ms=50)
    assert r.ttft_ms[1] == pytest.approx(181.0 if aging == 0 else 83.0, abs=1e-6)


@pytest.mark.parametrize("chunk", [0, 100])
def test_a_short_prompt_overtakes_a_long_one_at_its_next_chunk(chunk):
    # 300 tokens at t=0 (35 ms); 20 tokens (7 ms) arrive at 1 ms. In one go: the long one ends at
    # 35, the short at 42 (TTFT 41). In 100-token chunks (35/3 ms each): the short one goes after
    # the first chunk (11.67 -> 18.67, TTFT 17.67), the long one's two chunks follow (ends at 42).
    profiles = [RequestProfile(300), RequestProfile(20)]
    cluster = _hand_cluster().with_prefill(max_chunk_tokens=chunk)
    r = simulate(cluster, Workload("chunks", profiles, np.array([0.0, 0.001])), "joint", slo_ms=50)
    expected = [42.0, 35 / 3 + 7 - 1] if chunk else [35.0, 41.0]
    assert r.ttft_ms == pytest.approx(expected, abs=1e-6)
    assert r.service_ms == pytest.approx(
        [35.0, 7.0], abs=1e-6
    )  # chunking moves work, never adds it


def test_chunks_keep_arrival_order_under_fifo_and_every_prompt_finishes():
    # fifo: a prompt begun goes on to its end, chunks or not (the same TTFTs as in one go)
    profiles = [RequestProfile(n) for n in (300, 20, 250, 20, 180)]
    arrivals = np.array([0.0, 0.001, 0.002, 0.003, 0.004])
    base = _hand_cluster().with_costs(prefill_order="fifo")
    whole = simulate(base, Workload("w", profiles, arrivals), "joint", slo_ms=50)
    chunked = simulate(
        base.with_prefill(max_chunk_tokens=64),
        Workload("c", profiles, arrivals),
        "joint",
        slo_ms=50,
    )
    assert chunked.ttft_ms == pytest.approx(whole.ttft_ms, abs=1e-6)
    assert chunked.completed == len(profiles)


def test_a_prefill_order_the_engine_does_not_know_is_refused_by_name(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("encoders: 1\nprefill: 1\ndecode: 1\ncosts: {prefill_order: lifo}\n")
    with pytest.raises(
        ClusterShapeError,
        match="costs.prefill_order must be 'shortest_first' or 'fifo', got 'lifo'",
    ):
        SimCluster.from_yaml(yml)
    with pytest.raises(
        ClusterShapeError,
        match="costs.prefill_order must be 'shortest_first' or 'fifo', got 'lifo'",
    ):
        _hand_cluster().with_costs(prefill_order="lifo")
    yml.write_text("encoders: 1\nprefill: 1\ndecode: 1\ncosts: {prefill: {max_chunk_tokens: -5}}\n")
    with pytest.raises(
        ClusterShapeError, match="costs.prefill.max_chunk_tokens must be a number >= 0"
    ):
        SimCluster.from_yaml(yml)
    with pytest.raises(
        ClusterShapeError, match="costs.prefill.aging_tokens_per_s must be a number >= 0, got -1"
    ):
        _hand_cluster().with_prefill(aging_tokens_per_s=-1)


def test_encoder_cache_hit_skips_encoding():
    profiles = [
        RequestProfile(100, (_image("same", 1.0),)),
        RequestProfile(100, (_image("same", 1.0),)),
    ]
    wl = Workload("hit", profiles, np.array([0.0, 1.0]))
    r = simulate(_hand_cluster(), wl, "joint", slo_ms=50)
    assert r.ttft_ms == pytest.approx([12.001 + 15, 0.001 + 15], abs=1e-6)
    assert r.cache_hits == 1


def test_higher_load_gives_higher_p99():
    low = sim_run("4x4x4", 4000, 0.4, "joint")
    high = sim_run("4x4x4", 4000, 0.95, "joint")
    assert np.percentile(high.ttft_ms, 99) > np.percentile(low.ttft_ms, 99)
    assert high.utilisation["prefill"] > low.utilisation["prefill"]


def test_joint_not_worse_than_random_on_heterogeneous_workers():
    joint = sim_run("4x4x4-hetero", 6000, 0.8, "joint", seed=11)
    rand = sim_run("4x4x4-hetero", 6000, 0.8, "random", seed=11)
    assert np.percentile(joint.ttft_ms, 99) <= np.percentile(rand.ttft_ms, 99)


def test_router_calibrates_toward_simulated_speeds():
    # the priors say 20 tokens/ms; the simulated workers do 30 (fast) and 15 (slow)
    cluster = SimCluster.parse("2x2x2-hetero")
    wl = make_workload("poisson", 3000, seed=5, mix={"text": 1.0})
    wl = wl.at_rate(0.5 * capacity_rps(cluster, wl))
    from router.sim.loop import make_router
    from router.sim.loop import run_router as run_engine

    router = make_router(cluster, "joint", seed=5)
    run_engine(
        cluster, wl, router, "joint", slo_ms=1000, progress=False, record_decisions=False, load=0.5
    )
    fast, slow = router.cost.prefill_ms(0, 1000), router.cost.prefill_ms(1, 1000)
    assert fast == pytest.approx(5 + 1000 / 30, rel=0.05)
    assert slow == pytest.approx(2 * (5 + 1000 / 30), rel=0.05)


# -------------------------------------------------------------------------------------- workloads


def test_workload_is_deterministic_and_fast():
    import time

    t0 = time.perf_counter()
    a = make_workload("bursty", 200_000, seed=7, rate_rps=50.0, prefix_share=0.3)
    assert time.perf_counter() - t0 < 2.0
    b = make_workload("bursty", 200_000, seed=7, rate_rps=50.0, prefix_share=0.3)
    assert np.array_equal(a.arrival_s, b.arrival_s)
    assert [a.profiles[i] for i in (0, 17, 199_999)] == [b.profiles[i] for i in (0, 17, 199_999)]
    assert np.all(np.diff(a.arrival_s) >= 0)
    # the on/off modulation keeps the mean rate
    assert len(a) / a.arrival_s[-1] == pytest.approx(50.0, rel=0.2)


def test_repeat_rate_reuses_media():
    wl = make_workload("poisson", 5000, seed=2, repeat_rate=0.5, mix={"image": 1.0})
    ids = [p.items[0].identifier for p in wl.profiles]
    assert 0.4 < 1 - len(set(ids)) / len(ids) < 0.6
    none = make_workload("poisson", 5000, seed=2, repeat_rate=0.0, mix={"image": 1.0})
    assert len({p.items[0].identifier for p in none.profiles}) == 5000


def test_seed_classes_carry_the_table_costs():
    wl = make_workload("poisson", 2000, seed=1)
    by_tokens = {p.num_prompt_tokens: p for p in wl.profiles}
    assert set(by_tokens) == {1000, 1576, 3304, 18280, 2500}
    assert len(by_tokens[3304].items) == 4
    assert by_tokens[18280].items[0].size == 30 and by_tokens[18280].items[0].modality == "video"
    enc = SimCosts().encode
    assert enc["image"].solo_ms(by_tokens[1576].items[0].size) == pytest.approx(5.0)
    assert enc["image"].batch_ms(4 * by_tokens[1576].items[0].size, 4) == pytest.approx(
        12.0, abs=0.1
    )
    assert enc["video"].solo_ms(30) == pytest.approx(48.0)
    assert enc["audio"].solo_ms(30) == pytest.approx(85.0)


def test_trace_round_trip(tmp_path):
    wl = make_workload("poisson", 300, seed=9, rate_rps=20.0, prefix_share=0.5)
    path = tmp_path / "trace.jsonl"
    write_trace(path, wl, ttft_ms=[float(i) for i in range(300)])
    back = load_trace(path)
    assert len(back) == 300
    assert back.arrival_s == pytest.approx(wl.arrival_s, abs=1e-6)
    assert list(back.profiles) == list(wl.profiles)
    assert back.measured_ttft_ms[:3].tolist() == [0.0, 1.0, 2.0]
    assert back.rate_rps == pytest.approx(wl.rate_rps, rel=0.1)
    cluster = SimCluster.parse("2x2x2")
    replay = simulate(cluster, back, "joint", slo_ms=1000).summary()  # at the recorded pace
    assert replay["measured"]["ttft_ms"]["p50"] == pytest.approx(149.5, abs=1.0)
    retimed = simulate(cluster, back.at_rate(10.0), "joint", slo_ms=1000).summary()
    assert "measured" not in retimed and retimed["offered_rps"] == pytest.approx(10.0)


def test_malformed_trace_line_is_named(tmp_path):
    good = json.dumps({"arrival_s": 0.0, "num_prompt_tokens": 10, "max_tokens": 4, "items": []})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + '{"arrival_s": 1.0, "num_prompt_tokens": 10,\n' + good + "\n")
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2: not valid JSON"):
        load_trace(path)
    path.write_text(
        good
        + "\n\n"
        + json.dumps(
            {
                "arrival_s": 1.0,
                "num_prompt_tokens": 5,
                "max_tokens": 4,
                "items": [
                    {
                        "identifier": "x",
                        "modality": "smell",
                        "size": 1,
                        "num_embeddings": 1,
                        "embedding_bytes": 1,
                    }
                ],
            }
        )
    )
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:3: items\[0\]\.modality 'smell'"):
        load_trace(path)
    path.write_text(json.dumps({"arrival_s": 1.0, "max_tokens": 4}))
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:1: missing field 'num_prompt_tokens'"):
        load_trace(path)


# ------------------------------------------------------------------------------------- bad input


def test_cluster_shapes(tmp_path):
    c = SimCluster.parse("4x6x2-hetero")
    assert [w.speed for w in c.encoders] == [1.0, 1.0, 0.5, 0.5]
    assert len(c.prefill) == 6 and len(c.decode) == 2
    with pytest.raises(ClusterShapeError, match="cannot parse cluster shape"):
        SimCluster.parse("16by16")
    with pytest.raises(ClusterShapeError, match="no prefill worker"):
        SimCluster.parse("2x0x2")
    yml = tmp_path / "c.yaml"
    yml.write_text("encoders:\n  - {count: 2, modalities: [image]}\nprefill: 2\ndecode: 1\n")
    c = SimCluster.from_yaml(yml)
    with pytest.raises(ClusterShapeError, match="no encoder hosts audio, video"):
        c.check_workload({"image", "video", "audio"})
    yml.write_text("encoders: 2\nprefil: 2\n")
    with pytest.raises(ClusterShapeError, match=r"unknown key\(s\) \['prefil'\]"):
        SimCluster.from_yaml(yml)


def test_cli_bad_input_exits_2_naming_the_problem(tmp_path, capsys):
    assert cli_main(["--policy", "fastest", "--requests", "10"]) == 2
    assert "unknown routing policy 'fastest'" in capsys.readouterr().err
    yml = tmp_path / "imgonly.yaml"
    yml.write_text("encoders:\n  - {count: 2, modalities: [image]}\nprefill: 2\ndecode: 1\n")
    assert cli_main(["--cluster", str(yml), "--requests", "10"]) == 2
    assert "no encoder hosts audio, video" in capsys.readouterr().err
    assert cli_main(["--cluster", "0x2x2", "--requests", "10"]) == 2
    assert "has no encoder" in capsys.readouterr().err
    bad = tmp_path / "t.jsonl"
    bad.write_text("not json\n")
    assert cli_main(["--workload", str(bad)]) == 2
    assert "t.jsonl:1: not valid JSON" in capsys.readouterr().err
    assert cli_main(["--workload", str(tmp_path / "missing.jsonl")]) == 2
    assert "neither 'poisson', 'bursty' nor an existing trace file" in capsys.readouterr().err


def test_cli_json_compares_policies(capsys):
    assert (
        cli_main(
            ["--cluster", "2x2x2", "--policy", "all", "--requests", "400", "--json", "--seed", "1"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    policies = [r["policy"] for r in doc["results"]]
    assert policies[0] == "joint" and {"random", "least_loaded", "round_robin", "affinity"} <= set(
        policies
    )
    for r in doc["results"]:
        assert r["requests"] == 400 and math.isfinite(r["ttft_ms"]["p99"])


def test_cli_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cdf.png"
    assert (
        cli_main(
            [
                "--cluster",
                "2x2x2",
                "--policy",
                "joint,random",
                "--requests",
                "300",
                "--sweep",
                "0.5,0.8",
                "--plot",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    assert out.stat().st_size > 1000 and (tmp_path / "cdf_load.png").stat().st_size > 1000


def test_cli_rate_offers_requests_per_second_and_names_the_load(capsys):
    argv = ["--cluster", "2x4x2", "--rate", "20", "--requests", "4000", "--seed", "2"]
    assert cli_main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    result = doc["results"][0]
    assert doc["rate_rps"] == 20.0 and result["offered_rps"] == 20.0
    # the arrivals realise the rate (Poisson: ~1.6% standard deviation over 4000 requests)
    assert doc["arrival_rps"] == pytest.approx(20.0, rel=0.07)
    assert result["load"] == pytest.approx(20.0 / doc["capacity_rps"], rel=1e-3)
    assert result["decode_wait_ms"]["p99"] >= 0
    assert cli_main(argv[:-2]) == 0  # the text report: the rate, and the load it amounts to
    header = capsys.readouterr().out.splitlines()[1]
    assert f"at 20.00 req/s = {result['load']:.2f} x capacity" in header


def test_cli_rate_is_refused_with_load_or_sweep(capsys):
    for other in (["--load", "0.5"], ["--sweep", "0.5,0.7"]):
        assert cli_main(["--rate", "5", *other, "--requests", "10"]) == 2
        assert "--rate (requests/s) and --load/--sweep" in capsys.readouterr().err
    assert cli_main(["--rate", "0", "--requests", "10"]) == 2
    assert "--rate must be a positive number of requests/s" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- import rule


def test_router_sim_imports_neither_torch_nor_ray():
    code = (
        "import sys\n"
        "import router.sim, router.sim.cli, router.sim.loop, "
        "router.sim.report, router.sim.workload\n"
        "import router.sim.cluster_model, router.router\n"
        "from router.sim import SimCluster, make_workload, simulate\n"
        "simulate(SimCluster.parse('1x1x1'), make_workload('poisson', 50, rate_rps=5.0), 'joint')\n"
        "bad = sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'ray', 'matplotlib'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    for path in (REPO / "router").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "import ray" not in text and "from ray" not in text, (
            path
        )


@pytest.mark.parametrize("chunk", [0, 100])
def test_with_preemption_a_short_prompt_runs_inside_the_long_ones_chunk(chunk):
    # As above, with prefill.preempt_at_layers: the 20-token prompt (7 ms) that arrives at 1 ms
    # runs at once (TTFT 7), inside the long one's part in service (its whole prompt, or its
    # first 100-token chunk), which ends 7 ms later: the long one ends at 42 either way.
    profiles = [RequestProfile(300), RequestProfile(20)]
    cluster = _hand_cluster().with_prefill(max_chunk_tokens=chunk, preempt_at_layers=True)
    r = simulate(cluster, Workload("preempt", profiles, np.array([0.0, 0.001])), "joint", slo_ms=50)
    assert r.ttft_ms == pytest.approx([42.0, 7.0], abs=1e-6)
    assert r.service_ms == pytest.approx([35.0, 7.0], abs=1e-6)


def test_with_preemption_prompts_that_do_not_go_first_or_fit_a_chunk_wait():
    # A 150-token prompt (10 ms) does not fit a 100-token chunk, and a second 300-token prompt
    # is not shorter than the one in service: both queue; the 20-token one jumps both, and a
    # second 20-token one that arrives while the first runs waits for it (7 + 7 ms).
    profiles = [RequestProfile(n) for n in (300, 150, 300, 20, 20)]
    arrivals = np.array([0.0, 0.001, 0.002, 0.003, 0.004])
    cluster = _hand_cluster().with_prefill(max_chunk_tokens=100, preempt_at_layers=True)
    r = simulate(cluster, Workload("preempt", profiles, arrivals), "joint", slo_ms=50)
    assert r.ttft_ms[3:] == pytest.approx([7.0, 13.0], abs=1e-6)
    assert r.ttft_ms[1] > 35 / 3 + 14 - 1 and r.completed == 5


@pytest.mark.parametrize("pack", [False, True])
def test_with_packing_the_prompts_queued_behind_one_share_a_service(pack):
    # Four 20-token prompts 1 ms apart at an idle worker (5 ms + 10 tokens/ms): the first runs
    # alone, 0..7 ms. Apart, the others follow one by one (7..14, 14..21, 21..28); packed, the
    # three queued meanwhile share one service of 5 + 60 / 10 = 11 ms, all ending at 18 ms,
    # each served its third.
    profiles = [RequestProfile(20) for _ in range(4)]
    arrivals = np.array([0.0, 0.001, 0.002, 0.003])
    cluster = _hand_cluster().with_prefill(max_chunk_tokens=100, pack_prompts=pack)
    r = simulate(cluster, Workload("burst", profiles, arrivals), "joint", slo_ms=50)
    if pack:
        assert r.ttft_ms == pytest.approx([7.0, 17.0, 16.0, 15.0], abs=1e-6)
        assert r.service_ms == pytest.approx([7.0, 11 / 3, 11 / 3, 11 / 3], abs=1e-6)
    else:
        assert r.ttft_ms == pytest.approx([7.0, 13.0, 19.0, 25.0], abs=1e-6)


def test_a_pack_takes_at_most_a_chunks_tokens_and_no_much_longer_prompt():
    # Behind the first 20-token prompt: six more of 20 (at most 100 slots: five pack, 5 + 10 =
    # 15 ms, 7..22; the sixth then alone, 22..29) and one of 90 tokens, more than twice a
    # lone 20 (alone last, 29..43).
    profiles = [RequestProfile(n) for n in [20] * 7 + [90]]
    arrivals = np.arange(8) * 0.0001
    cluster = _hand_cluster().with_prefill(max_chunk_tokens=100, pack_prompts=True)
    r = simulate(cluster, Workload("burst", profiles, arrivals), "joint", slo_ms=50)
    done_ms = [t + a * 1e3 for t, a in zip(r.ttft_ms, arrivals)]
    assert done_ms == pytest.approx([7.0] + [22.0] * 5 + [29.0, 43.0], abs=1e-6)
