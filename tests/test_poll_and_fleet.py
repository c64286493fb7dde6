"""The subscriber daemon's two store-facing helpers on their own: PointerPoll (when to LIST) and
FleetReporter (when to write this subscriber's fleet status), against the in-memory store."""

from __future__ import annotations

import time

from pulsesync.protocol import layout
from pulsesync.protocol.fleet import parse_status, status_key
from pulsesync.store.memory import MemoryStore
from pulsesync.subscriber.fleet import FleetReporter
from pulsesync.subscriber.poll import PointerPoll


async def test_the_pointer_poll_lists_first_on_a_change_and_when_the_pointer_is_unreadable() -> None:
    store = MemoryStore()
    poll = PointerPoll(store, list_every_seconds=3600, deadline=5)
    assert await poll.worth_listing()  # nothing listed yet
    poll.listed()
    assert await poll.worth_listing()  # no pointer: list every poll
    await store.put(layout.POINTER_KEY, layout.pointer_body(1))
    assert await poll.worth_listing() and poll.etag is not None  # first read of it
    assert not await poll.worth_listing()  # unchanged: no LIST
    await store.put(layout.POINTER_KEY, layout.pointer_body(2))
    assert await poll.worth_listing()  # changed
    assert not await poll.worth_listing()
    await store.put(layout.POINTER_KEY, b"x" * (layout.MAX_POINTER_BYTES + 1))
    assert await poll.worth_listing() and poll.etag is None  # oversized: list instead


async def test_a_frozen_pointer_still_gets_a_list_every_list_every_seconds() -> None:
    store = MemoryStore()
    await store.put(layout.POINTER_KEY, layout.pointer_body(1))
    poll = PointerPoll(store, list_every_seconds=0.2, deadline=5)
    poll.listed()
    assert await poll.worth_listing()
    assert not await poll.worth_listing()
    time.sleep(0.25)
    assert await poll.worth_listing()


async def test_the_fleet_reporter_writes_on_a_move_or_when_due_and_never_before_a_state() -> None:
    store = MemoryStore()
    reporter = FleetReporter(store, "node-1", every_seconds=3600, deadline=5)
    key = status_key("node-1")
    await reporter.report("slow", 4, None, 6)  # no verified state served yet: nothing to say
    assert key not in store.objects
    await reporter.report("slow", 4, "ab" * 32, 6)
    status = parse_status(key, store.objects[key][0])
    assert status is not None and (status.step, status.path, status.lag, status.digest) == (4, "slow", 2, "ab" * 32)
    written = store.objects[key]
    await reporter.report("up-to-date", 4, "ab" * 32, 6)  # nothing moved, not due
    await reporter.report(None, 4, "ab" * 32, 7)  # an idle poll, not due
    assert store.objects[key] == written
    await reporter.report("fast", 5, "cd" * 32, 7)
    status = parse_status(key, store.objects[key][0])
    assert status is not None and (status.step, status.path, status.lag) == (5, "fast", 2)
    due = FleetReporter(store, "node-2", every_seconds=0, deadline=5)
    await due.report(None, 3, "ef" * 32, 3)  # due at once: an idle poll writes too, its last path unknown
    status = parse_status(status_key("node-2"), store.objects[status_key("node-2")][0])
    assert status is not None and (status.step, status.path, status.lag) == (3, None, 0)
