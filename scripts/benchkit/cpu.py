"""CPU seconds per process: the /proc process table, and CpuWatch, which charges a phase's
CPU time to the processes of this tree and warns about what other processes used."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# /proc/stat's aggregate cpu line, the fields counted busy: user nice system irq softirq
BUSY_FIELDS = (0, 1, 2, 5, 6)


def procs() -> dict[int, tuple[str, int, float]]:
    """pid -> (name, parent pid, CPU seconds incl. reaped children), from /proc."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").glob("[0-9]*"):
        try:
            name, rest = (d / "stat").read_text()[:-1].split(" (", 1)[1].rsplit(") ", 1)
            f = rest.split()
            out[int(d.name)] = (name, int(f[1]), sum(int(x) for x in f[11:15]) / tick)
        except (OSError, IndexError, ValueError):
            continue
    return out


def ray_running() -> bool:
    """A raylet or GCS on this host (`ray status` misses token-auth ones)."""
    return any(name in ("raylet", "gcs_server") for name, _, _ in procs().values())


class CpuWatch:
    """CPU seconds per process name in this process tree (Ray's raylet, GCS and workers
    descend from this driver), and what processes outside it used meanwhile: other work
    on the host skews every figure, so it is recorded and warned about."""

    def __enter__(self):
        self.start = self._snapshot()
        return self

    def __exit__(self, *exc):
        end = self._snapshot()
        self.other_cpu_s = max(0.0, end.pop("<other>") - self.start.pop("<other>"))
        used = {k: round(v - self.start.get(k, 0.0), 2) for k, v in end.items()}
        self.by_process = dict(sorted(used.items(), key=lambda kv: -kv[1]))
        if self.other_cpu_s > 2.0:
            print(
                f"warning: other processes used {self.other_cpu_s:.1f} CPU-s during this phase",
                file=sys.stderr,
            )

    @staticmethod
    def _snapshot() -> dict[str, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        busy_s = sum(fields[i] for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")
        table, tree, frontier = procs(), {os.getpid()}, [os.getpid()]
        while frontier:
            kids = [
                pid
                for pid, (_, ppid, _) in table.items()
                if ppid == frontier[-1] and pid not in tree
            ]
            frontier = frontier[:-1] + kids
            tree.update(kids)
        out = {}
        for pid in tree & table.keys():
            name = "driver (client)" if pid == os.getpid() else table[pid][0]
            out[name] = out.get(name, 0.0) + table[pid][2]
        return out | {"<other>": busy_s - sum(out.values())}
