"""Records the live cluster's requests as a JSONL trace the simulator replays
(router/sim/workload.py documents the format): arrival, profile, measured TTFT, plus
the router's estimate and the chosen workers, so simulated and measured can be compared."""

from __future__ import annotations

import json
import time
from pathlib import Path

from router.sim.trace_file import MEASURED_STAGES, profile_to_record
from router.types import RequestProfile, RouteDecision


class TraceWriter:
    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # line-buffered: a crash loses at most one line
        # The clock starts with the writer, not the first record: records are written at first
        # token, so a later-written request may have arrived earlier (the loader sorts them).
        self._start_s = time.perf_counter()

    def record(
        self,
        arrived_s: float,
        profile: RequestProfile,
        decision: RouteDecision,
        ttft_ms: float,
        timings=None,
        phases_ms: dict[str, float] | None = None,
    ) -> None:
        """`arrived_s` is a perf_counter reading; the trace counts from the writer's creation.
        `timings`: anything with the measured encode_ms, prefill_queue_ms and prefill_ms (the
        request path's RequestTimings), recorded so the simulator can fit its variability from
        the trace. `phases_ms`: the request's TTFT phase by phase (RequestTimings.phases_ms),
        kept as they are for whoever reads the trace."""
        measured = (
            None if timings is None else {key: getattr(timings, key) for key in MEASURED_STAGES}
        )
        rec = profile_to_record(arrived_s - self._start_s, profile, ttft_ms, measured)
        rec["estimated_ttft_ms"] = round(decision.estimated_ttft_ms, 3)
        # its parts, so each stage's estimate can be set against what was measured
        rec["estimate_ms"] = {k: round(v, 3) for k, v in vars(decision.estimate).items()}
        rec["route"] = [decision.encoder, decision.prefill, decision.decode]
        if phases_ms is not None:
            rec["phases_ms"] = {k: round(v, 3) for k, v in phases_ms.items()}
        if decision.shares:  # split across encoders by modality
            rec["encoder_by_modality"] = dict(decision.encoder_by_modality)
        self._file.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self._file.close()
