#!/usr/bin/env python
"""Decode against the model's own speed, each figure with its baseline from the same run:

1. engine: the decode engine alone (no Ray): step ms minus the plain forward's ms at
   B = 1, 8, 32, 64, and host syncs per step (scripts/benchkit/decode_engine.py).
2. http: TPOT p50 of `--streams` concurrent streams (64 tokens each, ignore_eos) over HTTP
   against the checkpoint's own `generate` stepping the same batch in one process,
   `(t(65 new) - t(1 new)) / 64`; and the ingress's and proxy's CPU per token.
3. detok: the ingress's detokenizer, microseconds per token at 10 and 1,000 tokens.
4. shared: the engine at `--batch-sizes`' first size beside a prefill process on the same
   device, against the same steps alone (scripts/benchkit/decode_shared.py); not run unless
   asked for.

On a GPU, the engine and shared phases time eager steps and CUDA-graph replays.

Usage: scripts/bench_decode.py [--config configs/local_cpu.yaml] [--only engine|http|detok|shared]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from actors.models.adapter import Part, load_adapter
from benchkit.live_server import add_front_door_flag
from cluster.config import DEFAULT_CONFIG, load_config
from cluster.prepare import ensure_model

PHASES = ("engine", "http", "detok")  # what runs without --only


def engine_phase(cfg, args) -> dict:
    from benchkit.decode_engine import overhead_table

    torch.set_num_threads(args.threads)

    lm = load_adapter(
        cfg.model.checkpoint_path,
        part=Part.LANGUAGE_MODEL,
        dtype=cfg.model.dtype,
        device=args.device or cfg.model.device,
    )
    if args.profile:
        from benchkit.decode_engine import profile_forward

        print(profile_forward(lm, args.prompt_tokens, args.profile), flush=True)
    rows = overhead_table(lm, args.batch_sizes, args.steps, args.prompt_tokens)
    return {"device": str(lm.device), "rows": rows}


def http_phase(cfg, args) -> dict:
    from benchkit.decode_http import cluster_tpot, generate_tpot_ms
    from benchkit.live_server import served, with_front_door

    cfg = cfg.replace(decode={"max_batch_size": max(cfg.decode.max_batch_size, args.streams)})
    cfg = with_front_door(cfg, args.front_door)
    with served(cfg) as base:
        cluster = cluster_tpot(
            base, cfg.model.served_name, args.streams, args.new_tokens, args.rounds
        )
    # every thread count one process could use here, whatever the config lets a worker use
    threads = sorted({1, min(2, len(os.sched_getaffinity(0))), cfg.decode.torch_threads})
    baselines = {
        f"generate_{t}t_tpot_ms": round(generate_tpot_ms(cfg, args.streams, args.new_tokens, t), 3)
        for t in threads
    }
    best = min(baselines.values())
    return {
        "front_door": cfg.server.front_door.value,
        "streams": args.streams,
        "cluster": cluster,
        **baselines,
        "tpot_ratio_vs_best_generate": round(cluster["tpot_ms_p50"] / best, 2),
    }


def shared_phase(cfg, args) -> dict:
    from benchkit.decode_shared import shared_table

    device = args.device or cfg.model.device
    return shared_table(
        cfg.model.checkpoint_path,
        cfg.model.dtype,
        device,
        args.batch_sizes[0],
        args.steps,
        args.prompt_tokens,
        args.prefill_tokens,
        args.threads,
    )


def detok_phase(cfg, args) -> dict:
    from transformers import AutoTokenizer

    from benchkit.detok import detok_table

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.checkpoint_path)
    return {f"us_per_token_at_{n}": round(us, 2) for n, us in detok_table(tokenizer).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--only", choices=(*PHASES, "shared"), action="append", help="run these")
    p.add_argument("--device", help="engine phase: override the config's device")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--steps", type=int, default=32, help="engine phase: timed steps per size")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="engine phase: torch threads")
    p.add_argument("--profile", type=int, metavar="B", help="engine phase: profile B-row forwards")
    p.add_argument("--prefill-tokens", type=int, default=512, help="shared phase: a prompt")
    p.add_argument("--streams", type=int, default=32, help="http phase: concurrent streams")
    p.add_argument("--new-tokens", type=int, default=64, help="http phase: tokens a stream")
    p.add_argument("--rounds", type=int, default=3, help="http phase: measured rounds")
    p.add_argument("--out", default="/tmp/bench_decode.json")
    add_front_door_flag(p)
    args = p.parse_args(argv)
    cfg = ensure_model(load_config(args.config))
    phases = {
        "engine": engine_phase,
        "http": http_phase,
        "detok": detok_phase,
        "shared": shared_phase,
    }
    report = {"config": args.config, "args": vars(args)}
    for name in args.only or PHASES:
        if name in phases:
            report[name] = phases[name](cfg, args)
            print(name, json.dumps(report[name], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
