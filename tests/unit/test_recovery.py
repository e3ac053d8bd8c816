"""Which failures under a request are a lost worker (retried elsewhere), which the request's."""

from __future__ import annotations

import asyncio

import ray.exceptions as rx

from cluster.errors import RequestError
from cluster.recovery import is_transport_failure, worker_code_failure

GROUP_GONE = (
    "Actor(PrefillWorker, 11c9cdb63f7b96edd1de152a01000000) does not have tensor transport "
    'GLOO available. If using a collective-based transport ("nccl" or "gloo"), please create a '
    "communicator with `ray.experimental.collective.create_collective_group` before calling "
    "actor tasks with non-default tensor_transport."
)
NO_COMMUNICATORS = (
    "No communicators found for actors Actor(EncoderWorker, 70de3a400503c8ec824840e101000000) "
    "and Actor(PrefillWorker, bfdd708a6d86ecda6c469c9701000000). Create a communicator with "
    "`ray.experimental.collective.create_collective_group` before calling actor tasks. with "
    "non-default tensor_transport."
)
# Seen in the suite (CI, 2026-11-27): a request's transfer as Ray re-formed the group.
PEER_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
    "peer [127.0.0.1]:16793. This is typically caused by a remote worker crashing."
)
ABORTED = "ObjectRef(09b273cb) not found in RDT object store after 60.0s, transfer may have failed."


def _task_error(cause: BaseException) -> rx.RayTaskError:
    return rx.RayTaskError("PrefillWorker.receive", "Traceback (most recent call last): ...", cause)


def test_a_destroyed_group_and_an_aborted_transfer_are_the_workers():
    assert is_transport_failure(ValueError(GROUP_GONE))
    assert is_transport_failure(ValueError(NO_COMMUNICATORS))  # seen in the suite, 2026-11-27
    assert is_transport_failure(_task_error(TimeoutError(ABORTED)))
    assert is_transport_failure(_task_error(RuntimeError(PEER_CLOSED)))
    # An encoder's push to a prefill worker that died under it.
    assert is_transport_failure(_task_error(rx.ActorUnavailableError("gone", None)))


def test_the_requests_own_errors_are_not():
    assert not is_transport_failure(ValueError("temperature must be 0 or at least 0.01"))
    assert not is_transport_failure(_task_error(TimeoutError("the request timed out")))
    assert not is_transport_failure(_task_error(ZeroDivisionError("division by zero")))
    assert not is_transport_failure(RuntimeError(GROUP_GONE))
    assert not is_transport_failure(_task_error(RuntimeError("gloo is not a model family")))


def test_a_cancelled_worker_call_means_the_client_left_not_a_server_error():
    """Ray cancels the worker calls of a request whose client disconnected: that is counted as
    a departure (aborted), never as a 500."""
    for cancelled in (rx.TaskCancelledError(), asyncio.CancelledError()):
        failure = worker_code_failure(rx.RayTaskError("generate", "tb", cancelled))
        assert isinstance(failure, asyncio.CancelledError)
    failure = worker_code_failure(rx.RayTaskError("generate", "tb", KeyError("row")))
    assert isinstance(failure, RequestError) and failure.status == 500
    assert "KeyError('row')" in failure.message
