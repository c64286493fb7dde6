"""Patch format 2: adaptive record codings, HISTORY records, the PULSE bound, compatibility (issue 15).

Codec properties run with both kernels (numba's fused path and numpy's); end-to-end tests run the
publisher and subscribers on the store fixture (a real filesystem and moto's S3 server).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pulsesync.codec import (
    CodecParams,
    PatchDecoder,
    PatchHistory,
    RecordKind,
    UndoLog,
    ValueCoding,
    apply_patch,
    diff,
    encode,
    encode_part,
    jit,
    read_header,
)
from pulsesync.codec.baseline import pulse_encode, pulse_wire
from pulsesync.codec.codings import history as history_coding
from pulsesync.codec.encoder import _Changes
from pulsesync.codec.format import RECORD_FIXED_V2, PositionCoding, parse_header
from pulsesync.codec.history import ChunkHistory
from pulsesync.digest import state_digest
from pulsesync.dtypes import DTYPES
from pulsesync.errors import CorruptPatchError, MissingReferenceError, PulseSyncError
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import AnchorManifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.retention import RetentionPolicy, RetentionWorker
from pulsesync.sharding import Piece
from pulsesync.store import Store
from pulsesync.synthetic import real_like_trainer
from tests.support.helpers import assert_states_equal, mutate, publisher_config, random_bits
from tests.support.subscribing import subscriber

State = dict[str, torch.Tensor]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["numba", "numpy"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run with numba's kernels, then with the numpy path."""
    if request.param == "numpy":
        monkeypatch.setattr(jit, "enabled", False)
    elif not jit.enabled:
        pytest.skip("numba is not installed")
    yield request.param


def _real_like_states(n: int, hidden: int = 64, seed: int = 0) -> list[State]:
    trainer = real_like_trainer(hidden, 2, seed=seed, lr=1e-5)
    states = [trainer.state()]
    for _ in range(n - 1):
        trainer.step()
        states.append(trainer.state())
    return states


def _apply(state: State, patch: bytes, reference: PatchHistory | None) -> tuple[State, PatchHistory]:
    work = {n: t.clone() for n, t in state.items()}
    history = PatchHistory(hashlib.sha256(patch).hexdigest())
    apply_patch(work, patch, reference=reference, history=history)
    return work, history


def _kinds(patch: bytes) -> set[tuple[RecordKind, ValueCoding, PositionCoding]]:
    return {(h.kind, h.coding, h.positions) for h, _ in PatchDecoder().split(patch)}


def _assert_same_history(a: PatchHistory, b: PatchHistory) -> None:
    assert a.sha256 == b.sha256 and a.chunks.keys() == b.chunks.keys()
    for key, chunk in a.chunks.items():
        assert np.array_equal(chunk.positions, b.chunks[key].positions), key
        assert chunk.deltas.dtype == b.chunks[key].deltas.dtype
        assert np.array_equal(chunk.deltas, b.chunks[key].deltas), key


@st.composite
def chains(draw: st.DrawFn) -> list[State]:
    """Three steps of one tensor whose changes recur (same positions, often the same delta) or not."""
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int16, torch.uint8]))
    numel = draw(st.integers(1, 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    raw_bytes = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    states = [{"w": raw_bytes.view(dtype).clone(), "k": torch.zeros(7, dtype=dtype)}]
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    density = draw(st.floats(0.0, 1.0))
    recurring = torch.rand(numel, generator=gen) < density
    for _ in range(2):
        fresh = torch.rand(numel, generator=gen) < density / 4
        mask = (recurring & (torch.rand(numel, generator=gen) < 0.8)) | fresh
        bump = torch.randint(-3, 4, (numel,), generator=gen, dtype=width) * mask.to(width)
        bits = states[-1]["w"].view(width) + bump
        states.append({"w": bits.view(dtype).clone(), "k": states[-1]["k"].clone()})
    return states


@SETTINGS
@given(states=chains())
def test_history_chains_round_trip_bit_exact_with_both_kernels(kernel: str, states: list[State]) -> None:
    """Every step decodes bit-exactly against the reference the subscriber holds; both ends agree on the history."""
    reference: PatchHistory | None = None
    held: PatchHistory | None = None
    for old, new in itertools.pairwise(states):
        encoded = encode(old, new, reference=reference)
        got, history = _apply(old, encoded.data, held)
        assert_states_equal(got, new)
        _assert_same_history(encoded.history, history)
        reference, held = encoded.history, history


@SETTINGS
@given(
    numel=st.integers(1, 5000),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.int16]),
    seed=st.integers(0, 2**31 - 1),
    history=st.booleans(),
)
def test_a_patch_is_never_larger_than_the_pulse_default_plus_its_framing(
    numel: int, density: float, dtype: torch.dtype, seed: int, history: bool
) -> None:
    """Adversarial changes included (random bits, every element changed): PULSE's bytes + fixed framing bound it."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16, generator=gen)
    new = torch.where(
        torch.rand(numel, generator=gen) < density,
        torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16, generator=gen),
        old,
    )
    base, target = {"t": old.view(dtype)}, {"t": new.view(dtype)}
    reference = encode(target, base).history if history else None  # the opposite change, as a reference
    patch = encode(base, target, reference=reference).data
    records = len(PatchDecoder().split(patch))
    parsed = parse_header(patch)
    assert parsed is not None
    framing = parsed[1] + (records + 1) * (RECORD_FIXED_V2.size + len("t") + 8 + 4 + 24)
    assert len(patch) <= len(pulse_encode(base, target)) + framing


@functools.cache  # built once per process (~0.7 s): the tests below only read it (they apply to clones)
def _coverage_patches() -> list[tuple[State, bytes, PatchHistory | None]]:
    """Patches that hold, between them, every record kind and coding of formats 2 and 3."""
    states = _real_like_states(4)
    out: list[tuple[State, bytes, PatchHistory | None]] = []
    reference = None
    for old, new in itertools.pairwise(states):
        encoded = encode(old, new, CodecParams(chunk_elements=1024), reference=reference)
        out.append((old, encoded.data, reference))
        reference = encoded.history
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4096, generator=gen).to(torch.bfloat16)
    noisy = torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    one_ulp = (old.view(torch.int16) + (torch.rand(4096, generator=gen) < 0.02).to(torch.int16)).view(torch.bfloat16)
    every_ulp = (old.view(torch.int16) + 1).view(torch.bfloat16)
    # Every 256th element may change: u16 gaps whose low byte is constant beat gap codes.
    aligned = old.view(torch.int16).clone()
    aligned[::256] += (torch.rand(16, generator=gen) < 0.5).to(torch.int16)
    sparse_noise = torch.where(torch.rand(4096, generator=gen) < 0.3, noisy, old)  # random bits: RAW values
    # Every weight below 2**-8 moves (whole magnitude classes, as a bf16 fine-tune's): CLASS_MASKS positions.
    small = old.abs() < 2**-8
    classes = (old.view(torch.int16) + small.to(torch.int16) * 40).view(torch.bfloat16)
    for new in (noisy, every_ulp, one_ulp, aligned.view(torch.bfloat16), sparse_noise, classes):
        out.append(({"t": old}, encode({"t": old}, {"t": new}).data, None))
    # fp16: EXP_CODES values in HISTORY records too (PREDICTED_CODES is for bf16).
    halves, moving16 = [torch.randn(4096, generator=gen).half()], (torch.rand(4096, generator=gen) < 0.05)
    for _ in range(2):
        halves.append((halves[-1].view(torch.int16) + moving16.to(torch.int16) * 3).view(torch.float16))
    first16 = encode({"t": halves[0]}, {"t": halves[1]})
    second16 = encode({"t": halves[1]}, {"t": halves[2]}, reference=first16.history).data
    out.append(({"t": halves[1]}, second16, first16.history))
    # fp32: EXP_PLANES values (EXP_CODES is for 2-byte floats), history-coded too.
    floats, moving = [torch.randn(4096, generator=gen)], (torch.rand(4096, generator=gen) < 0.05).to(torch.int32)
    for _ in range(2):
        floats.append((floats[-1].view(torch.int32) + moving * 300).view(torch.float32))
    first32 = encode({"t": floats[0]}, {"t": floats[1]})
    out.append(({"t": floats[0]}, first32.data, None))
    second32 = encode({"t": floats[1]}, {"t": floats[2]}, reference=first32.history).data
    out.append(({"t": floats[1]}, second32, first32.history))
    # Integers: plain PLANES values, history-coded too.
    ints = [torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16, generator=gen)]
    recurring = torch.rand(4096, generator=gen) < 0.05
    for _ in range(2):
        ints.append(ints[-1] + torch.randint(-200, 200, (4096,), dtype=torch.int16, generator=gen) * recurring)
    first = encode({"t": ints[0]}, {"t": ints[1]})
    out.append(({"t": ints[0]}, first.data, None))
    out.append(({"t": ints[1]}, encode({"t": ints[1]}, {"t": ints[2]}, reference=first.history).data, first.history))
    return out


def _as_held(reference: PatchHistory | None, base: State, values: bool) -> PatchHistory | None:
    """A reference as a subscriber holds it: with `values`, as the batch kernel leaves it after applying that
    patch (the new values it wrote, which `base`, the state after it, holds there) for 2-byte floats."""
    if reference is None or not values:
        return reference
    chunks = {}
    for (name, start, length), chunk in reference.chunks.items():
        tensor = base[name]
        if tensor.element_size() == 2 and tensor.is_floating_point():
            positions, deltas = np.ascontiguousarray(chunk.positions), np.ascontiguousarray(chunk.deltas)
            held = tensor.view(-1).view(torch.int16).numpy()[start + positions].copy()
            addresses = (positions.ctypes.data, deltas.ctypes.data, held.ctypes.data)
            chunk = ChunkHistory(positions, deltas, addresses, held)
        chunks[(name, start, length)] = chunk
    return PatchHistory(reference.sha256, chunks)


# Every coverage patch as coded against its reference, and each history-coded one again against the
# reference a subscriber's kernel holds (with the values it wrote).
_COVERAGE_CASES = [pytest.param(i, False, id=f"{i}-reference") for i in range(len(_coverage_patches()))] + [
    pytest.param(i, True, id=f"{i}-held-values")
    for i, (_, _, reference) in enumerate(_coverage_patches())
    if reference is not None
]


def test_the_coverage_patches_hold_every_record_kind() -> None:
    kinds = set().union(*(_kinds(patch) for _, patch, _ in _coverage_patches()))
    expected = {
        (RecordKind.HISTORY, ValueCoding.PREDICTED_CODES),
        (RecordKind.HISTORY, ValueCoding.EXP_CODES),
        (RecordKind.SPARSE, ValueCoding.EXP_CODES),
        (RecordKind.HISTORY, ValueCoding.EXP_PLANES),
        (RecordKind.HISTORY, ValueCoding.PLANES),
        (RecordKind.SPARSE, ValueCoding.EXP_PLANES),
        (RecordKind.SPARSE, ValueCoding.PLANES),
        (RecordKind.SPARSE, ValueCoding.DELTA),
        (RecordKind.SPARSE, ValueCoding.RAW),
        (RecordKind.DENSE, ValueCoding.RAW),
        (RecordKind.DENSE, ValueCoding.DELTA),
    }
    assert expected <= {(kind, coding) for kind, coding, _ in kinds}, expected
    position_codings = {(kind, positions) for kind, _, positions in kinds}
    every = {(kind, positions) for kind in (RecordKind.SPARSE, RecordKind.HISTORY) for positions in PositionCoding}
    assert every - {(RecordKind.HISTORY, PositionCoding.CLASS_MASKS)} <= position_codings


@pytest.mark.skipif(not jit.enabled, reason="numba is not installed")
@pytest.mark.parametrize(("index", "values"), _COVERAGE_CASES)
def test_the_kernels_and_numpy_apply_every_coverage_patch_alike(
    index: int, values: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record kind and coding (RAW values of 2-byte floats batched too): same state, undo log and history;
    also where the reference holds the values its patch wrote (_apply_history_known)."""
    base, patch, reference = _coverage_patches()[index]
    reference = _as_held(reference, base, values)
    outcomes = []
    for enabled in (True, False):
        monkeypatch.setattr(jit, "enabled", enabled)
        work, undo = {n: t.clone() for n, t in base.items()}, UndoLog()
        history = PatchHistory(hashlib.sha256(patch).hexdigest())
        apply_patch(work, patch, reference=reference, history=history, undo=undo)
        outcomes.append((work, undo.changed(), history))
        undo.rollback(work)
        assert_states_equal(work, base)
    (kernel_state, kernel_changed, kernel_history), (numpy_state, numpy_changed, numpy_history) = outcomes
    assert_states_equal(kernel_state, numpy_state)
    assert kernel_changed.keys() == numpy_changed.keys()
    for name, positions in kernel_changed.items():
        other = numpy_changed[name]
        assert (positions is None and other is None) or (
            positions is not None and other is not None and torch.equal(positions, other)
        )
    _assert_same_history(kernel_history, numpy_history)


@pytest.mark.parametrize(("index", "values"), _COVERAGE_CASES)
def test_any_flipped_byte_is_an_error_and_the_state_rolls_back(kernel: str, index: int, values: bool) -> None:
    """Corruption anywhere in a format-2 patch: a pulsesync error (never another exception); undo restores the state."""
    base, patch, reference = _coverage_patches()[index]
    reference = _as_held(reference, base, values)
    rng = np.random.default_rng(index)
    for offset in rng.choice(len(patch), size=min(len(patch), 60), replace=False):
        flipped = bytearray(patch)
        flipped[offset] ^= 1 << int(rng.integers(8))
        work = {n: t.clone() for n, t in base.items()}
        undo = UndoLog()
        try:
            apply_patch(work, bytes(flipped), reference=reference, undo=undo)
        except PulseSyncError:
            undo.rollback(work)
            assert_states_equal(work, base)
        else:  # a flip inside the zstd frame that zstd's checksum and our hash both let through cannot happen
            raise AssertionError(f"flipped bit at byte {offset} was accepted")


def _bf16_specials() -> np.ndarray:
    """Every kind of bf16 bit pattern: zeros, subnormals, the smallest and largest normals, infinities, NaNs."""
    values = [0, 1, 0x7F, 0x80, 0x81, 0x3F80, 0x7F7F, 0x7F80, 0x7F81, 0x7FC0, 0x0100, 0x1234]
    return np.array(values + [v | 0x8000 for v in values], np.uint16).view(np.int16)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_predicted_offsets_agree_on_both_paths_and_with_float_arithmetic(seed: int) -> None:
    """PREDICTED_CODES' prediction: numba's kernel and numpy give the same bits for every pattern, and they are
    the bf16 nearest 2 * old - prev wherever both are finite and close (float64 is exact there)."""
    rng = np.random.default_rng(seed)
    specials = _bf16_specials()
    old = np.concatenate([rng.integers(-(2**15), 2**15, 4000), np.repeat(specials, specials.size)]).astype(np.int16)
    deltas = np.concatenate([rng.integers(-400, 400, 2000), rng.integers(-(2**15), 2**15, 2000)])
    deltas = np.concatenate([deltas, np.tile(specials, specials.size)]).astype(np.int16)
    deltas[::13] = 0  # new positions: no prediction
    numpy_offsets = _offsets_without_numba(old, deltas)
    if jit.enabled:
        assert np.array_equal(history_coding.predicted_offsets(old, deltas), numpy_offsets)
    ordered = old.astype(np.int64) ^ ((old.astype(np.int64) >> 15) & 0x7FFF)
    prev_ordered = ((ordered - deltas + 32768) & 0xFFFF) - 32768
    prev = (prev_ordered ^ ((prev_ordered >> 15) & 0x7FFF)).astype(np.int16)
    as_float = [torch.from_numpy(x).view(torch.bfloat16).double() for x in (old, prev)]
    exact = (2 * as_float[0] - as_float[1]).float()  # exact in float64; float32 keeps 24 of bf16's 8 bits
    expected = exact.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64)
    expected_offsets = ((expected ^ ((expected >> 15) & 0x7FFF)) - ordered + 32768) % 65536 - 32768
    exponent = [(x.astype(np.int64) >> 7) & 0xFF for x in (old, prev)]
    comparable = (deltas != 0) & (exponent[0] < 0xFF) & (exponent[1] < 0xFF) & torch.isfinite(exact).numpy()
    comparable &= np.abs(exponent[0] - exponent[1]) <= 8  # float32's 24 bits hold both without rounding
    assert comparable.sum() > 1000
    assert np.array_equal(numpy_offsets[comparable], expected_offsets[comparable])
    assert not numpy_offsets[deltas == 0].any()


@pytest.mark.skipif(not jit.enabled, reason="needs numba")
def test_the_kernels_within_a_binade_shortcut_agrees_with_the_full_prediction_on_every_bf16_value() -> None:
    """history_coding._predicted_offset skips the rounding where old, prev and the prediction share a binade: every bf16
    value, moved -24..24 steps, gets numpy's exactly computed offset (the shortcut's edges: signed zeros,
    subnormals, binade ends, infinities and NaNs are all among them)."""
    every = np.arange(-(2**15), 2**15, dtype=np.int64).astype(np.int16)
    moves = np.arange(-24, 25, dtype=np.int16)
    old, deltas = np.repeat(every, moves.size), np.tile(moves, every.size)
    assert np.array_equal(history_coding.predicted_offsets(old, deltas), _offsets_without_numba(old, deltas))


@pytest.mark.skipif(not jit.enabled, reason="needs numba")
def test_the_kernels_float64_rounding_agrees_with_numpys_integer_rounding_on_every_bf16_value() -> None:
    """Where old, prev and the prediction do not share a binade, the kernel rounds 2 * old - prev from its
    float64 bits, numpy from an exact integer: every bf16 value, moved by 25 to 32768 steps either way (a real
    fine-tune's moves: a median of 36 on SmolLM2-135M), gets the same offset from both."""
    every = np.arange(-(2**15), 2**15, dtype=np.int64).astype(np.int16)
    steps = np.unique(np.round(np.geomspace(25, 2**15, 24)).astype(np.int64))
    moves = np.concatenate([steps, -steps]).astype(np.int64)
    moves = ((moves + 2**15) % 2**16 - 2**15).astype(np.int16)
    old, deltas = np.repeat(every, moves.size), np.tile(moves, every.size)
    assert np.array_equal(history_coding.predicted_offsets(old, deltas), _offsets_without_numba(old, deltas))


def _offsets_without_numba(old: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    return np.asarray(_without_numba(history_coding.predicted_offsets, old, deltas))


def _without_numba(fn: Any, *args: Any) -> Any:
    enabled = jit.enabled
    jit.enabled = False
    try:
        return fn(*args)
    finally:
        jit.enabled = enabled


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([np.uint8, np.int16, np.int32, np.int64]),
    size=st.integers(0, 300),
    skew=st.integers(0, 7),
)
def test_changed_elements_agree_on_both_paths(seed: int, dtype: type[np.integer], size: int, skew: int) -> None:
    """The encoder's diff: numba's word-at-a-time kernel and numpy find the same positions and elements, for
    every element width, at any alignment (a slice `skew` elements in) and with a tail shorter than a word."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    old = rng.integers(info.min, info.max, size + skew, dtype=dtype, endpoint=True)
    new = old.copy()
    flips = rng.random(new.size) < rng.choice([0.0, 0.01, 0.3, 1.0])
    new[flips] ^= np.array(1, dtype) << rng.integers(0, 8 * old.itemsize, int(flips.sum())).astype(dtype)
    old, new = old[skew:], new[skew:]
    expected = np.flatnonzero(old != new)
    for positions, old_found, new_found in (
        diff.changed_elements(old, new),
        _without_numba(diff.changed_elements, old, new),
    ):
        assert np.array_equal(positions, expected) and positions.dtype == np.int64
        assert old_found.dtype == new_found.dtype == dtype
        assert np.array_equal(old_found, old[expected]) and np.array_equal(new_found, new[expected])


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), overlap=st.floats(0, 1))
def test_matching_a_reference_agrees_on_both_paths(seed: int, overlap: float) -> None:
    """A HISTORY record's match against its reference: the same recurring bitmap, aligned deltas and new
    positions from numba's merge and numpy's binary search."""
    rng = np.random.default_rng(seed)
    ref_positions = np.unique(rng.integers(0, 5000, rng.integers(0, 800)))
    recurring = ref_positions[rng.random(ref_positions.size) < overlap]
    positions = np.unique(np.concatenate([recurring, rng.integers(0, 5000, rng.integers(0, 800))]))
    ref_deltas = rng.integers(-(2**15), 2**15, ref_positions.size).astype(np.int16)
    got = history_coding.match_reference(positions, ref_positions, ref_deltas)
    want = _without_numba(history_coding.match_reference, positions, ref_positions, ref_deltas)
    again = np.isin(ref_positions, positions)
    assert np.array_equal(want[0], again) and np.array_equal(want[2], positions[~np.isin(positions, ref_positions)])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.skipif(not jit.enabled, reason="needs numba")
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), overlap=st.floats(0, 1), repeat=st.booleans())
def test_merging_a_history_records_positions_agrees_with_a_sorted_union(
    seed: int, overlap: float, repeat: bool
) -> None:
    """The decoder's branch-free merge: the reference positions marked again and the new ones, sorted, each
    with its reference delta (0 where new); a new position that repeats a marked reference one is refused."""
    rng = np.random.default_rng(seed)
    ref_positions = np.unique(rng.integers(0, 5000, rng.integers(0, 800)))
    ref_deltas = rng.integers(-(2**15), 2**15, ref_positions.size).astype(np.int16)
    again = rng.random(ref_positions.size) < overlap
    fresh = np.setdiff1d(np.unique(rng.integers(0, 5000, rng.integers(0, 800))), ref_positions)
    if repeat and again.any():
        fresh = np.union1d(fresh, rng.choice(ref_positions[again], 1))
    positions, deltas = np.empty(again.sum() + fresh.size, np.int64), np.empty(again.sum() + fresh.size, np.int16)
    assert history_coding.merge_history_kernel is not None
    merged = history_coding.merge_history_kernel(ref_positions, ref_deltas, again, fresh, positions, deltas)
    assert merged == (not repeat or not again.any())
    if merged:
        union = np.concatenate([ref_positions[again], fresh])
        order = np.argsort(union)
        assert np.array_equal(positions, union[order])
        assert np.array_equal(deltas, np.concatenate([ref_deltas[again], np.zeros(fresh.size, np.int16)])[order])


def test_new_values_simpler_than_their_moves_are_stored_raw() -> None:
    """A prune (5% of the weights set to zero) is coded as RAW values, weighed only where their entropy says
    they might pay: the patch is far smaller than the moves to zero would be."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(1 << 16, generator=gen).to(torch.bfloat16)
    pruned = torch.where(torch.rand(1 << 16, generator=gen) < 0.05, torch.zeros_like(old), old)
    encoded = encode({"t": old}, {"t": pruned})
    assert encoded.codings == {"SPARSE/RAW/GAP_CODES": 1}
    assert encoded.wire["values"] < 100  # ~3,300 zeros
    work = {"t": old.clone()}
    apply_patch(work, encoded.data)
    assert torch.equal(work["t"].view(torch.int16), pruned.view(torch.int16))


def test_a_history_coded_patch_needs_its_reference() -> None:
    states = _real_like_states(3)
    first = encode(states[0], states[1])
    second = encode(states[1], states[2], reference=first.history)
    assert read_header(second.data).reference_sha256 == first.history.sha256
    with pytest.raises(MissingReferenceError, match="reference held is none"):
        _apply(states[1], second.data, None)
    with pytest.raises(MissingReferenceError, match="reference held is patch"):
        _apply(states[1], second.data, PatchHistory("0" * 64, first.history.chunks))


def test_format_1_is_written_on_request_and_read_by_format_2() -> None:
    states = _real_like_states(3)
    first = encode(states[0], states[1], CodecParams(format_version=1))
    second = encode(states[1], states[2], CodecParams(format_version=1), reference=first.history)
    for old, new, patch in ((states[0], states[1], first.data), (states[1], states[2], second.data)):
        parsed = parse_header(patch)
        assert parsed is not None and parsed[2] == 1
        assert {k for k, _, _ in _kinds(patch)} <= {RecordKind.SPARSE, RecordKind.DENSE}
        assert_states_equal(_apply(old, patch, None)[0], new)


def test_format_2_is_written_on_request_without_the_codings_of_format_3() -> None:
    """Fleets whose subscribers read format 2 get no CLASS_MASKS, EXP_CODES or PREDICTED_CODES; a format-2
    patch that holds one is refused (an older subscriber refuses the version instead, clearly)."""
    states = _real_like_states(3)
    params = CodecParams(format_version=2)
    first = encode(states[0], states[1], params)
    second = encode(states[1], states[2], params, reference=first.history)
    for old, new, patch, reference in (
        (states[0], states[1], first.data, None),
        (states[1], states[2], second.data, first.history),
    ):
        parsed = parse_header(patch)
        assert parsed is not None and parsed[2] == 2
        kinds = _kinds(patch)
        assert not {c for _, c, _ in kinds} & {ValueCoding.EXP_CODES, ValueCoding.PREDICTED_CODES}
        assert PositionCoding.CLASS_MASKS not in {p for _, _, p in kinds}
        assert_states_equal(_apply(old, patch, reference)[0], new)
    newest = encode(states[0], states[1], CodecParams(format_version=3)).data  # records inline, relabelled below
    assert parse_header(newest)[2] == 3 and PositionCoding.CLASS_MASKS in {p for _, _, p in _kinds(newest)}  # type: ignore[index]
    relabelled = bytearray(newest)
    relabelled[8:10] = (2).to_bytes(2, "little")  # the preamble's version, its checksum fixed below
    header_len = int.from_bytes(newest[12:16], "little")
    end = 16 + header_len
    relabelled[end : end + 8] = xxhash.xxh3_64_intdigest(bytes(relabelled[:end])).to_bytes(8, "little")
    with pytest.raises(CorruptPatchError, match="format 2"):
        apply_patch({n: t.clone() for n, t in states[0].items()}, bytes(relabelled))


@pytest.mark.skipif(not jit.enabled, reason="needs numba")
@pytest.mark.parametrize("changed_outside", [False, True])
def test_the_old_values_a_history_holds_are_used_only_where_the_state_still_holds_them(changed_outside: bool) -> None:
    """The batch kernel keeps the values each patch wrote in its history: the next patch's class-ordered
    HISTORY records need every old value before writing, and take the recurring ones from there instead
    of reading them first. It checks each as it writes: where the held state was changed outside the
    patches, it restores what it wrote and reads them all, so the result is what the values-free path
    makes, bit for bit, and the undo log restores the state it found."""
    states = _real_like_states(3, hidden=128)
    first = encode(states[0], states[1])
    second = encode(states[1], states[2], reference=first.history)
    class_ordered = [
        (h.name, h.start, h.length)
        for h, _ in PatchDecoder().split(second.data)
        if h.kind == RecordKind.HISTORY and h.coding in (ValueCoding.EXP_CODES, ValueCoding.PREDICTED_CODES)
    ]
    assert class_ordered
    held, history = _apply(states[0], first.data, None)
    assert all(chunk.values is not None for chunk in history.chunks.values())
    if changed_outside:  # a position both patches change, moved to another magnitude class
        key = class_ordered[0]
        again = np.intersect1d(history.chunks[key].positions, second.history.chunks[key].positions)
        flat = held[key[0]].view(-1).view(torch.int16)
        flat[key[1] + int(again[len(again) // 2])] ^= 0x0400
    without_values = PatchHistory(
        history.sha256,
        {k: ChunkHistory(c.positions, c.deltas, (*(c.addresses or (0, 0))[:2], 0)) for k, c in history.chunks.items()},
    )
    found = {n: t.clone() for n, t in held.items()}
    results = []
    for reference in (history, without_values):
        work, undo = {n: t.clone() for n, t in held.items()}, UndoLog()
        base = state_digest(states[1])
        apply_patch(work, second.data, base_digest=base, verify=False, reference=reference, undo=undo)
        results.append({n: t.clone() for n, t in work.items()})
        undo.rollback(work)
        assert_states_equal(work, found)
    assert_states_equal(results[0], results[1])
    if not changed_outside:
        assert_states_equal(results[0], states[2])


def test_history_coding_beats_stateless_on_the_real_like_workload() -> None:
    """History coding pays even against stateless CLASS_MASKS positions (which code whole classes in a bit)."""
    states = _real_like_states(4, hidden=128)
    reference = encode(states[1], states[2]).history
    stateless = encode(states[2], states[3]).data
    history = encode(states[2], states[3], reference=reference).data
    assert PositionCoding.CLASS_MASKS in {positions for _, _, positions in _kinds(stateless)}
    assert len(history) < 0.93 * len(stateless)  # measured 0.89 (0.8 before CLASS_MASKS)
    assert len(stateless) < 0.6 * len(pulse_encode(states[2], states[3]))


def test_the_first_patch_after_an_anchor_codes_magnitude_classes() -> None:
    """A bf16 fine-tune's first patch: every weight of the small classes moves (CLASS_MASKS: well under a bit
    a position), each by about lr / ULP in the direction of the step before (EXP_CODES: folded by sign)."""
    gen = torch.Generator().manual_seed(3)
    old = (torch.randn(1 << 16, generator=gen) * 0.02).to(torch.bfloat16)
    old[: 1 << 12] = (torch.rand(1 << 12, generator=gen) - 0.5).mul(4e-6).to(torch.bfloat16)  # near-zero mass
    step = torch.rand(old.shape, generator=gen).mul(0.5).add(0.5) * torch.sign(old.float()) * 1e-6
    new = (old.float() + step).to(torch.bfloat16)
    encoded = encode({"t": old}, {"t": new})
    assert {(RecordKind.SPARSE, ValueCoding.EXP_CODES, PositionCoding.CLASS_MASKS)} == _kinds(encoded.data)
    changed = int((old.view(torch.int16) != new.view(torch.int16)).sum())
    assert encoded.wire["positions"] * 8 < 0.5 * changed  # gaps: ~8 bits a position
    assert_states_equal(_apply({"t": old}, encoded.data, None)[0], {"t": new})
    # Its decoder scans the chunk: never in a patch or a sharded step's part with a reference (they
    # come every step, and the fast path stays O(patch)); a part after an anchor codes as the patch.
    reference = encode({"t": new}, {"t": old}).history
    assert "CLASS_MASKS" not in "".join(encode({"t": old}, {"t": new}, reference=reference).codings)
    piece = {"t": Piece("t", 0, old.numel(), tuple(old.shape), "BF16")}
    part = encode_part({"t": old}, {"t": new}, piece, CodecParams(), part=0, base_root="", dense_bytes_total=0)
    assert part.codings == encoded.codings
    after = encode_part(
        {"t": old}, {"t": new}, piece, CodecParams(), part=0, base_root="", dense_bytes_total=0, reference=reference
    )
    assert after.codings and "CLASS_MASKS" not in "".join(after.codings)


def test_the_wire_breakdown_adds_up_and_separates_positions_from_values() -> None:
    """Positions, values and framing sum to the patch; the same positions cost the same bytes whatever the values."""
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(65536, generator=gen).to(torch.bfloat16).view(torch.int16)
    changed = (torch.rand(65536, generator=gen) < 0.01).to(torch.int16)
    flips = torch.randint(1, 2**15, (65536,), dtype=torch.int16, generator=gen) * changed  # nonzero where changed
    one_ulp, noisy = encode({"t": old}, {"t": old + changed}), encode({"t": old}, {"t": old ^ flips})
    assert one_ulp.wire["positions"] == noisy.wire["positions"] > 0
    assert 10 * one_ulp.wire["values"] < noisy.wire["values"]
    dense = encode({"t": old}, {"t": old + 1})  # every element: a DENSE record, no positions
    whole = encode({"t": old}, {"u": old})  # REMOVE and ADD records
    assert dense.wire["positions"] == whole.wire["positions"] == 0 < whole.wire["values"]
    states = _real_like_states(3)
    first = encode(states[0], states[1])
    second = encode(states[1], states[2], reference=first.history)  # HISTORY records: bitmap + gaps
    for encoded in (one_ulp, noisy, dense, whole, first, second):
        assert sorted(encoded.wire) == ["framing", "positions", "values"]
        assert sum(encoded.wire.values()) == len(encoded.data)
        assert encoded.wire["framing"] > 0
    pulse = pulse_encode(states[1], states[2])  # the baseline's estimate splits its bytes the same three ways
    pulse_split = pulse_wire(states[1], states[2], pulse)
    assert sum(pulse_split.values()) == len(pulse) and min(pulse_split.values()) > 0


# --- end to end: publisher, store, subscribers -----------------------------------------------------

REAL_LIKE = _real_like_states(12)


async def _publish(pub: AsyncPublisher, steps: range) -> None:
    for step in steps:
        await pub.publish(step, REAL_LIKE[step], {"config.json": b'{"model_type": "t"}'})
    await pub.flush()


async def _patch_manifests(pub: AsyncPublisher, steps: range) -> dict[int, Any]:
    return {s: await pub.rounds.chain.manifest(s, "patch") for s in steps}


async def test_slow_path_from_an_anchor_into_a_history_coded_chain(store: Store, key: Any) -> None:
    async with AsyncPublisher(publisher_config(anchor_interval=5), store=store, signing_key=key) as pub:
        await _publish(pub, range(10))
        manifests = await _patch_manifests(pub, range(1, 10))
    coded = [s for s, m in manifests.items() if m.reference is not None]
    assert coded and all(manifests[s].reference.key == layout.patch_key(s - 1, pub.run_id) for s in coded)
    assert 6 in coded  # the patch after anchor 5 is coded against patch 5, whose history anchor 5 carries

    follower = subscriber(store, key)  # every step, by the fast path
    for step in range(10):
        await follower.sync(step)
        assert_states_equal(follower.state, REAL_LIKE[step])
    late = subscriber(store, key)  # anchor 5 (and the history it carries) + history-coded patches 6..8
    assert (await late.sync(8)).path == "slow"
    assert_states_equal(late.state, REAL_LIKE[8])
    assert (await late.sync(9)).path == "fast"
    assert_states_equal(late.state, REAL_LIKE[9])

    late.held.served.history = None  # type: ignore[union-attr]  # as if its cached history were lost: the reference is not held
    async with AsyncPublisher(publisher_config(anchor_interval=50, resume=True), store=store, signing_key=key) as pub:
        await _publish(pub, range(10, 12))
        assert (await pub.rounds.chain.manifest(10, "patch")).reference is not None  # resumed history
    result = await late.sync(11)
    assert result.path == "slow" and late.status.fallbacks == {"MissingReferenceError": 1}
    assert_states_equal(late.state, REAL_LIKE[11])


async def test_retention_keeps_every_reference_a_kept_patch_names(store: Store, key: Any) -> None:
    async with AsyncPublisher(publisher_config(anchor_interval=4), store=store, signing_key=key) as pub:
        await _publish(pub, range(12))
    trusted = subscriber(store, key).stores.chain.trusted
    await RetentionWorker(store, RetentionPolicy(keep_patches=3, keep_anchors=1, grace_seconds=0), trusted).run_once()
    keys = {info.key async for info in store.list("")}
    chain = subscriber(store, key).stores.chain
    for step in await chain.ready():
        await chain.resolve(step)
    kept = [step for step, kinds in chain.listed.items() if "patch" in kinds]
    assert kept and min(kept) < 11
    for step in kept:
        manifest = await subscriber(store, key).stores.chain.manifest(step, "patch")
        if manifest.reference is not None and manifest.reference.key not in keys:
            # The first patch after a kept anchor: the anchor carries its reference's history.
            anchor = await chain.manifest(step - 1, "anchor")
            assert isinstance(anchor, AnchorManifest) and anchor.histories and set(anchor.histories) <= keys
    fresh = subscriber(store, key)
    await fresh.sync()
    assert_states_equal(fresh.state, REAL_LIKE[11])


async def test_a_format_1_store_is_read_by_the_format_2_subscriber(store: Store, key: Any) -> None:
    config = publisher_config(anchor_interval=5, codec={"format_version": 1})
    async with AsyncPublisher(config, store=store, signing_key=key) as pub:
        await _publish(pub, range(8))
        manifests = await _patch_manifests(pub, range(1, 8))
    assert all(m.reference is None and m.codec.format_version == 1 for m in manifests.values())
    for step in (1, 7):
        data = await store.get(manifests[step].objects[0].key)
        parsed = parse_header(data)
        assert parsed is not None and parsed[2] == 1
    sub = subscriber(store, key)
    assert (await sub.sync(6)).path == "slow"
    assert (await sub.sync(7)).path == "fast"
    assert_states_equal(sub.state, REAL_LIKE[7])


@pytest.mark.skipif(not jit.enabled, reason="numba is not installed")
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    count=st.integers(1, 3000),
    recurring=st.sampled_from([0.0, 0.5, 1.0]),
    referenced=st.booleans(),
)
def test_a_records_streams_are_the_same_from_the_kernel_and_from_numpy(
    seed: int, dtype: torch.dtype, count: int, recurring: float, referenced: bool
) -> None:
    """streams.sparse_streams_kernel (one call a record) and the numpy functions it stands for: every stream the encoder
    codes, and the new values' entropy estimate, equal; matched against a reference that shares `recurring`
    of its positions, with PREDICTED_CODES' offsets for bf16."""
    rng = np.random.default_rng(seed)
    info = next(d for d in DTYPES if d.torch_dtype == dtype)
    positions = np.sort(rng.choice(10 * count, count, replace=False)).astype(np.int64)
    old = random_bits(rng, info, (count,)).view(torch.int16)
    new = mutate(rng, old.view(dtype), 1.0).view(torch.int16)
    new[new == old] += 1  # every element changed, as in a record
    reference = None
    if referenced:
        kept = positions[rng.random(count) < recurring]
        ref_positions = np.union1d(kept, rng.choice(10 * count, count // 2 + 1)).astype(np.int64)
        ref_deltas = rng.integers(-40, 40, ref_positions.size).astype(np.int16)
        reference = ChunkHistory(ref_positions, ref_deltas)
    found = []
    for enabled in (True, False):
        jit.enabled = enabled
        try:
            changes = _Changes(CodecParams(), info, positions, old, new, reference)
            streams = [
                changes.gap_codes,
                changes.deltas,
                changes.packed_deltas,
                changes.classes,
                changes.order,
                changes.counts,
                changes.value_codes,
                changes.new_entropy,
            ]
            if reference is not None:
                matched = changes.matched
                streams += [matched.bitmap, matched.fresh, matched.fresh_codes, matched.residuals, matched.codes]
            found.append(streams)
        finally:
            jit.enabled = True
    kernel, numpy_made = found
    assert len(kernel) == len(numpy_made)
    for a, b in zip(kernel, numpy_made, strict=True):
        for x, y in zip(a, b, strict=True) if isinstance(a, tuple) else [(a, b)]:
            assert type(x) is type(y)
            assert np.array_equal(x, y) and (not isinstance(x, np.ndarray) or x.dtype == y.dtype)


@pytest.mark.skipif(not jit.enabled, reason="numba is not installed")
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    format_version=st.sampled_from([2, 3, 4]),
    prune=st.booleans(),
)
def test_the_encoder_writes_the_same_bytes_with_its_streams_kernel_and_with_numpy(
    seed: int, dtype: torch.dtype, format_version: int, prune: bool
) -> None:
    """The whole encoder on both paths: the same patches of a real-like fine-tune, the first after an anchor and
    history-coded ones after it, whatever the dtype and format (a prune: RAW values weighed)."""
    states = [{n: t.to(dtype) for n, t in state.items()} for state in _real_like_states(4, hidden=32, seed=seed % 1000)]
    if prune:
        name = sorted(states[-1])[1]
        states[-1][name].view(-1)[: states[-1][name].numel() // 3] = 0
    params = CodecParams(chunk_elements=1024, format_version=format_version)
    written = []
    for enabled in (True, False):
        jit.enabled = enabled
        try:
            patches, reference = [], None
            for base, new in itertools.pairwise(states):
                encoded = encode(base, new, params, reference=reference)
                patches.append((encoded.data, encoded.codings))
                reference = encoded.history
        finally:
            jit.enabled = True
        written.append(patches)
    assert written[0] == written[1]
    assert format_version == 2 or any(k.startswith("HISTORY/") for _, codings in written[0] for k in codings)


@pytest.mark.skipif(not jit.enabled, reason="numba is not installed")
def test_a_dense_chunk_gives_its_scratch_back_and_the_next_finds_its_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """changed_elements' per-thread scratch: dropped after a call that filled more than SCRATCH_KEPT entries (its
    pages freed), made again for the next call, which finds exactly its own changes."""
    monkeypatch.setattr(diff, "SCRATCH_KEPT", 100)
    old = np.arange(4096, dtype=np.int16)
    for changed in (np.arange(0, 4096, 3), np.array([5, 77, 4095])):  # 1,366 changes, then 3
        new = old.copy()
        new[changed] += 1
        positions, old_found, new_found = diff.changed_elements(old, new)
        assert positions.tolist() == changed.tolist()
        assert np.array_equal(old_found, old[changed]) and np.array_equal(new_found, new[changed])
        assert (np.dtype(np.int16) in diff._scratch.by_dtype) == (changed.size <= 100)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_scratch_is_private_to_the_process_that_made_it() -> None:
    """changed_elements' scratch (held between calls) is not written by a child forked after it was made
    (a shared mapping was: two processes encoding at once would have found each other's changes)."""
    scratch, _, _ = diff._scratch_for(16, np.dtype(np.int16))
    scratch[:16] = 1
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        scratch[:16] = 2
        os._exit(0)
    os.waitpid(child, 0)
    assert scratch[:16].tolist() == [1] * 16
