"""A small published chain and subscribers on it: what the subscriber and hardening tests share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.protocol import signing
from pulsesync.publisher import AsyncPublisher
from pulsesync.store import Store
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal, trainer_states

STATES = 12
FAST_RETRY = SubscriberConfig(retry_initial_seconds=0.01, retry_max_seconds=0.05)


async def publish(pub: AsyncPublisher, steps: range) -> None:
    """Publish the trainer's states for `steps` and wait until they are committed."""
    for step in steps:
        await pub.publish(step, trainer_states(STATES)[step], {"config.json": b'{"model_type": "t"}'})
    await pub.flush()


def subscriber(store: Store, key: Ed25519PrivateKey, **overrides: Any) -> Subscriber:
    """A subscriber trusting `key`, retrying fast, with config `overrides`."""
    config = FAST_RETRY.model_copy(update=overrides)
    return Subscriber(config, store=store, trusted=signing.trusted_keys([key.public_key()]))


def assert_serving(sub: Subscriber, step: int) -> None:
    """The subscriber serves the trainer's state of `step`, bit for bit."""
    assert sub.step == step
    assert sub.state is not None
    assert_states_equal(sub.state, trainer_states(STATES)[step])


async def wait_for(condition: Callable[[], bool], what: str, seconds: float = 30, sub: Any = None) -> None:
    """Poll until condition holds; fail naming `what` (and the daemon's status) after `seconds`, or once the
    daemon task set as `sub.task` ended."""
    deadline = time.monotonic() + seconds
    while not condition():
        task = getattr(sub, "task", None)
        if time.monotonic() > deadline or (task is not None and task.done()):
            raise AssertionError(f"timed out waiting for {what}; status {sub.status if sub else None}")
        await asyncio.sleep(0.02)
