"""The mixsum-128 digest: its definition, kernel parity, and the incremental update equal to the full one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsesync import mixsum
from pulsesync.codec import CodecParams, PatchHistory, UndoLog, apply_patch, encode, jit
from pulsesync.digest import StateDigest, lane_change, state_digest, tensor_digest, update_digest
from tests.support.helpers import assert_states_equal, clone_state, state_pairs

M64 = (1 << 64) - 1


def _reference_term(lane: int, index: int, bits: int) -> int:
    """The documented term, in plain Python integers (independent of mixsum's numpy code)."""
    seed, mul = [(0x243F6A8885A308D3, 0x9E3779B97F4A7C15), (0x13198A2E03707344, 0xD6E8FEB86659FD93)][lane]
    x = (((index + seed) * mul) & M64) ^ bits
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


@pytest.fixture(params=[True, False], ids=["numba", "numpy"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if request.param and mixsum._sum_range_kernel is None:
        pytest.skip("no numba")
    monkeypatch.setattr(mixsum, "enabled", request.param)
    return bool(request.param)


def test_known_answer_is_the_documented_definition(kernels: bool) -> None:
    t = torch.tensor([1.5, -0.0, 3.0], dtype=torch.bfloat16)
    raw = t.view(torch.int16).numpy().view(np.uint16)
    lanes = [sum(_reference_term(lane, i, int(v)) for i, v in enumerate(raw)) & M64 for lane in (0, 1)]
    assert tensor_digest(t, "mixsum-128").digest == f"{lanes[0]:016x}{lanes[1]:016x}"


@settings(max_examples=50)
@given(width=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**32 - 1), first=st.integers(0, 2**40))
def test_kernels_and_numpy_give_identical_sums(width: int, seed: int, first: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**63, 3000, dtype=np.uint64).astype(np.dtype(f"u{width}"))
    positions = np.sort(rng.choice(3000, 200, replace=False)).astype(np.int64)
    results = set()
    for enabled in [True, False] if mixsum._sum_range_kernel is not None else [False]:
        mixsum.enabled = enabled
        try:
            old = values[::-1].copy()
            moved = (
                mixsum.change(old, values, first),
                mixsum.change(old[positions], values[positions], first, positions),
            )
            results.add((mixsum.sum_range(values, first), mixsum.sum_at(values[positions], positions, first), *moved))
        finally:
            mixsum.enabled = mixsum._sum_range_kernel is not None
    assert len(results) == 1


def test_any_single_element_change_changes_both_lanes() -> None:
    # For a fixed index the term is a bijection of the value: no single change can cancel out.
    t = torch.zeros(4096, dtype=torch.bfloat16)
    before = mixsum.from_hex(tensor_digest(t, "mixsum-128").digest)
    for index, bits in [(0, 1), (17, 0x8000), (4095, 0x7FFF), (2048, 0xFFFF)]:
        changed = t.clone()
        changed.view(torch.int16)[index] = np.int16(np.uint16(bits).view(np.int16))
        after = mixsum.from_hex(tensor_digest(changed, "mixsum-128").digest)
        assert after[0] != before[0] and after[1] != before[1]


@settings(max_examples=60, deadline=None)
@given(
    pair=state_pairs(),
    undo=st.booleans(),
    history=st.booleans(),
    format_version=st.sampled_from([1, 2]),
    apply_kernels=st.booleans(),
)
def test_incremental_update_equals_the_full_digest(
    pair: tuple[dict, dict], undo: bool, history: bool, format_version: int, apply_kernels: bool
) -> None:
    """Publisher (the encoder's update) and subscriber (each apply path's update) all equal the full computation."""
    base, new = pair
    params = CodecParams(chunk_elements=1024, digest_algorithm="mixsum-128", format_version=format_version)
    base_digest = state_digest(base, "mixsum-128")
    full = state_digest(new, "mixsum-128")
    encoded = encode(base, new, params, base_digest=base_digest)
    assert encoded.digest == full  # every per-tensor entry and the root, bit for bit
    work = clone_state(base)
    log, collected = UndoLog() if undo else None, PatchHistory(encoded.history.sha256) if history else None
    enabled = jit.enabled
    jit.enabled = enabled and apply_kernels  # off: the numpy paths update the digest from the undo values
    try:
        applied = apply_patch(work, encoded.data, base_digest=base_digest, undo=log, history=collected)
    finally:
        jit.enabled = enabled
    assert_states_equal(work, new)
    assert applied == full


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), changes=st.integers(0, 300), start=st.integers(0, 1000))
def test_update_digest_from_lane_changes(seed: int, changes: int, start: int) -> None:
    rng = np.random.default_rng(seed)
    state = {"w": torch.from_numpy(rng.integers(-(2**15), 2**15, 5000, dtype=np.int16)).view(torch.bfloat16)}
    base = state_digest(state, "mixsum-128")
    positions = np.sort(rng.choice(5000 - start, changes, replace=False)).astype(np.int64)
    chunk, index = state["w"].view(torch.int16)[start:], torch.from_numpy(positions)
    old = chunk[index].clone()
    chunk[index] = torch.from_numpy(rng.integers(-(2**15), 2**15, changes, dtype=np.int16))
    moved = [("w", lane_change(old, chunk[index], start, positions))]
    updated = update_digest(base, state, moved, whole=[])
    assert updated == state_digest(state, "mixsum-128")
    # The digest the caller expects (a manifest's) is returned itself when the update arrives at it,
    # and ignored when it does not: the update is then made as without it (its caller names the mismatch).
    expected = state_digest(state, "mixsum-128")
    assert update_digest(base, state, moved, whole=[], expected=expected) is expected
    other = state_digest({"w": state["w"].neg()}, "mixsum-128")
    assert update_digest(base, state, moved, whole=[], expected=other) == updated != other


def test_non_incremental_algorithms_refuse_an_update() -> None:
    state = {"w": torch.zeros(4)}
    with pytest.raises(ValueError, match="incrementally"):
        update_digest(state_digest(state, "xxh3-128"), state, [], whole=[])


def test_format_1_defaults_to_the_digest_old_subscribers_read() -> None:
    assert CodecParams(format_version=1).digest_algorithm == "xxh3-128"
    assert CodecParams().digest_algorithm == "mixsum-128"
    assert StateDigest.model_validate(state_digest({"w": torch.ones(2)}).model_dump()).algorithm == "mixsum-128"
