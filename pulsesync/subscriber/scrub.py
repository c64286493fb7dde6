"""The scrub: the whole served state re-hashed against its digest, paced.

The fast path keeps the digest up to date from the changed elements alone, so memory corruption in
the other 99% would go unseen: this catches it. A tensor the state changed under (a sync) is
skipped until the next scrub. A mismatch is counted, logged and marks the held state diverged:
the next sync rebuilds it from an anchor (the sinks then get the verified state again).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pulsesync import metrics
from pulsesync.digest import TensorHasher
from pulsesync.subscriber.held import HeldState
from pulsesync.threads import in_thread_to_completion

log = logging.getLogger("pulsesync.subscriber")


async def scrub(held: HeldState, bytes_per_second: float, piece_bytes: int = 64 << 20) -> list[str]:
    """Re-hash the served state against its digest at `bytes_per_second`; returns the tensors that differ."""
    if held.served is None:
        return []
    bad = []
    for name in sorted(held.served.digest.tensors):
        version, served = held.version, held.served
        if name not in served.state:
            continue
        hasher = TensorHasher(served.state[name], served.digest.algorithm)
        piece = max(piece_bytes // served.state[name].element_size(), 1)
        while hasher.hashed < hasher.flat.numel() and version == held.version:
            t0 = time.perf_counter()
            async with held.reading():  # never while a sync patches the state
                if version == held.version:
                    await in_thread_to_completion(hasher.update, piece)  # the lease outlasts it
            await asyncio.sleep(max(piece_bytes / bytes_per_second - (time.perf_counter() - t0), 0.0))
        if version != held.version:
            continue  # patched meanwhile: scrubbed again next time
        metrics.SCRUBBED_BYTES.labels("subscriber").inc(hasher.flat.numel() * hasher.flat.element_size())
        if hasher.digest() != served.digest.tensors[name]:
            bad.append(name)
    metrics.SCRUBS.labels("subscriber", "mismatch" if bad else "ok").inc()
    if bad:
        held.diverged = f"scrub: the held tensors {bad[:5]} differ from the digest of step {held.step}"
        log.error("%s; the next sync rebuilds the state from an anchor", held.diverged)
    return bad
