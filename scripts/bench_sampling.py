"""Cost of the logits processors per decode step: sample_rows over one batch of logits with
no processor (the baseline), with penalties on every row (prompt + output history), and
with logprobs, in the same run. CPU, float32; prints ms per call and the ratio to baseline.

    python scripts/bench_sampling.py --batch 32 --vocab 32000 --prompt 1000 --output 200
"""

from __future__ import annotations

import argparse
import time

import torch

from actors.engine.sampling import sample_rows
from actors.types import SamplingParams, TokenHistory


def per_call_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--output", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine: one thread, as the workers run
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen)
    ids = torch.randint(
        0, args.vocab, (args.batch, args.prompt + args.output), generator=gen
    ).tolist()
    histories = [TokenHistory(tuple(r[: args.prompt]), tuple(r[args.prompt :])) for r in ids]
    positions = [args.prompt + args.output] * args.batch
    cases = {
        "greedy, no processor": [SamplingParams(temperature=0.0)] * args.batch,
        "greedy, all penalties": [
            SamplingParams(
                temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5
            )
        ]
        * args.batch,
        "greedy, top_logprobs 5": [SamplingParams(temperature=0.0, num_logprobs=5)] * args.batch,
    }
    base = None
    for name, params in cases.items():
        ms = per_call_ms(
            lambda params=params: sample_rows(logits, params, positions, histories), args.repeats
        )
        base = base or ms
        print(f"{name:26s} {ms:8.3f} ms/step  x{ms / base:.2f}")


if __name__ == "__main__":
    main()
