"""The fleet's status objects: what each subscriber says it holds, for display and retention's hint only.

Each subscriber daemon rewrites `fleet/{subscriber}.json` (at most `MAX_STATUS_BYTES`): the step
and state digest it serves, the path of its last sync, how many steps it lags behind the newest
marker it saw, and when it last synced. These objects are unsigned and written by many hosts;
nothing is ever served or verified because of them. `pulsesync inspect` shows them, and
retention keeps the patches a subscriber seen within a TTL needs to catch up (up to a cap):
a lie costs at most that cap of storage. Parsing is pure; `read_fleet` lists and reads them.

A reader bounds what a forger can do: an object's `updated_at` counts at most `MAX_CLOCK_SKEW`
past the time the store says it was written (a status stamped in the year 9999 still expires),
and the reads go to the `MAX_FLEET` most recently written objects, junk counted, whatever their
names sort as (live subscribers rewrite theirs every poll).
"""

from __future__ import annotations

import datetime as dt
import json
import logging

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pulsesync.errors import PulseSyncError
from pulsesync.store import ObjectInfo, Store

log = logging.getLogger("pulsesync.fleet")
FLEET_PREFIX = "fleet/"
MAX_STATUS_BYTES = 4096
MAX_FLEET = 10_000  # status objects read (junk included) per listing: the newest written
MAX_FLEET_LISTED = 100_000  # keys listed under fleet/ before the listing is cut off
MAX_CLOCK_SKEW = dt.timedelta(minutes=5)  # how far ahead of the store's clock a writer's clock may run
SUBSCRIBER_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class FleetStatus(BaseModel):
    """One subscriber's own account of what it serves (advisory)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    subscriber: str = Field(pattern=SUBSCRIBER_ID)
    step: int | None = Field(None, ge=0)
    digest: str | None = Field(None, max_length=128)
    path: str | None = Field(None, max_length=16)
    lag: int | None = Field(None, ge=0, description="steps between the newest marker it saw and the one it serves")
    last_sync: dt.datetime | None = None
    updated_at: dt.datetime

    @property
    def key(self) -> str:
        """Where it is stored."""
        return status_key(self.subscriber)

    def to_bytes(self) -> bytes:
        """Its JSON form."""
        return self.model_dump_json().encode()

    def age(self, now: dt.datetime) -> dt.timedelta:
        """How long ago it was written (by its writer's clock)."""
        return now - self.updated_at


def status_key(subscriber: str) -> str:
    """The key of a subscriber's status object."""
    return f"{FLEET_PREFIX}{subscriber}.json"


def parse_status(key: str, data: bytes, written_at: dt.datetime | None = None) -> FleetStatus | None:
    """A status object read from `key`, or None for anything that is not one (oversized, malformed, misplaced).

    With `written_at` (when the store got the object), `updated_at` is clamped to it plus MAX_CLOCK_SKEW.
    """
    if len(data) > MAX_STATUS_BYTES:
        return None
    try:
        status = FleetStatus.model_validate(json.loads(data))
    except (ValueError, RecursionError, ValidationError):
        return None
    if status.key != key or status.updated_at.tzinfo is None:
        return None
    if written_at is not None and status.updated_at > (latest := written_at + MAX_CLOCK_SKEW):
        status = status.model_copy(update={"updated_at": latest})
    return status


async def read_fleet(store: Store) -> list[FleetStatus]:
    """The well-formed status objects among the MAX_FLEET most recently written under `fleet/`, by subscriber."""
    now = dt.datetime.now(dt.timezone.utc)
    listed: list[ObjectInfo] = []
    async for info in store.list(FLEET_PREFIX):
        if len(listed) >= MAX_FLEET_LISTED:
            log.warning("%s%s: more than %d objects; the rest not read", store.url, FLEET_PREFIX, MAX_FLEET_LISTED)
            break
        listed.append(info)
    # A store's clock can say the future too (a file's mtime is anyone's to set): never past the reader's.
    written = {info.key: min(info.last_modified or now, now) for info in listed}
    newest = sorted(listed, key=lambda info: (written[info.key], info.key), reverse=True)[:MAX_FLEET]
    found: list[FleetStatus] = []
    for info in newest:
        if info.size > MAX_STATUS_BYTES:
            continue
        try:
            data = await store.get(info.key, MAX_STATUS_BYTES)
        except PulseSyncError:  # gone since the listing, or grew: not ours to judge
            continue
        if (status := parse_status(info.key, data, written[info.key])) is not None:
            found.append(status)
    return sorted(found, key=lambda s: s.subscriber)
