"""The request log line (cluster/request_log.py) and the TTFT phases it shares with the
response's `timings` and the trace (RequestTimings.phases_ms): plain logic, no Ray."""

from __future__ import annotations

import pytest

from cluster.admitted import AdmissionTimings
from cluster.request_log import RequestRecord
from cluster.request_path import RequestTimings

PATH_ORDER = [
    "handover_ms",
    "body_ms",
    "parse_ms",
    "media_ms",
    "plan_ms",
    "admit_ms",
    "route_ms",
    "encode_hop_in_ms",
    "pixels_fetch_ms",
    "encode_queue_ms",
    "encode_compute_ms",
    "transfer_ms",
    "prefill_hop_in_ms",
    "prefill_queue_ms",
    "item_wait_ms",
    "prefill_compute_ms",
    "prefill_publish_ms",
    "prefill_hop_out_ms",
    "first_token_ms",
]


def _image_request() -> tuple[RequestTimings, AdmissionTimings]:
    trace = RequestTimings(
        ttft_ms=20.0,
        admitted_ms=4.4,
        route_ms=0.3,
        encode_hop_in_ms=1.4,
        encode_queue_ms=0.04,
        encode_compute_ms=5.4,
        transfer_ms=1.4,
        prefill_call_ms=14.3,
        prefill_hop_in_ms=1.0,
        prefill_hop_out_ms=0.4,
        prefill_queue_ms=0.2,
        prefill_compute_ms=3.4,
        prefill_publish_ms=0.3,
        item_wait_ms=8.3,
    )
    return trace, AdmissionTimings(0.9, 0.1, 0.3, 2.0, 0.7)


def test_phases_in_path_order_and_first_token_is_the_rest():
    trace, admission = _image_request()
    phases = trace.phases_ms(admission)
    assert list(phases) == PATH_ORDER
    assert phases["first_token_ms"] == pytest.approx(20.0 - 4.4 - 0.3 - 14.3)
    assert phases["media_ms"] == 2.0 and phases["encode_compute_ms"] == 5.4
    trace.ttft_ms = None  # not there yet: nothing negative
    assert trace.phases_ms(admission)["first_token_ms"] == 0.0


def test_log_line_carries_the_phases_that_print_as_more_than_zero():
    trace, admission = _image_request()
    line = RequestRecord(
        "chatcmpl-1", "ok", 42, 2, 20.0, 31.0, "length", phases_ms=trace.phases_ms(admission)
    ).line()
    assert line.startswith("request chatcmpl-1 ")
    assert " ttft_ms=20.0 e2e_ms=31.0 handover_ms=0.9 body_ms=0.1 " in line
    assert " encode_compute_ms=5.4 transfer_ms=1.4 " in line
    assert line.endswith(" first_token_ms=1.0")
    assert "encode_queue_ms" not in line and "pixels_fetch_ms" not in line  # 0.04 and 0.0
    shown = [part.split("=")[0] for part in line.split() if part.endswith(tuple("0123456789"))]
    phases = [name for name in shown if name in PATH_ORDER]
    assert phases == [n for n in PATH_ORDER if n not in ("encode_queue_ms", "pixels_fetch_ms")]


def test_log_line_without_phases_is_as_before():
    line = RequestRecord("r", "400", x_request_id="x").line()
    assert line == "request r x_request_id=x status=400 prompt_tokens=0 completion_tokens=0"
    with_prompt = RequestRecord("r", "ok", 3, 1, 5.0, 6.0, "stop", "hi", {}, "x").line()
    assert with_prompt.endswith("ttft_ms=5.0 e2e_ms=6.0 prompt='hi'")
