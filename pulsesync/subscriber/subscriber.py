"""The subscriber: sync to the newest (or a pinned) ready step, verify every link, deliver to sinks.

The parts, each in its module: the stores in order of preference and every decision about them
(`stores.py`); one sync through them (`sync.py`) along the fast, chain or slow path (`paths.py`);
the sinks' take and the rollback when one refuses (`delivery.py`); the served state and its
patch and read scopes (`held.py`); resuming from cache_dir (`resume.py`), keeping it current
(`cache_writer.py`), the scrub (`scrub.py`), engines that restarted (`restarts.py`) and the
daemon loop (`daemon.py`). Sinks only ever see a verified, completely applied state; the state
served changes only once every sink took it. This class wires them and answers for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsesync import mixsum, state_cache
from pulsesync.codec import batch
from pulsesync.deadlines import within
from pulsesync.digest import StateDigest
from pulsesync.errors import ConfigError, DeadlineError
from pulsesync.protocol import signing
from pulsesync.sinks import DirectorySinkConfig, Sink, build_sinks
from pulsesync.store import Store, open_store
from pulsesync.subscriber import daemon, resume
from pulsesync.subscriber.cache_writer import CacheWriter
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.delivery import Delivery
from pulsesync.subscriber.fleet import FleetReporter, default_subscriber_id
from pulsesync.subscriber.held import HeldState
from pulsesync.subscriber.paths import Staged, SyncPath, SyncResult
from pulsesync.subscriber.restarts import RestartWatch
from pulsesync.subscriber.scrub import scrub
from pulsesync.subscriber.status import SubscriberStatus
from pulsesync.subscriber.stores import StoreList
from pulsesync.subscriber.sync import Sync
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.subscriber")
_KERNEL_WARM_UPS = (batch.warm_up, mixsum.warm_up)  # the decode kernels and the digest's


class Subscriber:
    """Holds the served, verified state and moves it forward; `sync()` is one attempt, `run()` the daemon."""

    def __init__(
        self,
        config: SubscriberConfig,
        *,
        store: Store | None = None,
        stores: list[Store] | None = None,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        sinks: list[Sink] | None = None,
    ) -> None:
        trusted = trusted if trusted is not None else signing.trusted_keys(config.trusted_keys)
        if not trusted:
            raise ConfigError("trusted_keys: a subscriber needs at least one trusted public key (--trusted-key)")
        self.config = config
        advisory = config.advisory_deadline_seconds
        if stores is None:
            stores = [store] if store is not None else [open_store(c) for c in config.store_list]
        self.stores = StoreList.open(stores, trusted, config)
        self.poll = self.stores.sources[0].poll
        fleet_id = config.subscriber_id or default_subscriber_id(config.cache_dir)
        fleet_every = config.fleet_status_seconds
        self.fleet = FleetReporter(stores[0], fleet_id, fleet_every, advisory) if config.fleet_status else None
        sink_configs = list(config.sinks)
        if config.out_dir is not None:
            sink_configs.append(DirectorySinkConfig(out_dir=config.out_dir))
        self.sinks = sinks if sinks is not None else build_sinks(sink_configs)
        self.held = HeldState()
        self.status = SubscriberStatus()
        self.restarts = RestartWatch(self.sinks, self.status, self.held)
        self.cache = CacheWriter(config.cache_dir, config.cache_journal_ratio, self.held) if config.cache_dir else None
        self.syncing = Sync(self.stores, self.held, Delivery(self.sinks, self.held), self.cache, self.status)
        self._warm_up: asyncio.Future[list[None]] | None = None
        self._sync_started: float | None = None  # monotonic time the running sync began

    # --- the served state ------------------------------------------------------------------------
    @property
    def served(self) -> VerifiedState | None:
        """The verified state served now (its tensors, digest, files and history), None before the first."""
        return self.held.served

    @property
    def state(self) -> dict[str, torch.Tensor] | None:
        """The served tensors."""
        return self.held.served.state if self.held.served is not None else None

    @property
    def digest(self) -> StateDigest | None:
        """The served state's digest."""
        return self.held.served.digest if self.held.served is not None else None

    @property
    def step(self) -> int:
        """The served step, -1 before the first."""
        return self.held.step

    def apply_to(self, module: torch.nn.Module) -> None:
        """Overwrite a module's parameters and buffers in place with the served state, bit-exact.

        From another thread it waits for a sync that is patching the state; on the event loop's
        thread (where waiting would deadlock) it raises EngineError instead.
        """
        self.held.copy_into(module)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume from cache_dir when it holds an intact verified state; load the decode kernels meanwhile."""
        if self._warm_up is None:
            self._warm_up = asyncio.ensure_future(asyncio.gather(*map(asyncio.to_thread, _KERNEL_WARM_UPS)))
        if self.cache is None or self.served is not None:
            return
        cache_dir = self.cache.cache_dir
        cached = await asyncio.to_thread(state_cache.load, cache_dir, self.config.codec.threads)
        if cached is None:
            return
        await resume.replay(self.stores.sources[0].chain, cached, cache_dir)
        # The last store (the origin) is asked: a mirror does not choose the stream (`stores.py`).
        origin = self.stores.sources[-1].chain
        found = await resume.vouched(origin, cached, cache_dir, self.config.reset_stream)
        if found is None:
            return
        verified, stream = found
        self.stores.pin_stream(stream)
        self.status.stream_id = self.stores.stream_id
        await self.cache.resumed()
        log.info("resumed step %d from %s (digest %s)", cached.step, cache_dir, cached.digest.root)
        await self.syncing.serve(Staged(verified, SyncPath.CACHE), persist=False)

    async def close(self) -> None:
        """Finish writing the state cache; release the store."""
        if self.cache is not None:
            await self.cache.wait()
        for source in self.stores.sources:
            await source.chain.fetcher.drop_read_ahead()
        if self._warm_up is not None:
            await asyncio.wait([self._warm_up])
        for source in self.stores.sources:
            await source.store.close()

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- syncing ---------------------------------------------------------------------------------
    async def sync(self, target: int | None = None) -> SyncResult:
        """One sync to `target` (default: the configured step, else the newest step whose marker verifies).

        Cut off after sync_deadline_seconds (DeadlineError), the held state rolled back first.
        """
        deadline = self.config.sync_deadline_seconds
        self._sync_started = time.monotonic()
        try:
            return await within(deadline, self.syncing.run(target))
        except asyncio.TimeoutError:
            raise DeadlineError(
                f"sync did not finish within sync_deadline_seconds ({deadline:g} s); still serving step {self.step}"
            ) from None
        finally:
            self._sync_started = None

    async def bring_back_engines(self) -> int:
        """Send the served state again to every engine that restarted since (`restarts.py`); how many were."""
        served = self.held.served
        if served is None or self._sync_started is not None:
            return 0
        return await self.restarts.bring_back(served)

    # --- scrub, health, daemon -------------------------------------------------------------------
    async def scrub(self, bytes_per_second: float | None = None, piece_bytes: int = 64 << 20) -> list[str]:
        """Re-hash the whole served state against its digest, paced; returns the tensors that differ (`scrub.py`)."""
        return await scrub(self.held, bytes_per_second or self.config.scrub_bytes_per_second, piece_bytes)

    def healthy(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): serving a verified state and fewer than `unhealthy_after` failures in a row."""
        running = None if self._sync_started is None else time.monotonic() - self._sync_started
        self.status.sync_running_seconds = running
        stuck = running is not None and running > self.config.sync_deadline_seconds  # its cut-off did not take
        self.status.diverged = self.held.diverged
        ok = self.served is not None and self.status.consecutive_failures < self.config.unhealthy_after and not stuck
        ok = ok and self.held.diverged is None
        return ok, asdict(self.status) | {"healthy": ok}

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the store until stop is set: poll, sync, back off on failures; serve /metrics and /healthz."""
        await daemon.run(self, stop)
