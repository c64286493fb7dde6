"""The rollout side of the verl backend: a subscriber that reaches the step verl asks for.

Each rollout worker holds a verified state as every subscriber does (fast, chain or slow path,
each hash and signature checked, a regional mirror first when `stores:` lists one). For verl's
server adapter it cuts the update that moves the engine from what the engine holds to that state:
the changed positions the applied patches recorded when the engine holds the state before, every
tensor whole when it holds anything else (its launch weights, a failed update, a restart). What
the engine holds is known only once the adapter took the whole update; until then it is unknown.
"""

from __future__ import annotations

import asyncio
import time

from pulsesync.errors import DeadlineError, NotFoundError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate, build_update
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.verified import VerifiedState


class Handoff(Sink):
    """The subscriber's sink: keeps the newest update (its changes) for the adapter to take."""

    name = "verl"

    def __init__(self) -> None:
        self.update: Update | None = None

    async def deliver(self, update: Update) -> None:
        self.update = update


class StepReceiver:
    """A subscriber kept at the steps verl asks for; runs on an event loop of its own (the backend's)."""

    def __init__(self, config: SubscriberConfig, wait_seconds: float) -> None:
        self.config = config
        self.wait_seconds = wait_seconds
        self.handoff = Handoff()
        self.subscriber = Subscriber(config, sinks=[self.handoff])
        self.engine_holds: str | None = None  # the root digest the engine took whole; None: unknown
        self._started = False

    async def reach(self, step: int | None) -> VerifiedState:
        """Sync to `step` (None: the newest), waiting up to wait_seconds for it to be published.

        DeadlineError names the step when it does not appear; any other failure (a tampered object,
        a step older than the one held) is raised as the subscriber meets it, the held state unchanged.
        """
        if not self._started:
            await self.subscriber.start()
            self._started = True
        deadline = time.monotonic() + self.wait_seconds
        while True:
            try:
                await self.subscriber.sync(step)
                break
            except NotFoundError as e:  # not published yet: the trainer's commit is on its way
                if time.monotonic() >= deadline:
                    raise DeadlineError(f"step {step}: not published within {self.wait_seconds:g} s ({e})") from None
                await asyncio.sleep(min(self.config.poll_seconds, max(0.0, deadline - time.monotonic())))
        served = self.subscriber.served
        assert served is not None
        if step is not None and served.step != step:
            raise DeadlineError(f"step {step}: the subscriber holds step {served.step}")  # never mixed: refused
        return served

    def update_for_engine(self, served: VerifiedState) -> WeightUpdate:
        """What moves the engine from what it holds to `served`: sparse against the state before, else whole."""
        if self.engine_holds == served.digest.root:  # nothing changed since the engine took it: an empty update
            return build_update(served.step, served.state, served.digest, served.digest, None)
        update = self.handoff.update
        before = update.previous_digest if update is not None and update.digest.root == served.digest.root else None
        if update is None or before is None or before.root != self.engine_holds:
            return build_update(served.step, served.state, served.digest, None, None)  # everything, whole
        changes = update.changes.positions if update.changes is not None else None
        return build_update(served.step, served.state, served.digest, before, changes)

    async def close(self) -> None:
        await self.subscriber.close()
