"""The scrub: a bit flipped anywhere in the held state, touched by the last patch or not, is caught and repaired."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import metrics
from pulsesync.publisher import AsyncPublisher, PublisherConfig
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from tests.support.helpers import assert_states_equal
from tests.support.subscribing import subscriber


def _states() -> list[dict[str, torch.Tensor]]:
    """Step 0, then step 1 changing a few elements of 'trained' only; 'frozen' never changes."""
    gen = torch.Generator().manual_seed(0)
    step0 = {
        "trained": torch.randn(64, 64, generator=gen).to(torch.bfloat16),
        "frozen": torch.randn(4096, generator=gen).to(torch.bfloat16),
    }
    step1 = {n: t.clone() for n, t in step0.items()}
    step1["trained"].view(-1)[[3, 700, 4000]] += 1.0
    return [step0, step1]


async def _published(tmp_path: Path, key: Ed25519PrivateKey) -> tuple[Subscriber, list[dict[str, torch.Tensor]]]:
    """The two steps published; a subscriber serving step 0."""
    store, states = FileStore(tmp_path / "store"), _states()
    async with AsyncPublisher(PublisherConfig(anchor_interval=100), store=store, signing_key=key) as pub:
        for step, state in enumerate(states):
            await pub.publish(step, state)
    sub = subscriber(store, key)
    await sub.sync(0)
    return sub, states


def _flip(t: torch.Tensor, index: int) -> None:
    t.view(-1).view(torch.int16)[index] ^= 1


def _mismatches() -> float:
    return metrics.SCRUBS.labels("subscriber", "mismatch")._value.get()


@pytest.mark.parametrize(("name", "index"), [("trained", 700), ("trained", 5), ("frozen", 1234)])
async def test_one_flipped_bit_anywhere_is_caught_and_rebuilt(
    tmp_path: Path, key: Ed25519PrivateKey, name: str, index: int
) -> None:
    """Touched element, untouched element of a touched tensor, untouched tensor: all caught."""
    sub, states = await _published(tmp_path, key)
    assert (await sub.sync(1)).path == "fast"  # the digest was kept up to date from the 3 changed elements
    assert sub.digest is not None and sub.digest.algorithm == "mixsum-128"
    assert await sub.scrub(bytes_per_second=1e12) == []  # intact: nothing reported
    before = _mismatches()
    assert sub.state is not None
    _flip(sub.state[name], index)
    assert await sub.scrub(bytes_per_second=1e12, piece_bytes=1024) == [name]
    assert _mismatches() == before + 1
    assert not sub.healthy()[0]
    result = await sub.sync()  # the same step, rebuilt from the anchor and delivered again
    assert (result.step, result.path) == (1, "slow")
    assert_states_equal(sub.state, states[1])
    assert await sub.scrub(bytes_per_second=1e12) == [] and sub.healthy()[0]


async def test_a_scrub_is_paced_and_skips_what_a_sync_changes_under_it(tmp_path: Path, key: Ed25519PrivateKey) -> None:
    sub, _ = await _published(tmp_path, key)
    held = sum(t.numel() * t.element_size() for t in sub.state.values())  # type: ignore[union-attr]
    # 16 KiB at 64 KiB/s: about a quarter of a second, in 1 KiB pieces; a sync lands in the middle.
    scrub = asyncio.create_task(sub.scrub(bytes_per_second=64 << 10, piece_bytes=1024))
    await asyncio.sleep(0.1)
    assert not scrub.done()
    assert (await sub.sync(1)).path == "fast"
    assert await scrub == []  # what it read before the patch is not compared with the new digest
    assert held == 16384
