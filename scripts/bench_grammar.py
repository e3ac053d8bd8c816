#!/usr/bin/env python
"""Structured outputs' cost per decode step: one batch (default 32 rows) with no row, half
the rows and every row held to a JSON schema, step time p50 against the all-free batch of
the same run, and whether the free rows' tokens stayed the same beside constrained ones.

Usage: scripts/bench_grammar.py [--config configs/bench_cpu.yaml] [--batch 32] [--steps 32]
"""

from __future__ import annotations

import argparse
import json

import torch

from actors.models.adapter import Part, load_adapter
from cluster.config import REPO_ROOT, load_config
from cluster.prepare import ensure_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO_ROOT / "configs" / "bench_cpu.yaml"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from benchkit.grammar_steps import grammar_table

    cfg = ensure_model(load_config(args.config))
    torch.set_num_threads(args.threads)
    lm = load_adapter(
        cfg.model.checkpoint_path, part=Part.LANGUAGE_MODEL, dtype=cfg.model.dtype, device="cpu"
    )
    result = grammar_table(lm, args.batch, args.steps, args.prompt_tokens)
    print(json.dumps({"model": cfg.model.served_name, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
