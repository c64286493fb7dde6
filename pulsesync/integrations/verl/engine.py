"""`PulseSyncCheckpointEngine`: verl's checkpoint-engine verbs over a store (docs/integrations.md, "verl").

verl constructs the backend on every actor rank (`send_weights`) and in every rollout worker
(`receive_weights`, `get_weights`) with `rollout.checkpoint_engine.engine_kwargs.pulsesync`. The
store is the rendezvous: there is no process group to build between trainer and rollouts, which
may run in other clusters or regions. A step is what verl calls `global_steps`; a rollout worker
yields a step only once it holds it verified, and fails (naming it) when it cannot reach it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from pulsesync.config import validate_config
from pulsesync.errors import ConfigError, PolicyLagError
from pulsesync.integrations.verl.config import VerlBackendConfig
from pulsesync.integrations.verl.flushes import delta_flushes, whole_tensors
from pulsesync.integrations.verl.receiver import StepReceiver
from pulsesync.integrations.verl.sender import StepSender
from pulsesync.threads import LoopThread

_KWARGS = "rollout.checkpoint_engine.engine_kwargs.pulsesync"  # where a verl config sets what the backend gets


class PulseSyncCheckpointEngine:
    """verl's `CheckpointEngineWithCache` over pulsesync (registered as a virtual subclass where verl is installed)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.settings = validate_config(VerlBackendConfig, engine_kwargs, _KWARGS)
        self.wire_format: str = self.settings.wire_format  # read by verl's CheckpointEngineWorker
        self._sender: StepSender | None = None
        self._receiver: StepReceiver | None = None
        self._loop: LoopThread | None = None
        self._last_step = -1

    # --- the process group verl would build: the store stands in for it ----------------------------
    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Nothing to join: trainer and rollouts meet at the store."""

    def finalize(self) -> None:
        """Nothing to free between steps: the publisher and the subscriber persist."""

    # --- the actor side ------------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the step from this actor rank (its share of the tensors), returning once it is committed."""
        if self._sender is None:
            if self.settings.publisher is None:
                raise ConfigError(f"{_KWARGS}.publisher: the actor side needs it")
            self._sender = StepSender(self.settings.publisher)
        step = global_steps if global_steps is not None else self._last_step + 1
        share, state = self._sender.share(), dict[str, torch.Tensor]()
        if hasattr(weights, "__aiter__"):  # verl's engines yield either; each tensor is kept only by its owner
            async for name, tensor in weights:
                share.keep(state, name, tensor)
        else:
            for name, tensor in weights:
                share.keep(state, name, tensor)
        metrics = await asyncio.to_thread(self._sender.publish, step, state)
        self._last_step = step
        return metrics

    # --- the rollout side ----------------------------------------------------------------------
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Any]:
        """Reach the step, verified, and yield what verl's server adapter applies (in `wire_format`)."""
        receiver = self._receiving()
        served = await self._on_loop(receiver.reach(global_steps))
        update = receiver.update_for_engine(served)
        receiver.engine_holds = None  # unknown from the first flush the adapter takes until it took the last
        flushes: Iterator[Any] = (
            delta_flushes(update, served.state, served.digest.tensors, self.bucket_size)
            if self.wire_format == "delta_flush"
            else whole_tensors(update, served.state)
        )
        for flush in flushes:
            yield flush
        receiver.engine_holds = served.digest.root

    async def get_weights(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The held verified state, whole (verl's cached variant: partial rollouts update from it)."""
        served = self._receiving().subscriber.served
        if served is None:
            raise PolicyLagError("get_weights: this rollout worker holds no verified step yet (receive_weights first)")
        for name, tensor in served.state.items():
            yield name, tensor

    @property
    def held_step(self) -> int | None:
        """The verified step this rollout worker holds (None before the first)."""
        served = self._receiver.subscriber.served if self._receiver is not None else None
        return served.step if served is not None else None

    def _receiving(self) -> StepReceiver:
        if self._receiver is None:
            if self.settings.subscriber is None:
                raise ConfigError(f"{_KWARGS}.subscriber: the rollout side needs it")
            self._loop = LoopThread("pulsesync-verl-receiver")
            self._receiver = StepReceiver(self.settings.subscriber, self.settings.wait_seconds)
        return self._receiver

    async def _on_loop(self, coro: Any) -> Any:
        """Run on the receiver's own loop: verl may call each verb from another loop (a new one per call)."""
        assert self._loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop.loop))

    def close(self) -> None:
        """Flush and stop the publisher; close the subscriber."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._receiver is not None and self._loop is not None:
            self._loop.run(self._receiver.close())
            self._loop.stop()
            self._receiver = self._loop = None
