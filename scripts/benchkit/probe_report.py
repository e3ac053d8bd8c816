"""The hardening probe's results (scripts/probe_server.py): a row per bad-input case, a
phase's counts of outcomes, and the tables printed per phase and in the summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchkit.probe_client import Outcome
from benchkit.rss import GROUPS, KINDS


@dataclass
class BadRow:
    case: str
    modality: str | None
    applies: bool  # False: the case is about media the served model does not take
    status: int | None  # None: hang or connection error
    openai_shape: bool
    latency_ms: float
    message: str


@dataclass
class PhaseResult:
    phase: str
    cases: int = 0
    n2xx: int = 0
    n4xx: int = 0
    n5xx: int = 0
    hangs: int = 0
    lost: int = 0
    recover_s: float | None = None
    note: str = ""
    rss: dict = field(default_factory=dict)  # group -> [before, peak, after] MB
    rows: list = field(default_factory=list)


def count(result: PhaseResult, outcomes: list[Outcome]) -> None:
    for o in outcomes:
        status = o.status or 0
        result.cases += 1
        result.n2xx += 200 <= status < 300 and not (o.lost or o.broken)
        result.n4xx += 400 <= status < 500
        result.n5xx += status >= 500 or (
            status == 200 and (o.lost or o.broken)
        )  # in-band errors are server errors
        result.hangs += o.hang
        result.lost += o.lost and not o.hang


def table(headers: list[str], rows: list[list]) -> str:
    cells = [
        [("-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)) for v in r]
        for r in rows
    ]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def print_phase(result: PhaseResult) -> None:
    print(f"\n== {result.phase}: {result.note}")
    if result.phase == "bad":
        print(
            table(
                ["case", "media", "applies", "status", "openai_shape", "ms", "message"],
                [
                    [
                        r.case,
                        r.modality or "",
                        r.applies,
                        r.status if r.status else "HANG/ERR",
                        r.openai_shape if (r.status or 0) >= 400 else "",
                        r.latency_ms,
                        r.message,
                    ]
                    for r in result.rows
                ],
            )
        )
    print(
        table(
            ["process", "RSS MB before", "peak", "after"],
            [[g, *result.rss.get(g, [None] * 3)] for g in GROUPS],
        )
    )


def print_summary(results: list[PhaseResult]) -> None:
    def mb(r, groups):
        vals = [r.rss.get(g) for g in groups if r.rss.get(g)]
        return "/".join(f"{sum(v[i] for v in vals):.0f}" for i in range(3)) if vals else "-"

    rows = [
        [
            r.phase,
            r.cases,
            r.n2xx,
            r.n4xx,
            r.n5xx,
            r.hangs,
            r.lost,
            r.recover_s,
            mb(r, ["ingress"]),
            mb(r, KINDS),
        ]
        for r in results
    ]
    print("\n== summary (RSS in MB: before/peak/after; workers summed)")
    print(
        table(
            [
                "phase",
                "cases",
                "2xx",
                "4xx",
                "5xx",
                "hangs",
                "lost",
                "recover_s",
                "ingress RSS",
                "worker RSS",
            ],
            rows,
        )
    )
    print("\n".join(f"  {r.phase}: {r.note}" for r in results))
