"""The served state's scopes (subscriber/held.py): a patch waits for readers, readers wait for a patch,
and neither wait ever blocks the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from pulsesync.digest import state_digest
from pulsesync.subscriber.held import HeldState
from pulsesync.verified import VerifiedState


def held_with(state: dict[str, torch.Tensor]) -> HeldState:
    held = HeldState()
    held.serve(VerifiedState(1, state, state_digest(state)))
    return held


async def test_a_patch_waits_for_a_reader_in_a_thread_while_the_loop_runs_on() -> None:
    held = held_with({"w": torch.zeros(4)})
    order: list[str] = []
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    async def read_slowly() -> None:
        async with held.reading():
            order.append("read")
            await asyncio.to_thread(time.sleep, 0.5)  # a base written to cache_dir
            order.append("read done")

    async def patch() -> None:
        async with held.patching():
            order.append("patch")

    beat = asyncio.create_task(heartbeat())
    reader = asyncio.create_task(read_slowly())
    await asyncio.sleep(0.05)
    version = held.version
    await patch()
    await reader
    beat.cancel()
    assert order == ["read", "read done", "patch"] and held.version == version + 1
    assert ticks >= 25  # the loop ran on all the while the patch waited (0.5 s of 10 ms ticks)


async def test_apply_to_from_another_thread_waits_for_a_patch_and_copies_what_follows_it() -> None:
    held = held_with({"w": torch.zeros(4)})
    module = torch.nn.Module()
    module.register_buffer("w", torch.full((4,), 7.0))
    copied = threading.Event()

    def copy_from_a_thread() -> None:
        held.copy_into(module)
        copied.set()

    async with held.patching():
        thread = threading.Thread(target=copy_from_a_thread)
        thread.start()
        await asyncio.sleep(0.2)
        assert not copied.is_set()  # it waits while the state is patched
        held.served.state["w"].fill_(3.0)  # type: ignore[union-attr]
    await asyncio.to_thread(copied.wait, 10)
    thread.join()
    assert torch.equal(module.w.view(torch.int32), torch.full((4,), 3.0).view(torch.int32))  # type: ignore[operator]
