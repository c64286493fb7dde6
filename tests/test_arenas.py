"""The batch kernel's reused output memory (codec.arenas): never handed out while anything refers to it."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from pulsesync.codec import PatchHistory, UndoLog, apply_patch, encode
from pulsesync.codec import apply as apply_module
from pulsesync.codec.arenas import MAX_POOLED_BYTES, MIN_POOLED_BYTES, ArenaPool

SIZE = 3 * MIN_POOLED_BYTES


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_a_buffer_is_reused_only_once_every_view_of_it_is_gone() -> None:
    pool = ArenaPool()
    first = pool.take(SIZE)
    address = _address(first)
    positions = first[: SIZE // 2].view(np.int64)
    old = torch.from_numpy(first[SIZE // 2 :].view(np.int16))
    del first
    assert _address(pool.take(SIZE)) != address  # positions and old still refer to it
    del positions
    assert _address(pool.take(SIZE)) != address  # the tensor still does
    del old
    again = pool.take(SIZE - 1)
    assert _address(again) == address and again.size == SIZE - 1


def test_what_a_taken_buffer_holds_survives_later_takes() -> None:
    pool = ArenaPool()
    held = [pool.take(SIZE) for _ in range(6)]
    for i, buffer in enumerate(held):
        buffer[:] = i
    for _ in range(6):
        pool.take(SIZE)[:] = 255  # taken and dropped at once: reused, never one of `held`
    assert all(bool((buffer == i).all()) for i, buffer in enumerate(held))


def test_small_and_huge_requests_bypass_the_pool_and_it_keeps_a_few_buffers() -> None:
    pool = ArenaPool(kept=2)
    for size in (MIN_POOLED_BYTES - 1, MAX_POOLED_BYTES + 1):
        assert pool.take(size).size == size
    assert pool.pooled_bytes == 0
    held = [pool.take(SIZE) for _ in range(4)]
    assert len(held) == 4 and pool.pooled_bytes >= 4 * SIZE  # all referenced: none dropped
    del held
    pool.take(SIZE)
    assert pool.pooled_bytes <= 2 * 2 * SIZE  # back to `kept` buffers once they are free


def test_a_history_coded_chain_applies_bit_exact_through_pooled_buffers() -> None:
    """Each patch's outputs (its undo log, the history the next patch decodes against) live in a
    pooled buffer, reused once a step's log and history are dropped: every step stays bit-exact."""
    gen = torch.Generator().manual_seed(3)
    states = [{"w": (torch.randn(1 << 22, generator=gen) * 0.02).to(torch.bfloat16)}]
    recurring = torch.rand(1 << 22, generator=gen) < 0.03  # ~110k changes a step: a pooled buffer each
    for _ in range(5):
        bits = states[-1]["w"].view(torch.int16) + (recurring & (torch.rand(1 << 22, generator=gen) < 0.9))
        states.append({"w": bits.view(torch.bfloat16)})
    held = {"w": states[0]["w"].clone()}
    reference: PatchHistory | None = None
    held_history: PatchHistory | None = None
    reused = apply_module._ARENAS.reused
    for old, new in itertools.pairwise(states):
        encoded = encode(old, new, reference=reference)
        history, undo = PatchHistory(encoded.history.sha256), UndoLog()
        apply_patch(held, encoded.data, reference=held_history, history=history, undo=undo)
        assert torch.equal(held["w"].view(torch.int16), new["w"].view(torch.int16))
        reference, held_history = encoded.history, history  # the step before's history and log are dropped
    assert apply_module._ARENAS.reused > reused
    undo.rollback(held)
    assert torch.equal(held["w"].view(torch.int16), states[-2]["w"].view(torch.int16))
