"""Resume: rebuild the publisher's baseline (the newest committed step) from its cache or the store."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pulsesync import state_cache
from pulsesync.errors import PulseSyncError
from pulsesync.protocol import layout
from pulsesync.protocol.chain import ChainClient
from pulsesync.rebuild import reconstruct
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.publisher")


async def resume_baseline(
    chain: ChainClient, ready: dict[int, set[layout.Kind]], cache_dir: Path | None, threads: int | None
) -> VerifiedState | None:
    """The newest committed step: from cache_dir if its digest matches the signed manifest, else rebuilt.

    None when it cannot be rebuilt (the first publish is then an anchor, which restarts a valid chain).
    """
    newest = max(ready)
    if cache_dir is not None:
        cached = await asyncio.to_thread(state_cache.load, cache_dir, threads)
        if cached is not None and cached.step == newest:
            manifest = await chain.commit_manifest(newest)
            if manifest.state_digest.root == cached.digest.root:
                log.info("resumed at step %d from cache %s (digest %s)", newest, cache_dir, cached.digest.root)
                return cached.verified_by(manifest.step, manifest.state_digest.root, f"step {newest}'s marker")
    log.info("resuming at step %d: rebuilding it from %s", newest, chain.store.url)
    try:
        rebuilt = await reconstruct(chain, newest)
    except PulseSyncError as e:
        log.warning(
            "cannot rebuild step %d from %s (%s); the first publish will be an anchor", newest, chain.store.url, e
        )
        return None
    source = f"anchor {rebuilt.anchor_step} + {rebuilt.patches_applied} patches"
    log.info("resumed at step %d from %s (digest %s)", newest, source, rebuilt.digest.root)
    return rebuilt.verified
