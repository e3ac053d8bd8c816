"""Why worker calls that carry refs are submitted `detached` (cluster/leftovers.py): when Serve
cancels a request's replica task (its client left), Ray cancels every actor call that task
submitted, and a call cancelled while Ray resolves its ObjectRef arguments can crash the
caller. A detached call is not the task's child: the cancel passes it by."""

from __future__ import annotations

import asyncio
import time

import ray

from cluster.leftovers import detached


def _actors():
    """Defined here so Ray ships them by value (a test module is not importable on workers)."""

    @ray.remote
    class Producer:
        async def slow(self) -> bytes:
            await asyncio.sleep(0.5)  # the argument is still being produced when the cancel comes
            return b"kv"

    @ray.remote
    class Consumer:
        def __init__(self):
            self.ran: list[str] = []

        async def take(self, name: str, kv: bytes) -> str:
            self.ran.append(name)
            return name

        def calls(self) -> list[str]:
            return self.ran

    @ray.remote
    class Caller:
        def __init__(self, producer, consumer):
            self.producer, self.consumer, self.refs = producer, consumer, []

        async def request(self, name: str, how: str) -> None:
            submit = detached if how == "detached" else (lambda f, *a: f(*a))
            kv = detached(
                self.producer.slow.remote
            )  # not cancelled either way: the test is about the consumer
            self.refs.append(submit(self.consumer.take.remote, name, kv))
            await asyncio.sleep(3600)  # the client leaves while this waits

        def ready(self) -> None:
            return None

    return Producer, Consumer, Caller


def test_a_detached_call_outlives_the_cancelled_request_that_made_it(ray_session):
    producer_cls, consumer_cls, caller_cls = _actors()
    consumer = consumer_cls.remote()
    caller = caller_cls.remote(producer_cls.remote(), consumer)
    ray.get([caller.ready.remote(), consumer.calls.remote()])
    requests = [caller.request.remote(name, name) for name in ("child", "detached")]
    time.sleep(0.2)
    for ref in requests:
        ray.cancel(ref)  # what Serve does when the HTTP client disconnects
    deadline = time.monotonic() + 10
    while "detached" not in ray.get(consumer.calls.remote()) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(
        0.7
    )  # the child's argument is ready by now: had it not been cancelled, it would have run
    assert ray.get(consumer.calls.remote()) == ["detached"]
