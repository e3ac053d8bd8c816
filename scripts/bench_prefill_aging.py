#!/usr/bin/env python
r"""Shortest-remaining-first with aging (prefill.aging_tokens_per_s) on the real prefill engine
(actors/engine/prefill.py, no Ray), the bench-llava LM, one process, in real time.

Text prompts of 120-1343 tokens (shape C's range) arrive as a Poisson stream at `--load` of
the engine's capacity, measured first from prompts run alone. The same arrivals run once per
aging setting, the settings alternating over `--rounds` rounds (this host drifts). Per setting:
TTFT percentiles (arrival to the prompt's first token: queue and prefill) and each against
aging 0 in the same round. Writes a JSON report and a plot of the TTFT distributions.

`--simulate` runs the router's simulator instead, on shape C (two prefill workers of speeds 1
and 0.25, scripts/bench_busy.py) under joint and least_loaded, per load, 6,000 requests, the
mean over `--seeds`: TTFT (queue, prefill and the rest of the path) against the first setting.

    .venv/bin/python scripts/bench_prefill_aging.py --aging 0 100 --load 0.85 \
        --requests 200 --rounds 2
    .venv/bin/python scripts/bench_prefill_aging.py --simulate --aging 0 50 100 200 \
        --loads 0.5 0.8 0.9
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from actors.engine.lm_runner import LMRunner
from actors.engine.prefill import PrefillEngine
from actors.models.adapter import Part, load_adapter
from actors.types import PrefillRequest, SamplingParams
from cluster.config import REPO_ROOT, load_config
from cluster.prepare import ensure_model
from router.worker_settings import PrefillSettings

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
PERCENTILES = (50, 90, 99, 100)


def prompt(rng: np.random.Generator, num_tokens: int, vocab: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(10, vocab, num_tokens))


def ms_per_token(lm, budget: int, prompts: list[tuple[int, ...]]) -> float:
    """Service per prompt token, from prompts prefilled alone (the capacity the load is a
    share of)."""
    engine = PrefillEngine(LMRunner(lm, budget), PrefillSettings(budget))
    tokens, started = 0, time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add(PrefillRequest(f"probe{i}", ids, (), GREEDY))
        while engine.has_work:
            engine.step()
        tokens += len(ids)
    return (time.perf_counter() - started) * 1e3 / tokens


def replay(
    lm, budget: int, aging: float, prompts: list[tuple[int, ...]], arrivals_s: np.ndarray, bar
) -> np.ndarray:
    """Feed the prompts at their arrival times, step while there is work; TTFT ms of each."""
    engine = PrefillEngine(LMRunner(lm, budget), PrefillSettings(budget, aging_tokens_per_s=aging))
    ttft_ms, nxt, t0 = np.full(len(prompts), np.nan), 0, time.perf_counter()
    while nxt < len(prompts) or engine.has_work:
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals_s[nxt] <= now:
            engine.add(PrefillRequest(str(nxt), prompts[nxt], (), GREEDY))
            nxt += 1
        if not engine.has_work:
            time.sleep(max(0.0, arrivals_s[nxt] - now))
            continue
        for out in engine.step():
            i = int(out.request_id)
            ttft_ms[i] = (time.perf_counter() - t0 - arrivals_s[i]) * 1e3
            bar.update()
    return ttft_ms


def plot(results: dict[float, list[np.ndarray]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for aging, runs in results.items():
        ttft = np.sort(np.concatenate(runs))
        ax.plot(
            ttft / 1e3, np.arange(1, len(ttft) + 1) / len(ttft), label=f"aging {aging:g} tokens/s"
        )
    ax.set(
        xscale="log", xlabel="TTFT (s), prefill only", ylabel="fraction of requests", title=title
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def simulated_shape_c(args) -> None:
    from benchkit.sim_shapes import two_workers
    from router.sim.cluster_model import capacity_rps
    from router.sim.loop import simulate

    print(
        "shape C, simulated: TTFT ms p50 / p90 / p99 / max (mean over seeds), "
        "and against the first setting"
    )
    for load in args.loads:
        for policy in ("joint", "least_loaded"):
            base = None
            for aging in args.aging:
                rows = []
                for seed in args.seeds:
                    cluster, wl = two_workers(6000, seed)
                    cluster = cluster.with_prefill(aging_tokens_per_s=aging)
                    r = simulate(
                        cluster, wl.at_rate(load * capacity_rps(cluster, wl)), policy, seed=seed
                    )
                    rows.append(np.percentile(r.ttft_ms, PERCENTILES))
                q = np.mean(rows, axis=0)
                base = q if base is None else base
                print(
                    f"  load {load:.0%} {policy:<13} aging {aging:6g}: "
                    + " / ".join(f"{v:7.0f}" for v in q)
                    + "   "
                    + " / ".join(f"{x:.2f}" for x in q / base)
                )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "bench_cpu.yaml"))
    p.add_argument(
        "--aging",
        type=float,
        nargs="+",
        default=[0.0, 100.0],
        help="settings to compare; the first is the baseline",
    )
    p.add_argument("--load", type=float, default=0.85, help="share of the measured capacity")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--budget", type=int, default=512, help="tokens per prefill step")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="/tmp/bench_prefill_aging.json")
    p.add_argument(
        "--simulate", action="store_true", help="the simulator on shape C instead of the engine"
    )
    p.add_argument(
        "--loads", type=float, nargs="+", default=[0.5, 0.8, 0.9], help="with --simulate"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="with --simulate")
    args = p.parse_args(argv)
    if args.simulate:
        simulated_shape_c(args)
        return 0
    cfg = load_config(args.config)
    ensure_model(cfg)
    torch.set_num_threads(1)  # as the workers run
    lm = load_adapter(
        cfg.model.checkpoint_path,
        part=Part.LANGUAGE_MODEL,
        dtype=cfg.model.dtype,
        device=cfg.model.device,
    )
    vocab, rng = lm.config.text_config.vocab_size, np.random.default_rng(args.seed)
    lengths = rng.integers(120, 1344, args.requests)
    prompts = [prompt(rng, int(n), vocab) for n in lengths]
    per_token_ms = ms_per_token(lm, args.budget, prompts[:12])
    rate = args.load / (per_token_ms * lengths.mean() / 1e3)
    arrivals_s = np.cumsum(rng.exponential(1.0 / rate, args.requests))
    results: dict[float, list[np.ndarray]] = {a: [] for a in args.aging}
    with tqdm(
        total=args.rounds * len(args.aging) * args.requests, desc="prefills", unit="req"
    ) as bar:
        for r in range(args.rounds):
            for aging in args.aging if r % 2 == 0 else list(reversed(args.aging)):
                results[aging].append(replay(lm, args.budget, aging, prompts, arrivals_s, bar))
    base = args.aging[0]
    report = {"args": vars(args), "ms_per_token": per_token_ms, "rate_rps": rate, "settings": {}}
    for aging, runs in results.items():
        pct = [np.percentile(t, PERCENTILES) for t in runs]
        ratios = [
            (q / np.percentile(b, PERCENTILES)).round(3).tolist()
            for q, b in zip(pct, results[base])
        ]  # round by round
        report["settings"][str(aging)] = {
            "ttft_ms_p50_p90_p99_max": [q.round(1).tolist() for q in pct],
            f"vs_aging_{base:g}": ratios,
        }
    Path(args.out).write_text(json.dumps(report, indent=2))
    plot(
        results,
        Path(args.out).with_suffix(".png"),
        f"one prefill worker at {args.load:.0%} load, {args.requests} prompts x {args.rounds}",
    )
    print(
        f"{per_token_ms:.3f} ms a token alone; {rate:.2f} req/s offered ({args.load:.0%}); "
        "TTFT ms p50 / p90 / p99 / max, per round:"
    )
    for aging, row in report["settings"].items():
        for r, (q, ratio) in enumerate(
            zip(row["ttft_ms_p50_p90_p99_max"], row[f"vs_aging_{base:g}"])
        ):
            print(
                f"  aging {float(aging):6g}  round {r}: "
                + " / ".join(f"{v:8.0f}" for v in q)
                + "   vs baseline "
                + " / ".join(f"{x:.2f}" for x in ratio)
            )
    print(f"report {args.out}, plot {Path(args.out).with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
