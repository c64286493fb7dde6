"""Resuming from cache_dir: the cache's journal replayed onto its base, then a signed manifest found that vouches
for the result (the store's marker of its step, else the one cached beside it) before it is served."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pulsesync import state_cache
from pulsesync.codec import StepHistory, UndoLog
from pulsesync.errors import ForeignStreamError, IntegrityError, NotFoundError, PulseSyncError, StoreError
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.fetcher import check_patch
from pulsesync.protocol.manifest import PatchManifest, verify_manifest
from pulsesync.rebuild import apply_step
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.subscriber")


async def replay(chain: ChainClient, cached: state_cache.CachedState, cache_dir: Path) -> None:
    """Apply the cache's journal to its base, each entry verified as a patch from the store would be.

    Replay stops at the first entry that does not verify or link up (its files are removed):
    the state up to there is verified and is resumed from.
    """
    for entry in cached.journal:
        where = f"the state cache in {cache_dir}: journal entry {entry.step}"
        undo = UndoLog()
        try:
            raw, data = await asyncio.to_thread(entry.read)
            manifest = verify_manifest(raw, chain.trusted, newer_than=cached.step, name=where)
            if not isinstance(manifest, PatchManifest) or (manifest.step, manifest.base_step) != (
                entry.step,
                cached.step,
            ):
                raise IntegrityError(
                    f"{where}: holds the {manifest.kind} of step {manifest.step}, not a patch from step {cached.step}"
                )
            check_patch(manifest, data, where)
            history = StepHistory()
            cached.digest = await apply_step(
                chain.fetcher, cached.state, cached.digest, manifest, data, undo, cached.history, history
            )
        except (PulseSyncError, OSError) as e:
            undo.rollback(cached.state)
            log.warning("%s: not replayed (%s: %s); resuming from step %d", where, type(e).__name__, e, cached.step)
            await asyncio.to_thread(state_cache.truncate_journal, cache_dir, entry.step)
            return
        cached.step, cached.marker, cached.history = manifest.step, raw, history


async def vouched(
    chain: ChainClient, cached: state_cache.CachedState, cache_dir: Path, reset_stream: bool
) -> tuple[VerifiedState, str] | None:
    """The cached state verified by a signed manifest that vouches for it (the store's for its step, else the
    cached copy), and that manifest's stream; None when none does: the cache is then discarded.

    The stream is pinned first: by the config, else by the cache's own signed marker (the stream
    this subscriber learned), so markers another run copied into the prefix are foreign and
    skipped. Only a cache without a marker, or `reset_stream`, takes the store's newest stream,
    and a cache of another stream is then discarded.
    """
    where = f"the state cache in {cache_dir}"
    try:
        own = None
        if cached.marker is not None:
            own = verify_manifest(cached.marker, chain.trusted, name=f"{where}: its ready marker")
            if not reset_stream:
                chain.pin_stream(own.stream_id)
        store_stream = None
        try:
            newest = await chain.newest_verified()  # with the pin set, another stream's markers are skipped
            listed = cached.step in chain.listed  # newest_verified() just listed ready/
            if newest is not None:
                store_stream = chain.verified_marker(newest)[1].stream_id  # type: ignore[index]
        except StoreError as e:  # unreachable for now: the cached copy of the marker decides
            log.warning("checking %s against the store's markers: %s", where, e)
            listed = False
        manifest = None
        if listed:
            try:
                manifest = await chain.commit_manifest(cached.step)
            except IntegrityError as e:  # e.g. rewritten by another stream: the cached copy still vouches
                if own is None:
                    raise
                log.warning("%s: the store's marker of step %d does not verify (%s)", where, cached.step, e)
            except NotFoundError:  # removed since the listing
                pass
        if manifest is None:
            if own is None:
                raise NotFoundError(f"step {cached.step} has no ready marker in {chain.store.url} and none was cached")
            manifest = own
        verified = cached.verified_by(manifest.step, manifest.state_digest.root, "its marker")
        pinned = chain.stream_id if chain.stream_id is not None else store_stream
        if pinned and manifest.stream_id != pinned:
            raise ForeignStreamError(f"it is of stream {manifest.stream_id!r}, the store's is {pinned!r}")
    except PulseSyncError as e:
        log.warning("discarding %s: no signed manifest vouches for it (%s: %s)", where, type(e).__name__, e)
        return None
    return verified, manifest.stream_id
