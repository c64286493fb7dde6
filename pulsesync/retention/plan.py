"""Retention planning (pure): from what a store holds to what to delete, without breaking any kept chain.

Kept: the newest `keep_patches` patches and `keep_anchors` anchors, the newest ready step, and for
every kept patch each patch and the anchor on its chain (walking base_step links back to the first
step that has an anchor, which may be the patch's own step), so every kept ready step still
reconstructs from the store. The fleet's status objects are a hint on top: a subscriber seen
within `fleet_ttl_seconds` that lags at most `fleet_max_lag` steps keeps the patches after the
step it serves, so it catches up by the chain path instead of downloading an anchor.

Deleting is two-phase. A removed ready marker first becomes a tombstone (`retention/...json`,
listing its payload objects and when it was removed); the payload goes `grace_seconds` later, so
a reader that saw the marker can finish its download. Payload objects no marker or tombstone
names (a publish that failed before its marker, a losing publisher's copy) are deleted only in
step folders older than every kept step and once they are `grace_seconds` old: a publish still
uploading (an anchor in the background) is always newer than that.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pulsesync.protocol import layout
from pulsesync.protocol.fleet import FleetStatus
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.store import ObjectInfo

Entry = tuple[int, layout.Kind]  # (step, kind) of a ready marker


@dataclass(frozen=True)
class Published:
    """A ready marker as retention sees it: its chain link and the payload objects its manifest lists."""

    step: int
    kind: layout.Kind
    base_step: int | None  # patches only
    objects: tuple[tuple[str, int], ...]  # (key, size)
    marker_size: int = 0
    # The signed manifest goes into the tombstone; it is read again then, not held by every entry.
    marker_sha256: str = ""
    marker_key: str = ""  # where the marker is: its step's commit key, an anchor marker, or a legacy key

    @property
    def entry(self) -> Entry:
        """(step, kind)."""
        return (self.step, self.kind)


@dataclass(frozen=True)
class Tombstone:
    """A ready marker retention removed; its payload objects are deleted once the grace period is over.

    It carries the removed marker itself (signed by the publisher), so a reader authenticates
    what it names: `objects` come from that verified manifest, never from the tombstone's own JSON.
    """

    step: int
    kind: layout.Kind
    objects: tuple[tuple[str, int], ...]
    removed_at: dt.datetime
    marker: bytes = b""

    @property
    def key(self) -> str:
        """Where the tombstone is stored."""
        return layout.tombstone_key(self.step, self.kind)

    def to_bytes(self) -> bytes:
        """JSON form: the signed marker it replaces and when it was removed."""
        return json.dumps({"marker": self.marker.decode("utf-8"), "removed_at": self.removed_at.isoformat()}).encode()

    @staticmethod
    def parse(data: bytes) -> tuple[bytes, dt.datetime]:
        """The signed marker and removal time of a tombstone's JSON; ValueError for any other bytes."""
        try:
            raw = json.loads(data)
        except RecursionError:
            raise ValueError("JSON nested deeper than the parser recurses") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("marker"), str):
            raise ValueError("no signed marker in it (written by an older pulsesync, or forged)")
        if not isinstance(raw.get("removed_at"), str):
            raise ValueError("no removed_at time in it")
        removed_at = dt.datetime.fromisoformat(raw["removed_at"])
        if removed_at.tzinfo is None:
            raise ValueError(f"removed_at {raw['removed_at']!r} has no time zone")
        return raw["marker"].encode("utf-8"), removed_at


@dataclass(frozen=True)
class StoreListing:
    """What retention knows about a store at one moment."""

    published: Mapping[Entry, Published]
    tombstones: Sequence[Tombstone]
    payloads: Sequence[ObjectInfo]  # every object under patches/ and anchors/
    now: dt.datetime
    fleet: Sequence[FleetStatus] = ()  # subscribers' own, unsigned accounts: a hint


@dataclass
class Plan:
    """What one retention run does, in order: unmark, then purge tombstones that are due, then orphans."""

    keep: list[Entry]
    for_fleet: list[tuple[str, int, int]] = field(default_factory=list)  # (subscriber, its step, patches kept after)
    unmark: list[Published] = field(default_factory=list)
    purge: list[Tombstone] = field(default_factory=list)
    orphans: list[ObjectInfo] = field(default_factory=list)

    @property
    def deleted_objects(self) -> int:
        """Objects this plan deletes (markers, payloads, tombstones)."""
        return len(self.unmark) + sum(len(t.objects) + 1 for t in self.purge) + len(self.orphans)

    @property
    def freed_bytes(self) -> int:
        """Bytes of markers and payload objects this plan deletes."""
        markers = sum(p.marker_size for p in self.unmark)
        return markers + sum(s for t in self.purge for _, s in t.objects) + sum(o.size for o in self.orphans)

    def lines(self) -> list[str]:
        """The exact plan, one action per line (what --dry-run prints)."""
        out = [
            f"keep {n} patches after step {step} for subscriber {who} (fleet status)" for who, step, n in self.for_fleet
        ]
        out += [f"remove ready marker {p.marker_key}" for p in self.unmark]
        for t in self.purge:
            out += [f"delete {key} ({size} bytes)" for key, size in t.objects]
            out.append(f"delete {t.key}")
        out += [f"delete unreferenced {o.key} ({o.size} bytes)" for o in self.orphans]
        return out

    def summary(self) -> str:
        """One line: counts and bytes."""
        return (
            f"kept {len(self.keep)} ready markers; removed {len(self.unmark)} markers; deleted "
            f"{self.deleted_objects} objects, {self.freed_bytes:,} bytes"
        )


def catching_up(
    published: Mapping[Entry, Published], fleet: Sequence[FleetStatus], policy: RetentionPolicy, now: dt.datetime
) -> list[tuple[str, int, int]]:
    """(subscriber, step, patches after it) for each recently seen subscriber behind by at most fleet_max_lag."""
    if not published or policy.fleet_ttl_seconds == 0:
        return []
    newest = max(s for s, _ in published)
    patches = sorted(s for s, k in published if k == "patch")
    out = []
    for f in fleet:
        if f.step is None or f.age(now).total_seconds() > policy.fleet_ttl_seconds:
            continue
        if 0 < newest - f.step <= policy.fleet_max_lag:
            out.append((f.subscriber, f.step, sum(1 for s in patches if s > f.step)))
    return out


def kept_entries(
    published: Mapping[Entry, Published], policy: RetentionPolicy, catch_up_from: Sequence[int] = ()
) -> set[Entry]:
    """The ready markers the policy keeps (and the patches after each step in `catch_up_from`); every kept step
    reconstructs from the kept set alone."""
    if not published:
        return set()
    keep: set[Entry] = set()

    anchor_steps = {s for s, k in published if k == "anchor"}
    bases = {s: p.base_step for (s, k), p in published.items() if k == "patch" and p.base_step is not None}

    def keep_patch_chain(step: int) -> None:
        keep.add((step, "patch"))
        # A step with its own anchor rebuilds from it (readers prefer it): no chain below is needed.
        walk = layout.walk_known(step if step in anchor_steps else bases[step], anchor_steps.__contains__, bases)
        keep.update((s, "patch") for s in walk.patches)
        if walk.complete:  # else broken before this run; nothing here can mend it
            keep.add((walk.end, "anchor"))

    patches = sorted(bases)
    anchors = sorted(anchor_steps)
    for step in patches[max(0, len(patches) - policy.keep_patches) :]:
        keep_patch_chain(step)
    keep.update((s, "anchor") for s in anchors[max(0, len(anchors) - policy.keep_anchors) :])
    newest = max(s for s, _ in published)
    if (newest, "anchor") in published:
        keep.add((newest, "anchor"))
    if (newest, "patch") in published:
        keep_patch_chain(newest)
    if catch_up_from:
        oldest = min(catch_up_from)
        for step in patches:
            if step > oldest:
                keep_patch_chain(step)
    return keep


def plan(listing: StoreListing, policy: RetentionPolicy) -> Plan:
    """The deletion plan for a store listing under a policy."""
    for_fleet = catching_up(listing.published, listing.fleet, policy, listing.now)
    keep = kept_entries(listing.published, policy, [step for _, step, _ in for_fleet])
    result = Plan(sorted(keep), for_fleet)
    result.unmark = [p for e, p in sorted(listing.published.items()) if e not in keep]
    grace = dt.timedelta(seconds=policy.grace_seconds)
    # A tombstone whose marker is still ready (a crash between the two writes, or a copy) waits.
    due = [
        t
        for t in listing.tombstones
        if listing.now - t.removed_at >= grace and (t.step, t.kind) not in listing.published
    ]
    if policy.grace_seconds == 0:  # markers removed in this run are due at once
        due += [Tombstone(p.step, p.kind, p.objects, listing.now) for p in result.unmark]
    named_kept = {key for e, p in listing.published.items() if e in keep for key, _ in p.objects}
    result.purge = sorted((_own_objects(t, named_kept) for t in due), key=lambda t: (t.step, t.kind))
    named = {key for p in listing.published.values() for key, _ in p.objects}
    named |= {key for t in listing.tombstones for key, _ in t.objects}
    oldest_kept = min((s for s, _ in keep), default=None)
    for info in listing.payloads:
        step = layout.step_of_payload(info.key)
        if info.key in named or step is None or oldest_kept is None or step >= oldest_kept:
            continue
        if info.last_modified is not None and listing.now - info.last_modified >= grace:
            result.orphans.append(info)
    return result


def _own_objects(tombstone: Tombstone, named_kept: set[str]) -> Tombstone:
    """The tombstone with only the objects it may delete: under its own step folder, named by no kept marker."""
    folder = layout.patch_prefix(tombstone.step) if tombstone.kind == "patch" else layout.anchor_prefix(tombstone.step)
    own = tuple((k, size) for k, size in tombstone.objects if k.startswith(folder) and k not in named_kept)
    return replace(tombstone, objects=own)
