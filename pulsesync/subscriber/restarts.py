"""Engines restarted under a running subscriber: found on every poll tick and brought back to the served state.

A vLLM or SGLang server that restarts (a crash, an OOM kill, a rolling restart) comes back on its
launch checkpoint while the subscriber still serves its step. Every poll tick each sink reads
what its engine holds (`Sink.holds`: a version string, never a worker RPC); an engine that holds
anything other than the served state gets the whole of it at once, without waiting for the next
publish. Directory sinks run again too (a no-op for a step they hold), since engine sinks such
as SGLang's load the directory they write. A restart is counted and logged once at INFO; an
engine that does not answer (still starting) is asked again at the next tick. While failed syncs back off,
the daemon asks on every tick which engines answer (`came_back`): one that comes back ends the wait (counted
as restarted if it lost the served state), so a step that failed to reach it while it was down reaches it
within a tick, not after the backoff; so does an engine answering for the first time (a cold start while it
loads, nothing served yet).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from pulsesync import metrics
from pulsesync.errors import PulseSyncError
from pulsesync.sinks import Sink, Update
from pulsesync.sinks.directory import DirectorySink
from pulsesync.subscriber.held import HeldState
from pulsesync.subscriber.status import SubscriberStatus
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.subscriber")


@dataclass
class RestartWatch:
    """Asks each sink's engine what it holds and brings back the ones that lost the served state."""

    sinks: list[Sink]
    status: SubscriberStatus  # its engine_restarts counts the engines found restarted since start
    held: HeldState  # the served state: what every engine should hold
    silent: set[int] = field(default_factory=set)  # sinks (by index) whose engine did not answer at the last tick
    lost: set[int] = field(default_factory=set)  # sinks whose engine was found without the served state, not back yet
    seconds: float = 0.0  # the last bring-back's deliveries, from the first to the last sink

    async def stale(self, served: VerifiedState) -> list[Sink]:
        """The sinks whose engine answers and holds something other than `served`."""
        found = []
        for i, sink in enumerate(self.sinks):
            try:
                holds = await sink.holds(served)
            except PulseSyncError as e:
                if i not in self.silent:
                    log.info("%s sink: its engine does not answer (%s); asking again each poll", sink.name, e)
                self.silent.add(i)
                continue
            self.silent.discard(i)
            if holds:
                self.lost.discard(i)
            else:
                found.append(sink)
        return found

    async def answering(self) -> dict[int, bool]:
        """The sinks (by index) whose engine answers now, and whether it holds the served state (False before one)."""
        served, found = self.held.served, {}
        for i, sink in enumerate(self.sinks):
            with contextlib.suppress(PulseSyncError):
                found[i] = await sink.holds(served)
        return found

    async def came_back(self, before: Mapping[int, bool]) -> bool:
        """Whether an engine that did not answer at `before` (an `answering()`) answers now; one that lost the served
        state is counted and logged as restarted once (the sync tried again next sends it the newest step whole)."""
        now = await self.answering()
        back = [i for i in now if i not in before]
        for i in back:
            if not now[i] and self.held.served is not None:
                self._restarted(i, self.held.served.step)
        return bool(back)

    def _restarted(self, i: int, step: int) -> None:
        """Count and log a restart of sink `i`'s engine, once however many ticks bringing it back takes."""
        if i in self.lost:
            return
        sink = self.sinks[i]
        log.info("%s sink: its engine no longer holds step %d (restarted); sending it", sink.name, step)
        metrics.ENGINE_RESTARTS.labels(sink.name).inc()
        self.status.engine_restarts += 1
        self.lost.add(i)

    async def bring_back(self, served: VerifiedState) -> int:
        """Deliver `served` whole to every engine that lost it; how many did. A failed delivery raises (EngineError)."""
        stale = await self.stale(served)
        if not stale:
            return 0
        update = Update(served)  # previous_digest None: the whole state
        started = time.perf_counter()
        for i, sink in enumerate(self.sinks):
            if sink in stale:
                self._restarted(i, served.step)
            elif not isinstance(sink, DirectorySink):
                continue
            await sink.deliver(update)  # previous_digest None: the whole state
        self.lost -= {i for i, sink in enumerate(self.sinks) if sink in stale}
        self.seconds = time.perf_counter() - started
        return len(stale)
