"""Delivery: a verified state handed to every sink, then served; a sink that fails changes nothing served.

A state patched in place is rolled back bit for bit when a sink refuses it (the next sync applies
the patches again); a state rebuilt on the slow path is kept, so the next sync delivers it again
without a second anchor download.
"""

from __future__ import annotations

from safetensors import SafetensorError

from pulsesync.codec import Changes
from pulsesync.errors import LocalWriteError
from pulsesync.sinks import Sink, Update
from pulsesync.subscriber.held import HeldState
from pulsesync.subscriber.paths import Staged


class Delivery:
    """The sinks of one subscriber, and the slow-path state they refused last."""

    def __init__(self, sinks: list[Sink], held: HeldState) -> None:
        self.sinks = sinks
        self.held = held
        self.undelivered: Staged | None = None  # a slow-path state a sink refused: deliver again

    async def deliver(self, staged: Staged) -> None:
        """Hand a verified state to every sink, then serve it; on any failure the old state stays served."""
        served = self.held.served
        changes = Changes.of(staged.undo)  # positions read from the logs only if a sink asks (a sparse update)
        previous = served.digest if served is not None else None
        verified = staged.verified
        update = Update(verified, previous, changes)
        try:
            for sink in self.sinks:
                try:
                    await sink.deliver(update)
                except (OSError, SafetensorError) as e:  # a local write failed (disk full): go on, retry later
                    raise LocalWriteError(f"{type(sink).__name__}: step {staged.step} not delivered ({e})") from None
        except BaseException:
            if staged.undo:
                staged.rollback()  # the next sync applies the patches again
            else:
                self.undelivered = staged  # keep the rebuilt state: no second anchor download
            raise
        self.undelivered = None
        self.held.serve(verified)
