#!/usr/bin/env python
"""The prefill engine alone (actors/engine/prefill.py, no Ray), on the bench-llava LM, in
one process, each figure against its baseline in the same run:

1. Multi-turn with the same image: turn 2 repeats turn 1's prompt and image, adds a reply
   and a question. Prefill ms of turn 1 (cold), of turn 2 with the prefix cache, and of
   turn 2 on an engine without one; the prefix hit rate of turn 2's prompt tokens.
2. Short prompts behind a long one: one long prompt and `--shorts` short ones reach the
   worker together; ms until each short one has its first token, shortest-remaining-first
   against a queue (arrival order), same budget per step.
3. Encode/prefill overlap: a request with `--text-tokens` of text before one
   image; the encoder runs in a thread of its own while the engine steps, either replaying
   its measured time as a wait (an encoder on its own core or device, as in the cluster) or
   really encoding on this host's cores. ms from the start to the first token with overlap
   (the request goes in at once, the image follows through `add_item`) against without
   (encode, then add the request whole).
4. A burst: `--burst` text prompts of 20-60 tokens reach the worker together; ms until each
   has its first token (p50, p99; the last is the burst's whole prefill), with the prompts a
   step plans together packed into one forward against one prompt a forward.
5. A new turn mid-chunk: a conversation's `--history-tokens` are in the prefix cache; its new
   turn (`--turn-tokens` more) arrives during the first chunk of a `--long-tokens` prompt. ms
   from its arrival to its first token, judged past its cached prefix (the engine's rule)
   against by its whole length (the rule before 2026-12-02), alternating.

Stage timings only (no encode, transfer or decode): the live figures come from
scripts/bench_modalities.py (phase multi_turn) on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from actors.engine.lm_runner import LMRunner
from actors.engine.prefill import PrefillEngine
from actors.models.adapter import Part, load_adapter
from actors.types import MediaItem, PrefillRequest, SamplingParams
from benchkit.stats import pct
from cluster.config import REPO_ROOT, load_config
from cluster.media.identifiers import media_identifier
from cluster.prepare import ensure_model
from cluster.prompt_plan import PromptPlanner
from router.prefill_schedule import Order
from router.types import Modality
from router.worker_settings import PrefillSettings

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def run(
    engine: PrefillEngine, requests: list[tuple[PrefillRequest, list[torch.Tensor]]]
) -> dict[str, tuple[float, int]]:
    """Add all at once, step to the end: per request (ms from the add to its first token,
    cached tokens)."""
    started, out = time.perf_counter(), {}
    for request, items in requests:
        engine.add(request, items)
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] = ((time.perf_counter() - started) * 1e3, o.num_cached_tokens)
    return out


def request(planner, name: str, messages: list[dict], items: list[MediaItem]) -> PrefillRequest:
    plan = planner.plan(messages, items)
    return PrefillRequest(
        name,
        plan.token_ids,
        plan.placeholders,
        GREEDY,
        media_identifiers=tuple(i.identifier for i in plan.items),
    )


def multi_turn(planner, lm, encoder, args) -> dict:
    rng, budget = np.random.default_rng(11), args.budget
    cached = PrefillSettings(budget, prefix_block_tokens=args.block, prefix_cache_mb=256)
    warm = PrefillEngine(LMRunner(lm), cached)
    cold = PrefillEngine(LMRunner(lm), PrefillSettings(budget, prefix_block_tokens=args.block))
    t1, t2, t2_cold, hit, total = [], [], [], 0, 0
    for i in range(args.conversations):
        array = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        item = MediaItem(
            Modality.IMAGE, media_identifier("bench", Modality.IMAGE, array), data=array
        )
        [emb] = encoder.encode([item])
        first = [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": f"What is in this picture, case {i}?"},
                ],
            }
        ]
        second = first + [
            {"role": "assistant", "content": "A picture of coloured noise."},
            {"role": "user", "content": [{"type": "text", "text": "Which colour is most common?"}]},
        ]
        r1, r2 = request(planner, f"a{i}", first, [item]), request(planner, f"b{i}", second, [item])
        t1.append(run(warm, [(r1, [emb])])[r1.request_id][0])
        ms, cached = run(warm, [(r2, [emb])])[r2.request_id]
        t2.append(ms)
        hit, total = hit + cached, total + len(r2.prompt_token_ids)
        t2_cold.append(run(cold, [(r2, [emb])])[r2.request_id][0])
    warm.pool.check_integrity()
    med = statistics.median
    return {
        "turn1_prefill_ms_p50": med(t1),
        "turn2_prefill_ms_p50": med(t2),
        "turn2_no_prefix_cache_ms_p50": med(t2_cold),
        "ratio_turn2_vs_turn1": med(t2) / med(t1),
        "ratio_turn2_cache_vs_none": med(t2) / med(t2_cold),
        "turn2_prefix_hit_rate": hit / total,
        "turn2_prompt_tokens": total // args.conversations,
    }


def short_behind_long(lm, args) -> dict:
    rng = np.random.default_rng(5)
    long = PrefillRequest(
        "long", tuple(int(t) for t in rng.integers(10, 1000, args.long_tokens)), (), GREEDY
    )
    shorts = [
        PrefillRequest(f"s{i}", tuple(int(t) for t in rng.integers(10, 1000, 40)), (), GREEDY)
        for i in range(args.shorts)
    ]
    out = {}
    for order in (
        Order.ARRIVAL,
        Order.SHORTEST_REMAINING,
        Order.ARRIVAL,
        Order.SHORTEST_REMAINING,
    ):  # twice each: this host is noisy
        got = run(
            PrefillEngine(LMRunner(lm), PrefillSettings(args.budget), order=order),
            [(r, []) for r in [long, *shorts]],
        )
        row = out.setdefault(order.value, {"short_ms": [], "long_ms": []})
        row["short_ms"].append(statistics.median(got[r.request_id][0] for r in shorts))
        row["long_ms"].append(got["long"][0])
    summary = {order: {k: min(v) for k, v in row.items()} for order, row in out.items()}
    srf, queue = summary[Order.SHORTEST_REMAINING.value], summary[Order.ARRIVAL.value]
    return {
        **summary,
        "short_ratio_srf_vs_queue": srf["short_ms"] / queue["short_ms"],
        "long_ratio_srf_vs_queue": srf["long_ms"] / queue["long_ms"],
    }


def burst(lm, args) -> dict:
    rng = np.random.default_rng(9)
    prompts = [
        PrefillRequest(f"b{i}", tuple(int(t) for t in rng.integers(10, 1000, n)), (), GREEDY)
        for i, n in enumerate(rng.integers(20, 61, args.burst))
    ]
    out = {}
    for packed in (True, False, True, False, True, False):  # alternating: this host is noisy
        settings = PrefillSettings(args.budget, pack_prompts=packed)
        got = run(PrefillEngine(LMRunner(lm), settings), [(r, []) for r in prompts])
        ms = [t for t, _ in got.values()]
        row = out.setdefault("packed" if packed else "one_a_forward", {})
        for q in (50, 99):
            row.setdefault(f"first_token_ms_p{q}", []).append(pct(ms, q))
    summary = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in out.items()}
    packed, apart = summary["packed"], summary["one_a_forward"]
    return {
        **summary,
        "prompts": args.burst,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in prompts),
        "p50_ratio_packed_vs_apart": packed["first_token_ms_p50"] / apart["first_token_ms_p50"],
        "p99_ratio_packed_vs_apart": packed["first_token_ms_p99"] / apart["first_token_ms_p99"],
    }


def ttft_ms(
    engine: PrefillEngine,
    request: PrefillRequest,
    encode: Callable[[], torch.Tensor],
    overlap: bool,
) -> float:
    """ms from the start to the first token; `encode` runs in a thread of its own."""
    started, encoded = time.perf_counter(), {}

    def encoder_thread() -> None:
        encoded["emb"] = encode()
        if overlap:
            engine.add_item(request.request_id, 0, encoded["emb"])

    thread = threading.Thread(target=encoder_thread)
    thread.start()
    if overlap:
        engine.add(request)
    else:
        thread.join()
        engine.add(request, [encoded["emb"]])
    while not engine.step():
        if not engine.has_work:  # the text is done and the image not here yet
            thread.join()
    thread.join()
    return (time.perf_counter() - started) * 1e3


def encoders(encoder, item: MediaItem) -> dict[str, Callable[[], torch.Tensor]]:
    """`separate`: the encoder on its own core or device, as in the cluster: its measured
    time is replayed as a wait. `same_process`: it encodes here, sharing this host's cores."""
    times, emb = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        [emb] = encoder.encode([item])
        times.append(time.perf_counter() - t0)
    encode_s = statistics.median(times)

    def here() -> torch.Tensor:
        torch.set_num_threads(1)  # as the workers run
        return encoder.encode([item])[0]

    return {
        "separate": lambda: time.sleep(encode_s) or emb,
        "same_process": here,
        "encode_ms": encode_s * 1e3,
    }


def overlap_encode(planner, lm, encoder, args) -> dict:
    rng, text = (
        np.random.default_rng(13),
        " ".join(f"note{i % 97}" for i in range(args.text_tokens * 2 // 7)),
    )
    rows: dict[tuple[str, bool], list[float]] = {}
    encode_ms = []
    for trial in range(-1, args.overlap_trials):  # trial -1 warms up, untimed
        array = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        item = MediaItem(
            Modality.IMAGE, media_identifier("bench", Modality.IMAGE, array), data=array
        )
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image"},
                    {"type": "text", "text": "What now?"},
                ],
            }
        ]
        req = request(planner, f"o{trial}", messages, [item])
        arms = encoders(encoder, item)
        encode_ms.append(arms.pop("encode_ms"))
        for mode, encode in arms.items():
            for overlap in (
                (False, True) if trial % 2 else (True, False)
            ):  # alternate who goes first: this host drifts
                measured = ttft_ms(
                    PrefillEngine(LMRunner(lm), PrefillSettings(args.budget)), req, encode, overlap
                )
                rows.setdefault((mode, overlap), []).extend([measured] if trial >= 0 else [])
    med = statistics.median
    report = {
        "prompt_tokens": len(req.prompt_token_ids),
        "text_tokens_before_image": req.placeholders[0].offset,
        "image_tokens": req.placeholders[0].length,
        "encode_ms_p50": med(encode_ms),
    }
    for mode in ("separate", "same_process"):
        off, on = rows[(mode, False)], rows[(mode, True)]
        report[f"encoder_{mode}"] = {
            "ttft_ms_p50_overlap_off": med(off),
            "ttft_ms_p50_overlap_on": med(on),
            "ratio_on_vs_off_p50": med(on) / med(off),
            "ratio_on_vs_off_min": min(on)
            / min(off),  # the least disturbed run of each: this host is shared
            "ratio_paired_p50": med(
                a / b for a, b in zip(on, off)
            ),  # each trial's on/off pair ran back to back
        }
    return report


def turn_mid_chunk(lm, args) -> dict:
    rng = np.random.default_rng(11)
    tokens = lambda n: tuple(int(t) for t in rng.integers(10, 1000, n))  # noqa: E731
    history, long = tokens(args.history_tokens), tokens(args.long_tokens)
    turn = PrefillRequest("turn", history + tokens(args.turn_tokens), (), GREEDY)
    out: dict[str, list[float]] = {}
    for past_cache in (True, False) * 3:  # alternating: this host is noisy
        settings = PrefillSettings(
            args.budget,
            prefix_block_tokens=args.block,
            prefix_cache_mb=64.0,
            preempt_at_layers=True,
        )
        engine = PrefillEngine(LMRunner(lm), settings)
        run(engine, [(PrefillRequest("earlier", history + tokens(8), (), GREEDY), [])])
        engine.step()  # the earlier prompt's blocks go into the cache
        if not past_cache:
            engine._cached_tokens = lambda job: 0  # the rule before: by the whole prompt
        times = _first_token_mid_chunk(engine, PrefillRequest("long", long, (), GREEDY), turn)
        out.setdefault("past_cache" if past_cache else "whole_length", []).append(times)
    summary = {name: statistics.median(ms) for name, ms in out.items()}
    return {
        "turn_first_token_ms": summary,
        "ratio": summary["past_cache"] / summary["whole_length"],
        "runs": out,
    }


def _first_token_mid_chunk(engine: PrefillEngine, long: PrefillRequest, turn) -> float:
    """ms from `turn`'s arrival (during the first layer of `long`'s first chunk, as from the
    worker's loop while its device thread computes) to its first token."""
    seen: dict[str, float] = {}
    engine.on_early = lambda outs: seen.update((o.request_id, time.perf_counter()) for o in outs)

    def arrive(_module, _args) -> None:
        handle.remove()
        seen["added"] = time.perf_counter()
        engine.add(turn)

    handle = engine.runner.adapter.decoder_layers()[0].register_forward_pre_hook(arrive)
    engine.add(long)
    while engine.has_work:
        for output in engine.step():
            seen.setdefault(output.request_id, time.perf_counter())
    return (seen["turn"] - seen["added"]) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "bench_cpu.yaml"))
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--budget", type=int, default=512, help="tokens per prefill step")
    p.add_argument("--block", type=int, default=16, help="prefix block tokens")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--shorts", type=int, default=4)
    p.add_argument(
        "--text-tokens",
        type=int,
        default=1000,
        help="overlap: about this much text before the image",
    )
    p.add_argument("--overlap-trials", type=int, default=6)
    p.add_argument("--burst", type=int, default=32, help="burst: prompts at once")
    p.add_argument("--history-tokens", type=int, default=640, help="turn_mid_chunk: cached")
    p.add_argument("--turn-tokens", type=int, default=20, help="turn_mid_chunk: the new turn")
    p.add_argument(
        "--only",
        choices=["multi_turn", "short_behind_long", "overlap_encode", "burst", "turn_mid_chunk"],
        help="run one phase",
    )
    p.add_argument("--out", default="/tmp/bench_prefill_engine.json")
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    ensure_model(cfg)
    torch.set_num_threads(1)  # as the workers run
    ckpt = cfg.model.checkpoint_path
    lm = load_adapter(
        ckpt, part=Part.LANGUAGE_MODEL, dtype=cfg.model.dtype, device=cfg.model.device
    )
    encoder = load_adapter(ckpt, part=Part.ENCODER, dtype=cfg.model.dtype, device=cfg.model.device)
    planner = PromptPlanner(ckpt)
    phases = {
        "multi_turn": lambda: multi_turn(planner, lm, encoder, args),
        "short_behind_long": lambda: short_behind_long(lm, args),
        "overlap_encode": lambda: overlap_encode(planner, lm, encoder, args),
        "burst": lambda: burst(lm, args),
        "turn_mid_chunk": lambda: turn_mid_chunk(lm, args),
    }
    report = {"config": args.config, "args": vars(args)}
    report.update(
        {name: run_phase() for name, run_phase in phases.items() if args.only in (None, name)}
    )
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
