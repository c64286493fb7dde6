"""`pulsesync inspect`: the chain in a store, one row per ready marker, as a table or JSON.

With trusted keys every manifest is verified and a row says whether it passed; without, manifests
are only parsed (the table shows the chain's shape, not that it is authentic).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsesync.errors import PulseSyncError
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.fleet import FleetStatus
from pulsesync.protocol.manifest import (
    AnchorManifest,
    PatchManifest,
    parse_manifest,
    verify_manifest,
)
from pulsesync.retention.worker import read_tombstone
from pulsesync.store import Store


@dataclass
class ChainRow:
    """One ready marker."""

    step: int
    kind: str
    base_step: int | None
    chains_from: int | None  # the anchor a patch's chain starts at (walking base_step links)
    wire_bytes: int
    dense_bytes: int
    changed_elements: int
    ratio: float  # dense bytes / wire bytes
    signer: str
    verified: bool | None  # None: no trusted keys given
    age_seconds: float
    error: str | None = None
    codings: dict[str, int] | None = None  # patches of format 2: records per "KIND/VALUES[/POSITIONS]"
    # The signed root digest of the state at the step, and its algorithm: what the trainer's digest is compared with.
    state_digest: str | None = None
    digest_algorithm: str | None = None


async def chain_rows(store: Store, trusted: Mapping[str, Ed25519PublicKey] | None = None) -> list[ChainRow]:
    """Every ready marker in the store, in step order."""
    now = dt.datetime.now(dt.timezone.utc)
    manifests: dict[tuple[int, str], PatchManifest | AnchorManifest] = {}
    rows: list[ChainRow] = []
    chain = ChainClient(store, trusted or {})
    for entry, info in await chain.refresh(from_start=True, anchors=True):
        name = f"{store.url}{info.key}"
        data = await chain.marker(info.key)
        verified: bool | None = None
        error = None
        kind = entry.kind or "commit"  # a commit key's kind is in its manifest
        try:
            manifest = parse_manifest(data, name)
            kind = manifest.kind
            if trusted:
                try:
                    verify_manifest(data, trusted, name=name)
                    verified = True
                except PulseSyncError as e:
                    verified, error = False, f"{type(e).__name__}: {e}"
        except PulseSyncError as e:
            rows.append(ChainRow(entry.step, kind, None, None, 0, 0, 0, 0.0, "", False, 0.0, str(e)))
            continue
        manifests[(entry.step, kind)] = manifest
        sizes = manifest.sizes
        base = manifest.base_step if isinstance(manifest, PatchManifest) else None
        rows.append(
            ChainRow(
                step=entry.step,
                kind=kind,
                base_step=base,
                chains_from=None,
                wire_bytes=sizes.wire_bytes,
                dense_bytes=sizes.dense_bytes,
                changed_elements=sizes.changed_elements,
                ratio=sizes.dense_bytes / sizes.wire_bytes if sizes.wire_bytes else 0.0,
                signer=manifest.key_id,
                verified=verified,
                age_seconds=max((now - manifest.created).total_seconds(), 0.0),
                error=error,
                codings=manifest.codec.records if isinstance(manifest, PatchManifest) else None,
                state_digest=manifest.state_digest.root,
                digest_algorithm=manifest.state_digest.algorithm,
            )
        )
    rows.sort(key=lambda r: (r.step, r.kind))
    anchors = {step for step, kind in manifests if kind == "anchor"}
    bases = {step: m.base_step for (step, _), m in manifests.items() if isinstance(m, PatchManifest)}
    for row in rows:
        if row.kind == "patch" and row.step in bases:  # not an unreadable manifest
            walk = layout.walk_known(bases[row.step], anchors.__contains__, bases)
            row.chains_from = walk.end if walk.complete else None
    return rows


@dataclass
class RetiredRow:
    """A step retention took out of service: its tombstone (payloads deleted after the grace period, then it)."""

    step: int
    kind: str
    removed_at: dt.datetime
    payload_bytes: int
    verified: bool | None  # the signed marker it carries; None: no trusted keys given
    error: str | None = None


async def retired_rows(store: Store, trusted: Mapping[str, Ed25519PublicKey] | None = None) -> list[RetiredRow]:
    """Every retention tombstone in the store, in step order (unreadable ones with their error)."""
    rows = []
    async for info in store.list(layout.TOMBSTONE_PREFIX):
        entry = layout.parse_tombstone_key(info.key)
        if entry is None:
            continue
        try:
            stone = await read_tombstone(store, info.key, trusted or None)
            size = sum(size for _, size in stone.objects)
            rows.append(RetiredRow(*entry, stone.removed_at, size, True if trusted else None))
        except (PulseSyncError, ValueError) as e:
            epoch = dt.datetime.fromtimestamp(0, dt.timezone.utc)
            rows.append(RetiredRow(*entry, epoch, 0, False, f"{type(e).__name__}: {e}"))
    return sorted(rows, key=lambda r: (r.step, r.kind))


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _codings(codings: dict[str, int] | None) -> str:
    """e.g. "HISTORY/EXP_PLANES/GAP_CODES 40, DENSE/RAW 2", most used first."""
    if not codings:
        return "-"
    return ", ".join(f"{k} {n}" for k, n in sorted(codings.items(), key=lambda kv: -kv[1]))


def _short_digest(row: ChainRow) -> str:
    """The state digest's algorithm and the root's first 16 characters (JSON carries the whole root)."""
    return "-" if row.state_digest is None else f"{row.digest_algorithm}:{row.state_digest[:16]}"


def format_table(rows: list[ChainRow]) -> str:
    """A fixed-width table with a totals line."""
    header = (
        f"{'step':>8} {'kind':<6} {'from':>6} {'chain':>6} {'wire bytes':>14} {'changed':>12} {'ratio':>8} "
        f"{'signer':<17} {'age':>7} {'state digest':<20} codings"
    )
    lines = [header]
    for r in rows:
        if not r.signer:  # the manifest did not parse
            lines.append(f"{r.step:>8} {r.kind:<6} unreadable: {r.error}")
            continue
        signer = r.signer[:16] + ("" if r.verified is None else " ok" if r.verified else " BAD")
        base = "-" if r.base_step is None else str(r.base_step)
        chain = "-" if r.kind == "anchor" else "broken" if r.chains_from is None else str(r.chains_from)
        lines.append(
            f"{r.step:>8} {r.kind:<6} {base:>6} {chain:>6} {r.wire_bytes:>14,} {r.changed_elements:>12,} "
            f"{r.ratio:>7.0f}x {signer:<17} {_age(r.age_seconds):>7} {_short_digest(r):<20} {_codings(r.codings)}"
        )
        if r.error:
            lines.append(f"{'':>8} {r.error}")
    patches = [r for r in rows if r.kind == "patch"]
    anchors = [r for r in rows if r.kind == "anchor"]
    total = sum(r.wire_bytes for r in rows)
    lines.append(
        f"{len(patches)} patches ({sum(r.wire_bytes for r in patches):,} bytes), {len(anchors)} anchors "
        f"({sum(r.wire_bytes for r in anchors):,} bytes); {total:,} bytes in all"
    )
    return "\n".join(lines)


def rows_as_json(rows: list[ChainRow]) -> list[dict[str, object]]:
    """Rows as plain dicts."""
    return [asdict(r) for r in rows]


def format_fleet(fleet: list[FleetStatus], now: dt.datetime, ttl_seconds: float) -> str:
    """The fleet as a table: what each subscriber serves, how far it lags, and whether it is gone (silent past ttl)."""
    if not fleet:
        return "fleet: no subscriber status objects"
    lines = [f"fleet: {len(fleet)} subscribers", f"{'subscriber':<40} {'step':>8} {'lag':>5} {'path':<10} {'seen':>7}"]
    for f in fleet:
        age = f.age(now).total_seconds()
        state = "gone" if age > ttl_seconds else "live"
        step, lag = "-" if f.step is None else str(f.step), "-" if f.lag is None else str(f.lag)
        lines.append(f"{f.subscriber:<40} {step:>8} {lag:>5} {f.path or '-':<10} {_age(max(age, 0)):>7}  {state}")
    return "\n".join(lines)


def fleet_as_json(fleet: list[FleetStatus], now: dt.datetime, ttl_seconds: float) -> list[dict[str, object]]:
    """Fleet entries as plain dicts, with `gone` (silent past ttl)."""
    return [f.model_dump(mode="json") | {"gone": f.age(now).total_seconds() > ttl_seconds} for f in fleet]
