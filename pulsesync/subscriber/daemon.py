"""The subscriber daemon: follow the store until stopped (poll, sync, back off on failures, scrub on a timer),
serving /metrics and /healthz. Each poll tick first brings back engines that restarted since the last one
(`restarts.py`). It drives a subscriber through what `Follower` names, and reads nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol, cast

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_never,
    wait_exponential,
)
from tenacity.stop import stop_base

from pulsesync import metrics
from pulsesync.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConfigError,
    NothingPublishedError,
    PulseSyncError,
    UnknownKeyError,
)
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.fleet import FleetReporter
from pulsesync.subscriber.paths import SyncPath, SyncResult
from pulsesync.subscriber.poll import PointerPoll
from pulsesync.subscriber.restarts import RestartWatch
from pulsesync.subscriber.status import SubscriberStatus
from pulsesync.subscriber.stores import StoreList
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.subscriber")


class Follower(Protocol):
    """What the daemon drives: a subscriber."""

    config: SubscriberConfig
    status: SubscriberStatus
    poll: PointerPoll | None
    fleet: FleetReporter | None
    stores: StoreList
    restarts: RestartWatch

    @property
    def step(self) -> int: ...

    @property
    def served(self) -> VerifiedState | None: ...

    async def start(self) -> None: ...

    async def bring_back_engines(self) -> int: ...

    async def sync(self, target: int | None = None) -> SyncResult: ...

    async def scrub(self) -> list[str]: ...

    def healthy(self) -> tuple[bool, dict[str, Any]]: ...


# What another try finds the same: a bounded retry (`--once`) stops at once; the daemon waits them out
# (a key rotated into the trusted set, credentials renewed).
_PERMANENT = (ConfigError, UnknownKeyError, AccessDeniedError, BucketNotFoundError)


def _worth_retrying(error: BaseException) -> bool:
    """Every pulsesync error but an empty prefix, which a daemon waits out at its poll interval."""
    return isinstance(error, PulseSyncError) and not isinstance(error, NothingPublishedError)


class _MetAgain(stop_base):
    """Stop once an attempt failed with an error another try would meet again."""

    def __call__(self, retry_state: RetryCallState) -> bool:
        outcome = retry_state.outcome
        return outcome is not None and isinstance(outcome.exception(), _PERMANENT)


def retrying(follower: Follower, attempts: int | None, stop: asyncio.Event | None = None) -> AsyncRetrying:
    """The retry policy of failed syncs: exponential backoff, retry_initial_seconds doubling to retry_max_seconds.

    Each failure is recorded (status, metrics, log); a set `stop`, or an engine that answers again, cuts a
    backoff wait short. With
    a bound on `attempts`, an error another try would meet again is raised at once.
    """

    async def sleep(seconds: float) -> None:
        if stop is None:
            return await asyncio.sleep(seconds)
        # A step that keeps failing must not keep a restarted engine on its launch weights: it gets the served
        # state first. A sync that failed because an engine was down would fail until it answers, and succeed
        # at once then: an engine that comes back during the wait ends it (asked every poll tick, a version
        # read), and the sync tried again sends it the new step whole, one delivery.
        if follower.served is not None:
            await _bring_back_engines(follower)
        loop = asyncio.get_running_loop()
        deadline, answering = loop.time() + seconds, await follower.restarts.answering()
        while not stop.is_set() and (left := deadline - loop.time()) > 0:
            await _wait(stop, min(left, follower.config.poll_seconds))
            if await follower.restarts.came_back(answering):
                return

    def failed(state: RetryCallState) -> None:
        assert state.outcome is not None
        error = cast(PulseSyncError, state.outcome.exception())
        follower.status.consecutive_failures += 1
        follower.status.last_error = f"{type(error).__name__}: {error}"
        metrics.SYNC_FAILURES.inc()
        metrics.HEALTHY.set(int(follower.healthy()[0]))
        if attempts is None or (state.attempt_number < attempts and not _MetAgain()(state)):  # the last is raised
            log.error("sync failed (%s); still serving step %d", follower.status.last_error, follower.step)

    config = follower.config
    return AsyncRetrying(
        stop=stop_never if attempts is None else stop_after_attempt(attempts) | _MetAgain(),
        wait=wait_exponential(multiplier=config.retry_initial_seconds, max=config.retry_max_seconds),
        retry=retry_if_exception(_worth_retrying),
        after=failed,
        sleep=sleep,
        reraise=True,
    )


async def sync_with_retries(follower: Follower, attempts: int) -> SyncResult:
    """Sync, retrying failures with exponential backoff up to `attempts` tries."""
    async for attempt in retrying(follower, attempts):
        with attempt:
            return await follower.sync()
    raise AssertionError("unreachable")  # pragma: no cover


async def report(follower: Follower, path: SyncPath | None) -> None:
    """The fleet status after a sync (`path`) or an idle poll (None), when fleet statuses are on."""
    if follower.fleet is not None:
        served = follower.served
        digest = served.digest.root if served is not None else None
        newest = max(follower.stores.read.chain.listed, default=follower.step)
        await follower.fleet.report(path, follower.step, digest, newest)


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _bring_back_engines(follower: Follower) -> None:
    """Engines that restarted get the served state now; a failed delivery is logged and tried again next tick."""
    try:
        await follower.bring_back_engines()
    except PulseSyncError as e:
        log.error("an engine that restarted did not take step %d again (%s: %s)", follower.step, type(e).__name__, e)


async def _scrub_periodically(follower: Follower, interval: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await _wait(stop, interval)
        if not stop.is_set():
            await follower.scrub()


async def run(follower: Follower, stop: asyncio.Event) -> None:
    """Follow the store until stop is set: poll, sync, back off on failures; serve /metrics and /healthz."""
    config = follower.config
    await follower.start()
    runner = None
    if config.metrics_port is not None:
        runner = await metrics.serve_with_health(config.metrics_port, follower.healthy)
    scrubbing, said_waiting = None, False
    if config.scrub_interval_seconds is not None:
        scrubbing = asyncio.create_task(
            _scrub_periodically(follower, config.scrub_interval_seconds, stop), name="pulsesync-scrub"
        )
    try:
        while not stop.is_set():
            if follower.served is not None:
                await _bring_back_engines(follower)
            if follower.poll is not None and follower.served is not None and not await follower.poll.worth_listing():
                await report(follower, None)
                await _wait(stop, config.poll_seconds)  # the pointer did not change: nothing new
                continue
            result = None
            try:
                async for attempt in retrying(follower, None, stop):  # until a sync succeeds or stop is set
                    with attempt:
                        if not stop.is_set():
                            result = await follower.sync()
            except NothingPublishedError as e:  # the start of a run: poll on at the usual interval
                if not said_waiting:
                    log.info("%s; polling every %g s", e, config.poll_seconds)
                    said_waiting = True
                await _wait(stop, config.poll_seconds)
                continue
            if result is None:
                break
            follower.status.consecutive_failures, follower.status.last_error = 0, None
            metrics.HEALTHY.set(1)
            if result.path != SyncPath.UP_TO_DATE:
                log.info("%s", result.to_json())
            if follower.poll is not None:
                follower.poll.listed()
            await report(follower, result.path)  # best effort, after the health the sync earned
            await _wait(stop, config.poll_seconds)
    finally:
        if scrubbing is not None:
            scrubbing.cancel()
            await asyncio.gather(scrubbing, return_exceptions=True)
        if runner is not None:
            await runner.cleanup()
