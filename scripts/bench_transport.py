#!/usr/bin/env python
"""Tensor transport between two worker actors: Ray object store vs Ray Direct Transport.

Moves tensors of KV-cache sizes from a sender actor to a receiver actor through each
transport and reports bandwidth and latency, so the default per placement is chosen by
measurement. Usage: scripts/bench_transport.py [--sizes-mib 1 16 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch
from tqdm import tqdm

ENV = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}


@ray.remote(enable_tensor_transport=True, runtime_env=ENV)
class Sender:
    def make(self, num_bytes: int) -> torch.Tensor:
        return torch.ones(num_bytes // 4, dtype=torch.float32)


@ray.remote(enable_tensor_transport=True, runtime_env=ENV)
class Receiver:
    def take(self, tensor: torch.Tensor) -> float:
        return float(tensor[-1])  # touch the data so a lazy transfer is not mistaken for a fast one


def measure(sender, receiver, num_bytes: int, transport: str | None, repeats: int) -> list[float]:
    times = []
    options = {"tensor_transport": transport} if transport else {}
    for _ in range(repeats + 1):
        ref = sender.make.options(**options).remote(num_bytes)
        ray.wait([ref], fetch_local=False)  # time the transfer, not the tensor's creation
        started = time.perf_counter()
        ray.get(receiver.take.remote(ref))
        times.append(time.perf_counter() - started)
    return times[1:]  # the first call warms the connection up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    from ray.experimental.collective import create_collective_group

    sender, receiver = Sender.remote(), Receiver.remote()
    create_collective_group([sender, receiver], backend="torch_gloo")
    rows = []
    for mib in tqdm(args.sizes_mib, desc="sizes"):
        num_bytes = int(mib * 2**20)
        for name, transport in (("object_store", None), ("gloo", "gloo")):
            median_s = statistics.median(
                measure(sender, receiver, num_bytes, transport, args.repeats)
            )
            rows.append(
                {
                    "transport": name,
                    "size_mib": mib,
                    "median_ms": median_s * 1e3,
                    "gib_per_s": num_bytes / median_s / 2**30,
                }
            )
    print(f"{'transport':<14}{'MiB':>8}{'median ms':>12}{'GiB/s':>8}")
    for row in rows:
        print(
            f"{row['transport']:<14}{row['size_mib']:>8g}"
            f"{row['median_ms']:>12.2f}{row['gib_per_s']:>8.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
