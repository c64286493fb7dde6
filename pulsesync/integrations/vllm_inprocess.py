"""Keep an in-process `vllm.LLM` following a store: the verl / OpenRLHF / TRL-colocate shape.

The engine is created in this process with pulsesync's weight-transfer backend::

    llm = vllm.LLM(model=LAUNCH_DIR, weight_transfer_config={"backend": "pulsesync"}, ...)
    follower = LLMFollower(llm, SubscriberConfig(store=..., trusted_keys=[...], cache_dir=...))
    follower.sync()          # between generate() calls: the newest verified step (or sync(step))
    outputs = llm.generate(prompts, params)
    follower.held            # HeldPolicy(step, digest) that every worker now holds
    follower.close()

The subscriber runs here, on an event loop of its own; each `sync()` verifies the chain as
`pulsesync subscribe` does and hands the state to the `vllm` sink, which drives the LLM's own
weight-transfer verbs (init, start, update, finish) with the same transactional session as for a
server. `sync()` must not run while the same LLM generates (vLLM's `LLM` is not re-entrant):
call it between batches, as those frameworks update weights between rollouts. There is no pause:
no request is running then. `AsyncLLMFollower` is the same for code that already runs an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pulsesync.sinks import build_sinks
from pulsesync.sinks.config import VLLMSinkConfig
from pulsesync.sinks.vllm.sidecar.sessions import EngineSession, Serving, TransferSession, TransferVerbs
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy, parse_version
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.subscriber.paths import SyncResult
from pulsesync.threads import LoopThread


class LLMVerbs(TransferVerbs):
    """The weight-transfer verbs as `vllm.LLM`'s methods (blocking: each runs in a thread)."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.where = llm, "in-process vllm.LLM"

    async def init(self, init_info: dict[str, Any]) -> None:
        await asyncio.to_thread(self.llm.init_weight_transfer_engine, {"init_info": init_info})

    async def start(self) -> None:
        await asyncio.to_thread(self.llm.start_weight_update)

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await asyncio.to_thread(self.llm.update_weights, {"update_info": update_info})

    async def finish(self, weight_version: str | None) -> None:
        await asyncio.to_thread(self.llm.finish_weight_update, weight_version)

    async def weight_version(self) -> str | None:
        version = await asyncio.to_thread(self.llm.get_weight_version)
        return version if isinstance(version, str) else None


class LLMServing(Serving):
    """An in-process engine between generate() calls: nothing runs, so nothing is paused."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.where = llm, "in-process vllm.LLM"

    def paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def resume(self) -> None:
        """Nothing is paused."""

    async def reset_prefix_cache(self) -> bool:
        return bool(await asyncio.to_thread(self.llm.reset_prefix_cache, True))

    async def is_sleeping(self) -> bool:
        return bool(await asyncio.to_thread(self.llm.llm_engine.is_sleeping))


class AsyncLLMFollower:
    """A subscriber whose `vllm` sink is an in-process `vllm.LLM` (plus the config's own sinks)."""

    def __init__(self, llm: Any, config: SubscriberConfig, update_dir: Path | None = None) -> None:
        if update_dir is None:
            if config.cache_dir is None:
                raise ValueError("give update_dir, or a cache_dir to keep update files under")
            update_dir = config.cache_dir / "vllm-updates"
        self.llm = llm
        self.update_dir = update_dir.expanduser().resolve()
        self.sink = VLLMSink(VLLMSinkConfig(url="in-process", update_dir=self.update_dir), connect=self._connect)
        self.subscriber = Subscriber(config, sinks=[*build_sinks(list(config.sinks)), self.sink])
        self._started = False

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[tuple[EngineSession, Serving]]:
        yield TransferSession(LLMVerbs(self.llm), self.update_dir), LLMServing(self.llm)

    async def sync(self, step: int | None = None) -> SyncResult:
        """Bring the engine to the newest verified step (or `step`); PulseSyncError when it cannot."""
        if not self._started:
            await self.subscriber.start()  # the cached state, delivered when the engine does not hold it
            self._started = True
        return await self.subscriber.sync(step)

    async def held(self) -> HeldPolicy | None:
        """What the engine's weight version names (None: not a state pulsesync delivered)."""
        return parse_version(await asyncio.to_thread(self.llm.get_weight_version))

    async def close(self) -> None:
        await self.subscriber.close()


class LLMFollower:
    """`AsyncLLMFollower` for blocking code: its own event loop on a thread."""

    def __init__(self, llm: Any, config: SubscriberConfig, update_dir: Path | None = None) -> None:
        self._loop = LoopThread("pulsesync-llm-follower")
        self._follower = AsyncLLMFollower(llm, config, update_dir)

    def sync(self, step: int | None = None) -> SyncResult:
        """Bring the engine to the newest verified step (or `step`); call it between generate() calls."""
        return self._loop.run(self._follower.sync(step))

    @property
    def held(self) -> HeldPolicy | None:
        """The step and digest every worker holds, as the engine's weight version names it."""
        return self._loop.run(self._follower.held())

    def close(self) -> None:
        if not self._loop.closed:
            self._loop.run(self._follower.close())
            self._loop.stop()
