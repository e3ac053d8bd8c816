"""The simulator calibrated from a live run of the routing bench: the run's fleet as a
SimCluster (three calibrations, MODELS), its trace replayed, and the simulated TTFT compared
with what was measured."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchkit.routing.config import cluster_config, slowdowns
from benchkit.routing.runs import join, timed_trace
from benchkit.stats import pcts

# simulator calibrations compared (see calibrate)
MODELS = ("variable", "measured host", "deterministic")


def calibrate(run: dict, trace: list[dict], pairs: list[tuple[dict, dict]], args, model: str):
    """The joint run's fleet as a SimCluster. model "variable": fit_trace's contention, host
    slowness (random), noise and ingress overhead; "measured host": the same with the host's
    slowness as measured over the run; "deterministic": the last report's model (no contention,
    no noise, the mean overhead). Returns the cluster and what was fitted."""
    from router.sim.cluster_model import SimCluster
    from router.sim.variability import fit_trace

    fit = fit_trace(trace, grid=None if model != "deterministic" else np.array([0.0]))
    pf, ingress, crowd = model_parts(
        fit, model, trace, [t["arrival_s"] for t, _ in pairs if t["items"]]
    )
    # the load phase's mean, less the slowdown its batches met
    encode_ms = (run["stage_ms"]["encode"] or 0.0) / crowd
    # relative to the fit's reference worker; one with under 3 requests in the trace: as
    # configured
    ref, factors = fit.reference, slowdowns(args)
    speeds = [
        1.0 if i == ref else fit.speeds.get(i, factors[ref] / f) for i, f in enumerate(factors)
    ]
    costs = sim_costs(run, args, fit, pf, ingress, encode_ms, model)
    cluster = SimCluster.build(
        2, len(speeds), 1, prefill_speeds=speeds, costs=costs, name="live-calibrated"
    )
    v = costs.variability
    doc = {
        "prefill_fixed_ms": round(pf.fixed_ms, 3),
        "prefill_ms_per_token": round(pf.per_unit_ms, 5),
        "prefill_speeds": [round(x, 3) for x in speeds],
        "reference_worker": ref,
        "prefill_chunk_tokens": costs.prefill.max_chunk_tokens,
        "prefill_aging_tokens_per_s": costs.prefill.aging_tokens_per_s,
        "contention_per_request": round(v.contention, 3),
        "max_others": fit.max_others,
        "service_sigma": round(v.sigma, 3),
        "host_sigma": round(v.host_sigma, 3),
        "host_tau_s": round(v.host_tau_s, 3),
        "ingress_ms": round(ingress[0], 2),
        "ingress_media_ms": round(costs.ingress_media_ms, 2),
        "ingress_sigma": round(v.ingress_sigma, 3),
        "encode_ms_per_batch": round(encode_ms, 3),
        "decode_step_ms": round(costs.decode_step_ms, 3),
        "fitted_requests": pf.samples,
    }
    return cluster, doc


def sim_costs(run: dict, args, fit, pf, ingress, encode_ms: float, model: str):
    """The simulated stage costs: the fitted prefill and ingress, the measured encode and decode
    step, the configured batch and chunk sizes, and the model's variability."""
    from router.sim.cluster_model import EncodeCost, SimCosts
    from router.sim.variability import Variability

    cfg = cluster_config(args, "joint", Path(run["trace"]))
    return SimCosts(
        encode={**SimCosts().encode, "image": EncodeCost(encode_ms, 0.0, 1.0)},
        encode_max_batch=cfg.encoder.max_batch_size,
        prefill_fixed_ms=pf.fixed_ms,
        prefill_tokens_per_ms=1.0 / max(pf.per_unit_ms, 1e-6),
        prefill=cfg.prefill.settings(),  # the engine's chunks and aging
        decode_step_ms=run["stage_ms"]["decode_step"] or 1.0,
        decode_step_per_seq_ms=0.0,
        decode_max_batch=cfg.decode.max_batch_size,
        ingress_ms=ingress[0],
        ingress_media_ms=ingress[1] + cfg.encoder.max_wait_ms,  # the batcher's wait: not simulated
        variability=Variability()
        if model == "deterministic"
        else fit.variability(args.seed, model == "measured host"),
    )


def model_parts(fit, model: str, trace: list[dict], image_arrivals: list[float]):
    """The prefill fit, the ingress (text ms, media ms, sigma) and the mean slowdown image
    requests met at arrival (to take out of the measured encode time) of one model."""
    from router.sim.variability import busy, interpolate

    col = {
        k: np.array([t[k] for t in trace])
        for k in ("arrival_s", "ttft_ms", "prefill_ms", "prefill_queue_ms")
    }
    decode_ms = np.array([t["decode_ms"] for t in trace]) if fit.count_decoding else None
    at = np.array(image_arrivals)
    others = (
        np.minimum(busy(*col.values(), at, decode_ms) - 1, fit.max_others)
        if len(at)
        else np.zeros(0)
    )
    if model == "measured host":
        m = fit.measured
        knots = [t for t, _ in m.profile], [x for _, x in m.profile]
        host = np.exp([interpolate(*knots, t) for t in at])
        return (
            m.prefill,
            (m.ingress_ms, m.ingress_media_ms, m.ingress_sigma),
            float(np.mean((1 + m.prefill.contention * others) * host)) if len(at) else 1.0,
        )
    crowd = float(np.mean(1 + fit.prefill.contention * others)) if len(at) else 1.0
    return fit.prefill, (fit.ingress_ms, fit.ingress_media_ms, fit.ingress_sigma), crowd


def replay(cluster, trace: list[dict], path: Path, args, seeds: int) -> list[dict[int, float]]:
    """Per noise seed: simulated TTFT per trace record (by id), replayed at the recorded pace."""
    from router.sim.loop import simulate
    from router.sim.trace_file import load_trace

    path.write_text("".join(json.dumps(rec) + "\n" for rec in trace))
    workload, out = load_trace(path), []
    for seed in range(seeds if cluster.costs.variability.enabled else 1):
        seeded = cluster.with_costs(
            variability=replace(cluster.costs.variability, seed=args.seed + seed)
        )
        out.append(
            dict(
                zip(
                    map(id, trace),
                    simulate(seeded, workload, "joint", seed=args.seed).ttft_ms.tolist(),
                )
            )
        )
    return out


def compare(pairs, sims: list[dict[int, float]], http_ms: float) -> dict:
    """Measured vs simulated load-phase TTFT, server and client side; over several noise seeds
    the simulated mean and p90 are the seeds' averages (their p90 errors' range is given too)."""
    out = {}
    for side, measured, hop in (
        ("server", [m["ttft_ms"] for _, m in pairs], 0.0),
        ("client", [m["client_ttft_ms"] for _, m in pairs], http_ms),
    ):
        meas = pcts(measured)
        per_seed = [pcts([sim[id(t)] + hop for t, _ in pairs]) for sim in sims]
        simd = {k: round(float(np.mean([s[k] for s in per_seed])), 2) for k in meas}
        err = {k: round((simd[k] - meas[k]) / meas[k], 3) for k in ("mean", "p90")}
        p90s = [(s["p90"] - meas["p90"]) / meas["p90"] for s in per_seed]
        out[side] = {
            "measured": meas,
            "simulated": simd,
            "rel_error": err,
            "p90_error_range": [round(min(p90s), 3), round(max(p90s), 3)],
            "within_20pct": all(abs(e) <= 0.2 for e in err.values()),
        }
    return out


def service_ratios(pairs, cluster) -> dict[int, float]:
    """Per load-phase trace record (by id): its measured prefill service (own device time) /
    the calibrated model's."""
    a, tpm = cluster.costs.prefill_fixed_ms, cluster.costs.prefill_tokens_per_ms
    return {
        id(t): (m.get("prefill_compute_ms") or m["prefill_ms"])
        * cluster.prefill[t["route"][1]].speed
        / (a + t["num_prompt_tokens"] / tpm)
        for t, m in pairs
    }


def validate_sim(run: dict, args) -> dict:
    """Each of MODELS calibrated from the run and replayed against its load phase, and the
    measured-service diagnostic."""
    trace = timed_trace(run)
    pairs = sorted(join(trace, run["records"]), key=lambda p: p[0]["arrival_s"])
    out_dir, tag = Path(args.out_dir), run["tag"]
    http_ms = float(np.mean([m["client_ttft_ms"] - m["ttft_ms"] for _, m in pairs]))
    out = {"requests_compared": len(pairs), "http_hop_ms": round(http_ms, 2)}
    for name in MODELS:
        cluster, doc = calibrate(run, trace, pairs, args, name)
        sims = replay(cluster, trace, out_dir / f"sim_trace_{tag}.jsonl", args, args.sim_seeds)
        out[name] = {"calibration": doc, **compare(pairs, sims, http_ms)}
    path = out_dir / f"sim_trace_{tag}_measured_service.jsonl"
    return out | {
        "measured_service_variant": measured_service(cluster, trace, pairs, http_ms, path, args)
    }


def measured_service(cluster, trace: list[dict], pairs, http_ms: float, path: Path, args) -> dict:
    """Diagnostic, not a prediction: the deterministic model (`cluster`) with each load-phase
    request's prompt scaled so that its simulated prefill takes what the live one measured."""
    ratio = service_ratios(pairs, cluster)
    varied = [
        rec
        | {"num_prompt_tokens": max(1, round(rec["num_prompt_tokens"] * ratio.get(id(rec), 1.0)))}
        for rec in trace
    ]
    sims = [
        {id(rec): v for rec, v in zip(trace, sim.values())}
        for sim in replay(cluster, varied, path, args, 1)
    ]
    r = np.array(list(ratio.values()))
    return {
        "service_ratio": pcts(r) | {"cv": round(float(r.std() / r.mean()), 3)},
        **compare(pairs, sims, http_ms),
    }
