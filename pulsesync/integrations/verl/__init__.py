"""pulsesync as a verl checkpoint engine: trainer and rollouts meet at a store, in any cluster or region.

In a verl config::

    actor_rollout_ref.rollout.checkpoint_engine:
      backend: pulsesync
      custom_backend_module: pulsesync.integrations.verl
      engine_kwargs: {pulsesync: {publisher: {...}, subscriber: {...}}}

verl imports this package in every worker before it builds the backend; importing it registers
`PulseSyncCheckpointEngine` under `pulsesync` in verl's `CheckpointEngineRegistry`. Without verl
installed it imports and registers nothing.
"""

from __future__ import annotations

from pulsesync.integrations.verl.engine import PulseSyncCheckpointEngine

BACKEND = "pulsesync"


def register() -> bool:
    """Register the backend with verl (a virtual subclass of its `CheckpointEngineWithCache`); False without verl."""
    try:
        from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache
    except ImportError:
        return False
    CheckpointEngineWithCache.register(PulseSyncCheckpointEngine)
    CheckpointEngineRegistry.register(BACKEND)(PulseSyncCheckpointEngine)
    return True


register()

__all__ = ["BACKEND", "PulseSyncCheckpointEngine", "register"]
