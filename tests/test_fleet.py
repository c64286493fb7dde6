"""The fleet's status objects read back (`read_fleet`): forged and junk objects bound the work and hide nothing.

The objects are unsigned and anyone with write access to the store writes them, so a reader
trusts no field for longer than the store says the object has existed, and spends its reads on
the most recently written objects, whatever their names.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

import pytest

from pulsesync.protocol import fleet
from pulsesync.protocol.fleet import MAX_CLOCK_SKEW, FleetStatus, read_fleet, status_key
from pulsesync.store import FileStore
from tests.support.recording_store import RecordingStore


def status(name: str, updated_at: dt.datetime, step: int = 3) -> FleetStatus:
    return FleetStatus(subscriber=name, step=step, updated_at=updated_at)


async def test_a_status_stamped_in_the_future_ages_from_when_the_store_got_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    now = dt.datetime.now(dt.timezone.utc)
    far = dt.datetime(9999, 1, 1, tzinfo=dt.timezone.utc)
    await store.put(status_key("forged"), status("forged", far).to_bytes())
    await store.put(status_key("honest"), status("honest", now).to_bytes())
    read = {s.subscriber: s for s in await read_fleet(store)}
    assert read["honest"].updated_at == now  # a status stamped by a clock in step is read as written
    assert now <= read["forged"].updated_at <= dt.datetime.now(dt.timezone.utc) + MAX_CLOCK_SKEW

    day_ago = time.time() - 86400  # the forged object was written a day ago: it is a day old, not 7,973 years young
    os.utime(tmp_path / status_key("forged"), (day_ago, day_ago))
    forged = next(s for s in await read_fleet(store) if s.subscriber == "forged")
    assert forged.age(dt.datetime.now(dt.timezone.utc)) > dt.timedelta(hours=23)


async def test_junk_counts_toward_the_cap_and_names_that_sort_first_hide_no_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet, "MAX_FLEET", 8)
    store = FileStore(tmp_path)
    now = dt.datetime.now(dt.timezone.utc)
    hour_ago = time.time() - 3600
    for i in range(12):  # junk and well-formed forgeries, named to sort before every real subscriber
        key = status_key(f"0000-forged-{i:02d}")
        body = b"{not json" if i % 2 else status(f"0000-forged-{i:02d}", now).to_bytes()
        await store.put(key, body)
        os.utime(tmp_path / key, (hour_ago, hour_ago))
    for name in ("real-a", "real-b"):
        await store.put(status_key(name), status(name, now).to_bytes())

    recording = RecordingStore(store)
    read = await read_fleet(recording)
    assert {"real-a", "real-b"} <= {s.subscriber for s in read}
    assert recording.calls["GET"] == 8  # the cap bounds objects read, junk included
    assert len(read) == 2 + 3  # the newest 8: both real ones and 6 forged, 3 of them junk


async def test_a_listing_flooded_past_its_bound_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "MAX_FLEET", 4)
    monkeypatch.setattr(fleet, "MAX_FLEET_LISTED", 10)
    store = FileStore(tmp_path)
    now = dt.datetime.now(dt.timezone.utc)
    for i in range(30):
        await store.put(status_key(f"s{i:02d}"), status(f"s{i:02d}", now).to_bytes())
    recording = RecordingStore(store)
    assert len(await read_fleet(recording)) == 4
    assert recording.calls["GET"] == 4
