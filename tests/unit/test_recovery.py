"""Which failures under a request are a lost worker (retried elsewhere), which the request's."""

from __future__ import annotations

import ray.exceptions as rx

from cluster.recovery import is_transport_failure

GROUP_GONE = (
    "Actor(PrefillWorker, 11c9cdb63f7b96edd1de152a01000000) does not have tensor transport "
    'GLOO available. If using a collective-based transport ("nccl" or "gloo"), please create a '
    "communicator with `ray.experimental.collective.create_collective_group` before calling "
    "actor tasks with non-default tensor_transport."
)
ABORTED = "ObjectRef(09b273cb) not found in RDT object store after 60.0s, transfer may have failed."


def _task_error(cause: BaseException) -> rx.RayTaskError:
    return rx.RayTaskError("PrefillWorker.receive", "Traceback (most recent call last): ...", cause)


def test_a_destroyed_group_and_an_aborted_transfer_are_the_workers():
    assert is_transport_failure(ValueError(GROUP_GONE))
    assert is_transport_failure(_task_error(TimeoutError(ABORTED)))


def test_the_requests_own_errors_are_not():
    assert not is_transport_failure(ValueError("temperature must be 0 or at least 0.01"))
    assert not is_transport_failure(_task_error(TimeoutError("the request timed out")))
    assert not is_transport_failure(_task_error(ZeroDivisionError("division by zero")))
    assert not is_transport_failure(RuntimeError(GROUP_GONE))
