"""The codec is lossless by construction: apply(base, encode(base, new)) is bitwise new."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsesync.codec import (
    CodecParams,
    PatchDecoder,
    RecordKind,
    UndoLog,
    apply_patch,
    apply_record,
    batch,
    encode_patch,
    jit,
    read_header,
)
from pulsesync.codec.codings import class_masks, gap_codes, gaps16, small_codes, value_codes
from pulsesync.codec.codings import values as value_bits
from pulsesync.codec.encoder import chunk_bounds
from pulsesync.digest import state_digest
from pulsesync.dtypes import DTYPES, dtype_info, flat_bits
from pulsesync.errors import CorruptPatchError
from tests.support.helpers import assert_bits_equal, assert_states_equal, clone_state, mutate, random_bits, state_pairs

CODINGS = ["delta", "raw", "xor"]
LEVELS = [-5, 1, 3, 19]


@given(pair=state_pairs(), coding=st.sampled_from(CODINGS), level=st.sampled_from(LEVELS))
def test_roundtrip_any_state(pair: tuple[dict, dict], coding: str, level: int) -> None:
    base, new = pair
    params = CodecParams(value_coding=coding, zstd_level=level, chunk_elements=1024)
    patch = encode_patch(base, new, params)
    work = clone_state(base)
    digest = apply_patch(work, patch)
    assert_states_equal(work, new)
    assert digest is not None and digest.root == state_digest(new).root


@given(numel=st.integers(0, 10**7), step=st.integers(1 << 10, 1 << 22))
def test_chunks_tile_a_tensor_and_a_tail_under_half_a_chunk_joins_the_one_before(numel: int, step: int) -> None:
    bounds = chunk_bounds(numel, step)
    if numel == 0:
        assert bounds == []
        return
    lengths = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == numel and (lengths[:-1] == step).all()
    assert lengths[-1] < step + step // 2  # never more than 1.5 chunks
    assert len(lengths) == 1 or lengths[-1] >= step // 2  # and no short tail of its own


def test_a_short_tail_is_patched_in_the_last_chunks_record() -> None:
    """A tensor of 2 chunks and 100 elements: two records, the second covering the tail, bit-exact."""
    base = {"w": torch.randn(2 * 1024 + 100, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"].view(torch.int16)[[5, 1500, 2050, 2147]] += 1  # in both chunks, and in the tail
    patch = encode_patch(base, new, CodecParams(chunk_elements=1024))
    records = [h for h, _ in PatchDecoder().records(patch)]
    assert [(h.start, h.length, h.count) for h in records] == [(0, 1024, 1), (1024, 1124, 3)]
    work = clone_state(base)
    apply_patch(work, patch)
    assert_states_equal(work, new)


@given(pair=state_pairs(), coding=st.sampled_from(CODINGS), threads=st.sampled_from([1, 2]))
def test_undo_log_restores_the_base_and_names_the_changed_positions(
    pair: tuple[dict, dict], coding: str, threads: int
) -> None:
    base, new = pair
    patch = encode_patch(base, new, CodecParams(value_coding=coding, chunk_elements=1024))
    # Transposed copies: same values, non-contiguous targets (replaced by contiguous ones while patching).
    work = {n: t.clone().t().contiguous().t() if t.dim() == 2 else t.clone() for n, t in base.items()}
    work_base = dict(work)
    undo = UndoLog()
    digest = apply_patch(work, patch, undo=undo, threads=threads, base_digest=state_digest(work))
    assert_states_equal(work, new)
    assert digest is not None and digest.root == state_digest(new).root
    for name, positions in undo.changed().items():
        old, now = base.get(name), new.get(name)
        if positions is not None:  # sparse: exactly the differing elements, sorted
            assert old is not None and now is not None
            expected = torch.nonzero(flat_bits(old) != flat_bits(now)).reshape(-1)
            assert torch.equal(torch.sort(positions).values, expected)
    undo.rollback(work)
    assert work.keys() == base.keys() and all(work[n] is work_base[n] for n in work)
    assert_states_equal(work, base)


@settings(max_examples=40)
@given(seed=st.integers(0, 2**32 - 1), coding=st.sampled_from(CODINGS), threads=st.sampled_from([1, 2]))
def test_streaming_decoder_matches_apply(seed: int, coding: str, threads: int) -> None:
    rng = np.random.default_rng(seed)
    info = dtype_info(torch.bfloat16)
    base = {"w": random_bits(rng, info, (3000,)), "v": random_bits(rng, info, (50, 7))}
    new = {n: mutate(rng, t, 0.05) for n, t in base.items()}
    patch = encode_patch(base, new, CodecParams(value_coding=coding, chunk_elements=1024, threads=threads))
    # Feed in random-sized pieces, applying records as soon as they complete.
    decoder, work, offset = PatchDecoder(), clone_state(base), 0
    while offset < len(patch):
        size = int(rng.integers(1, 200))
        for record in decoder.feed(patch[offset : offset + size]):
            apply_record(record, work)
        offset += size
    header = decoder.finish()
    assert header.changed_elements == sum(
        int((a.view(torch.int16) != b.view(torch.int16)).sum())
        for a, b in zip(base.values(), new.values(), strict=True)
    )
    assert_states_equal(work, new)


@pytest.mark.parametrize("coding", CODINGS)
def test_chain_of_50_patches_reconstructs_every_step(coding: str) -> None:
    rng = np.random.default_rng(7)
    params = CodecParams(value_coding=coding, chunk_elements=4096)
    states = [
        {
            "emb": random_bits(rng, dtype_info(torch.bfloat16), (64, 128)),
            "norm": random_bits(rng, dtype_info(torch.float32), (128,)),
            "fp8": random_bits(rng, dtype_info(torch.float8_e4m3fn), (300,)),
        }
    ]
    for _ in range(50):
        states.append({n: mutate(rng, t, 0.02) for n, t in states[-1].items()})
    work = clone_state(states[0])
    digest = state_digest(work)
    for prev, nxt in itertools.pairwise(states):
        patch = encode_patch(prev, nxt, params)
        digest = apply_patch(work, patch, base_digest=digest)
        assert_states_equal(work, nxt)


def test_empty_patch_has_no_records_and_applies() -> None:
    state = {"a": torch.randn(10), "b": torch.zeros((), dtype=torch.bfloat16)}
    patch = encode_patch(state, clone_state(state))
    header = read_header(patch)
    assert (header.records, header.changed_elements, header.decoded_bytes) == (0, 0, 0)
    work = clone_state(state)
    apply_patch(work, patch)
    assert_states_equal(work, state)


@pytest.mark.parametrize("info", DTYPES, ids=lambda d: d.name)
def test_every_dtype_all_changed_and_zero_dim(info) -> None:
    rng = np.random.default_rng(1)
    base = {"t": random_bits(rng, info, (33, 5)), "scalar": random_bits(rng, info, ())}
    new = {"t": mutate(rng, base["t"], 1.0), "scalar": mutate(rng, base["scalar"], 1.0)}
    for coding in CODINGS:
        work = clone_state(base)
        apply_patch(work, encode_patch(base, new, CodecParams(value_coding=coding)))
        assert_states_equal(work, new)


def test_non_contiguous_inputs_and_targets() -> None:
    rng = np.random.default_rng(2)
    base_c = random_bits(rng, dtype_info(torch.float16), (40, 30))
    new_c = mutate(rng, base_c, 0.1)
    base, new = {"w": base_c.t()}, {"w": new_c.t()}  # transposed views: not contiguous
    assert not base["w"].is_contiguous()
    patch = encode_patch(base, new)
    work = {"w": base_c.clone().t()}
    apply_patch(work, patch)
    assert_bits_equal(work["w"], new["w"])
    streamed = {"w": base_c.clone().t()}  # the streaming path replaces it with a contiguous copy too
    for record in PatchDecoder().feed(patch):
        apply_record(record, streamed)
    assert_bits_equal(streamed["w"], new["w"])


def test_dense_fallback_for_high_density_and_sparse_for_low() -> None:
    rng = np.random.default_rng(3)
    info = dtype_info(torch.bfloat16)
    base = {"lora": random_bits(rng, info, (2048,)), "big": random_bits(rng, info, (2048,))}
    new = {"lora": mutate(rng, base["lora"], 1.0), "big": mutate(rng, base["big"], 0.01)}
    patch = encode_patch(base, new)
    decoder = PatchDecoder()
    kinds = {r.name: r.header.kind for r in decoder.feed(patch)}
    assert kinds == {"lora": RecordKind.DENSE, "big": RecordKind.SPARSE}


def test_delta_coding_beats_raw_on_ulp_moves() -> None:
    # RL updates move mostly by one ULP: delta coding must be much smaller than PULSE's raw values.
    rng = np.random.default_rng(4)
    base_f = torch.from_numpy(rng.normal(0, 0.02, 1 << 20).astype(np.float32)).to(torch.bfloat16)
    new_f = base_f.clone()
    idx = torch.from_numpy(rng.choice(base_f.numel(), base_f.numel() // 100, replace=False))
    new_f.view(torch.int16)[idx] += torch.from_numpy(rng.choice([-1, 1], idx.numel()).astype(np.int16))
    sizes = {c: len(encode_patch({"w": base_f}, {"w": new_f}, CodecParams(value_coding=c))) for c in CODINGS}
    assert sizes["delta"] < 0.6 * sizes["raw"]


@pytest.mark.slow
def test_tensor_larger_than_2_pow_31_elements() -> None:
    n = (1 << 31) + 1000
    base = {"huge": torch.zeros(n, dtype=torch.uint8)}
    new = {"huge": base["huge"].clone()}
    positions = torch.tensor([0, 70_000, (1 << 31) - 1, 1 << 31, n - 1])
    new["huge"][positions] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    patch = encode_patch(base, new, CodecParams(chunk_elements=1 << 30))
    assert read_header(patch).changed_elements == 5
    work = base  # patched in place: base is not needed any more
    apply_patch(work, patch, verify=False)
    assert torch.equal(work["huge"], new["huge"])


@pytest.mark.skipif(batch.apply_delta_2byte is None, reason="numba is not installed")
@settings(max_examples=60)
@given(
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0005, 0.01, 0.3, 1.0]),
    mode=st.sampled_from(["fused", "no-kernel"]),
    version=st.sampled_from([1, 2, 3, 4]),
    threads=st.sampled_from([1, None]),
    digest=st.sampled_from(["mixsum-128", "xxh3-128"]),
)
def test_fused_kernel_matches_the_numpy_path_bit_for_bit(
    seed: int, density: float, mode: str, version: int, threads: int | None, digest: str
) -> None:
    """The batch kernel (SPARSE records of 2-byte floats, on one or every thread), the single-record
    kernels and numpy: the same state, digest and undo log, for either format and digest."""
    rng = np.random.default_rng(seed)
    base = {
        "bf16": random_bits(rng, dtype_info(torch.bfloat16), (5000,)),
        "f16": random_bits(rng, dtype_info(torch.float16), (70, 30)),
        "f32": random_bits(rng, dtype_info(torch.float32), (300,)),  # not batched: the per-record path beside it
    }
    new = {n: mutate(rng, t, density) for n, t in base.items()}
    params = CodecParams(chunk_elements=1024, format_version=version, digest_algorithm=digest)
    patch = encode_patch(base, new, params)
    results = []
    for enabled in (True, False):
        jit.enabled = enabled
        original = batch.apply_delta_2byte
        if mode == "no-kernel" and enabled:  # records left packed, decoded by numpy at apply
            batch.apply_delta_2byte = None
        try:
            work, undo = clone_state(base), UndoLog()
            apply_patch(work, patch, undo=undo, threads=threads)
        finally:
            jit.enabled, batch.apply_delta_2byte = True, original
        assert_states_equal(work, new)
        results.append(undo.changed())
        undo.rollback(work)
        assert_states_equal(work, base)
    fused_changes, numpy_changes = results
    assert fused_changes.keys() == numpy_changes.keys()
    for name, positions in fused_changes.items():
        other = numpy_changes[name]
        assert (positions is None and other is None) or (
            positions is not None and other is not None and torch.equal(positions, other)
        )


def _same_on_both_paths(decode: Callable[[], np.ndarray], messages: bool = True) -> np.ndarray | str:
    """Run a decoder with numba's kernels, then with numpy: the same array, or the same error (and message)."""
    outcomes: list[np.ndarray | str] = []
    for kernels in (True, False):
        jit.enabled = kernels
        try:
            outcomes.append(decode())
        except CorruptPatchError as e:
            outcomes.append(str(e) if messages else "CorruptPatchError")
        finally:
            jit.enabled = True
    kernel, numpy_path = outcomes
    if isinstance(kernel, str) or isinstance(numpy_path, str):
        assert kernel == numpy_path
    else:
        assert np.array_equal(kernel, numpy_path)
    return kernel


@pytest.mark.skipif(gaps16.decode_positions_kernel is None, reason="numba is not installed")
@given(
    positions=st.lists(st.integers(0, 300_000), max_size=60, unique=True).map(sorted),
    length=st.sampled_from([1, 70_000, 300_001, 300_000]),
    corrupt=st.sampled_from(["none", "drop an escape", "add an escape"]),
)
def test_positions_kernel_matches_the_numpy_decoder(positions: list[int], length: int, corrupt: str) -> None:
    """Same positions, or the same refusal, from gap planes with escapes (gaps >= 0xFFFF)."""
    gaps, escapes = gaps16.encode_positions(np.array(positions, np.int64))
    if corrupt == "drop an escape":
        escapes = escapes[:-1]
    elif corrupt == "add an escape":
        escapes = np.append(escapes, np.uint64(5))
    planes = np.frombuffer(value_bits.to_planes(gaps), np.uint8)
    # The u16 kernel checks as it goes, numpy checks the escapes first: the first error found may differ.
    kernel = _same_on_both_paths(
        lambda: gaps16.decode_positions(planes, gaps.size, escapes, length, "record"), messages=False
    )
    if corrupt == "none" and max(positions, default=-1) < length:
        assert isinstance(kernel, np.ndarray) and kernel.tolist() == positions


@pytest.mark.skipif(gap_codes.decode_gap_codes_kernel is None, reason="numba is not installed")
@given(
    positions=st.lists(st.integers(0, 2**30 - 1), max_size=60, unique=True).map(sorted),
    length=st.sampled_from([1, 70_000, 2**30 - 1, 2**30]),
    corrupt=st.sampled_from(["none", "code", "short", "long", "padding", "flip"]),
    at=st.integers(0, 2**16),
)
def test_gap_codes_kernel_matches_the_numpy_decoder(positions: list[int], length: int, corrupt: str, at: int) -> None:
    """Same bytes from both encoders; same positions, or the same error message, from both decoders."""
    codes, extra_bytes = gap_codes.encode_gap_codes(np.array(positions, np.int64))
    jit.enabled = False
    try:
        numpy_codes, numpy_extra = gap_codes.encode_gap_codes(np.array(positions, np.int64))
    finally:
        jit.enabled = True
    assert np.array_equal(codes, numpy_codes) and extra_bytes == numpy_extra
    extra = np.frombuffer(extra_bytes, np.uint8).copy()
    if corrupt == "code" and codes.size:
        codes[at % codes.size] = 255
    elif corrupt == "short":
        extra = extra[:-1]
    elif corrupt == "long":
        extra = np.append(extra, np.uint8(0))
    elif corrupt == "padding" and extra.size:
        extra[-1] |= 0x80
    elif corrupt == "flip" and extra.size:
        extra[at % extra.size] ^= 1 << (at % 8)
    kernel = _same_on_both_paths(lambda: gap_codes.decode_gap_codes(codes, codes.size, extra, length, "record"))
    if corrupt == "none" and max(positions, default=-1) < length:
        assert isinstance(kernel, np.ndarray) and kernel.tolist() == positions


@pytest.mark.skipif(value_codes.encode_value_codes_kernel is None, reason="numba is not installed")
@given(
    values=st.lists(st.integers(-(2**15), 2**15 - 1), max_size=80),
    seed=st.integers(0, 2**31 - 1),
)
def test_value_codes_are_the_same_bytes_on_both_paths_and_decode_back(values: list[int], seed: int) -> None:
    """EXP_CODES: folded by the old values' signs, taken in their order; numba's and numpy's bytes are equal."""
    rng = np.random.default_rng(seed)
    signed = np.array(values, np.int16)
    old = rng.integers(-(2**15), 2**15, signed.size).astype(np.int16)
    order = rng.permutation(signed.size).astype(np.int64)
    symbols, extra = value_codes.encode_value_codes(signed, old, order)
    jit.enabled = False
    try:
        numpy_symbols, numpy_extra = value_codes.encode_value_codes(signed, old, order)
    finally:
        jit.enabled = True
    assert np.array_equal(symbols, numpy_symbols) and extra == numpy_extra
    decoded = value_codes.decode_value_codes(symbols, np.frombuffer(extra, np.uint8), "record")
    assert np.array_equal(decoded, value_bits.fold_by_sign(signed, old)[order])


@given(
    classes=st.lists(st.integers(0, 5), min_size=1, max_size=300),
    changed=st.lists(st.booleans(), min_size=300, max_size=300),
)
def test_class_masks_decode_to_their_positions_on_both_paths(classes: list[int], changed: list[bool]) -> None:
    """Any chunk and any change set: CLASS_MASKS decode back to exactly the changed positions, both paths alike."""
    old = (np.array(classes, np.int16) + 100) << 7  # magnitude classes 100..105, mantissa 0
    positions = np.flatnonzero(np.array(changed[: old.size]))
    if not positions.size:
        return
    table, bitmap = class_masks.encode_class_masks(old, positions)
    decoded = _same_on_both_paths(
        lambda: class_masks.decode_class_masks(old, table, np.frombuffer(bitmap, np.uint8), positions.size, "record")
    )
    assert isinstance(decoded, np.ndarray) and decoded.tolist() == positions.tolist()


@pytest.mark.parametrize("kernels", [True, False], ids=["numba-if-installed", "numpy"])
def test_escape_count_is_checked_the_same_on_both_paths(kernels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "enabled", jit.enabled and kernels)
    values = np.array([1, 2, 3, 400, 5, 1], np.uint16)  # zigzagged; 400 and 5 (>= offset 1 + 3) escape
    packed, escapes = small_codes.pack_small(values, 1)
    small_codes.check_escape_count(packed, values.size, escapes.size, "r")
    for wrong in (escapes.size - 1, escapes.size + 1):
        with pytest.raises(CorruptPatchError, match="escaped value count does not match"):
            small_codes.check_escape_count(packed, values.size, wrong, "r")
    with pytest.raises(CorruptPatchError, match="escaped value count does not match"):
        small_codes.unpack_small_deltas(packed, values.size, escapes[:-1], 1, "r")
    assert np.array_equal(
        small_codes.unpack_small_deltas(packed, values.size, escapes, 1, "r"), value_bits.unzigzag(values, np.int16)
    )


_WARM_UP_THEN_APPLY = """
import torch
from pulsesync.codec import apply_patch, batch, encode_patch
batch.warm_up()
gen = torch.Generator().manual_seed(0)
base = {"w": torch.randn(1 << 16, generator=gen).to(torch.bfloat16)}
new = {"w": base["w"].clone()}
new["w"].view(torch.int16)[::97] += 1
apply_patch(base, encode_patch(base, new))
print(len(batch.apply_batch.signatures))
"""


@pytest.mark.skipif(batch.apply_batch is None, reason="numba is not installed")
def test_warm_up_compiles_the_batch_kernel_for_the_arrays_a_patch_gives_it() -> None:
    """A fresh process: after batch.warm_up, applying a patch compiles nothing more (a second
    signature compiles inside the subscriber's first sync, seconds on a machine without numba's cache)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WARM_UP_THEN_APPLY], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1"]


def _moved(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Flat positions where two tensors' bits differ."""
    return torch.nonzero(a.view(torch.int16).flatten() != b.view(torch.int16).flatten()).flatten()


def test_changes_of_a_chain_are_every_position_its_patches_wrote_once_each_ascending() -> None:
    """`Changes.of` the undo logs of two patches: each tensor's positions merged, none twice; an added tensor whole."""
    from pulsesync.codec import Changes, UndoLog
    from tests.support.helpers import trainer_states

    first, second, third = trainer_states(3)
    third = {**third, "added.weight": torch.ones(4, 4, dtype=torch.bfloat16)}
    work, logs = clone_state(first), [UndoLog(), UndoLog()]
    apply_patch(work, encode_patch(first, second), undo=logs[0])
    apply_patch(work, encode_patch(second, third), undo=logs[1])
    changes = Changes.of(logs)
    assert changes is not None and Changes.of([]) is None
    assert changes.positions["added.weight"] is None
    for name, before in first.items():
        expected = torch.unique(torch.cat([_moved(before, second[name]), _moved(second[name], third[name])]))
        got = changes.positions.get(name)
        assert torch.equal(got, expected) if got is not None else expected.numel() == 0, name
