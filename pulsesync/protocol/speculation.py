"""A patch fetched beside its ready marker: one round trip less on a fast-path step.

A subscriber following a run reads step N's ready marker, verifies it, then GETs the patch the
manifest lists: three requests in a row (LIST, marker, patch). A run names its patches
predictably (layout.patch_key), so step N's patch can be read beside its marker, under the key
the run gave the step listed before N, and hashed while the marker is verified. The bytes stay
untrusted until then: they are handed out only for an ObjectRef of the same key, size and
SHA-256, that is once a verified manifest lists exactly them. A wrong guess (a restarted
publisher, a sharded step, a patch over the size cap, an object put there by someone else)
costs one GET and nothing else: the patch is then fetched as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from pulsesync.protocol.manifest import ObjectRef
from pulsesync.store import Store

log = logging.getLogger("pulsesync.chain")


class Speculation:
    """One patch being read (and hashed) before a verified manifest has asked for it."""

    def __init__(self, store: Store, key: str, max_size: int) -> None:
        """Start reading `key` (at most max_size bytes) and hashing it."""
        self.key = key
        self.read_bytes = 0  # what the GET downloaded (used or not)
        self._task = asyncio.ensure_future(self._read_and_hash(store, max_size))

    async def take(self, ref: ObjectRef) -> bytes | None:
        """The bytes read, if they are exactly the object `ref` (of this key) describes; None: fetch it."""
        found = await self._task
        if found is None or len(found[0]) != ref.size or found[1] != ref.sha256:
            log.debug("patch %s was not read ahead (a wrong guess, or another object under its key)", ref.key)
            return None
        return found[0]

    async def cancel(self) -> None:
        """Stop the read if it is still running."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _read_and_hash(self, store: Store, max_size: int) -> tuple[bytes, str] | None:
        """(bytes, SHA-256 hex), or None where the object cannot be read: the patch is then fetched as usual."""
        try:
            data = await store.get(self.key, max_size=max_size)
        except Exception as e:  # any failure here is met again, and reported, by the fetch that follows
            log.debug("reading %s ahead: %s: %s", self.key, type(e).__name__, e)
            return None
        self.read_bytes = len(data)
        return data, await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
