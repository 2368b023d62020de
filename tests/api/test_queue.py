"""The fair queue: bounded, FIFO within a client, round-robin across clients, cancellable while waiting."""

import asyncio

import pytest
from ddtree.api.scheduler import FairQueue, Request
from ddtree.core.sampling import SamplingParams


def requests(*clients: str) -> list[Request]:
    async def make() -> list[Request]:
        return [Request([1], SamplingParams(), client=c, request_id=f"{c}{i}") for i, c in enumerate(clients)]

    return asyncio.run(make())


def drain(queue: FairQueue) -> list[str]:
    out = []
    while (r := queue.get(block=False)) is not None:
        out.append(r.request_id)
    return out


def test_one_clients_burst_does_not_starve_the_others():
    queue = FairQueue(10)
    for r in requests("a", "a", "a", "a", "b", "c", "b"):
        assert queue.put(r)
    assert drain(queue) == ["a0", "b4", "c5", "a1", "b6", "a2", "a3"]


def test_full_queue_refuses_and_keeps_what_it_has():
    queue = FairQueue(2)
    r = requests("a", "b", "c")
    assert queue.put(r[0]) and queue.put(r[1])
    assert not queue.put(r[2])
    assert len(queue) == 2
    assert drain(queue) == ["a0", "b1"]
    assert queue.put(r[2])  # room again


def test_removed_request_frees_its_slot_and_is_never_served():
    queue = FairQueue(2)
    r = requests("a", "a", "b")
    queue.put(r[0])
    queue.put(r[1])
    assert queue.remove(r[0])
    assert not queue.remove(r[0])
    assert queue.put(r[2])
    assert drain(queue) == ["a1", "b2"]


def test_closed_queue_wakes_a_blocked_get():
    queue = FairQueue(1)
    queue.close()
    assert queue.get(block=True) is None and queue.closed


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        FairQueue(0)
