"""Malformed patches raise specific errors, never write out of bounds, never over-allocate.

Lies are crafted with valid checksums (re-serialized by the format functions) so that they test
the decoder's consistency checks, not just its checksums.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
import xxhash
import zstandard

from pulsesync.codec import (
    CodecParams,
    PatchDecoder,
    RecordKind,
    UndoLog,
    apply_patch,
    batch,
    encode_patch,
    jit,
    read_header,
)
from pulsesync.codec.codings.gap_codes import encode_gap_codes
from pulsesync.codec.format import (
    SUPPORTED_VERSIONS,
    PatchHeader,
    PositionCoding,
    RecordHeader,
    ValueCoding,
    encode_header,
    encode_index,
    payload_hash,
    raw_len_for,
)
from pulsesync.codec.history import ChunkHistory, PatchHistory
from pulsesync.digest import state_digest
from pulsesync.dtypes import dtype_info
from pulsesync.errors import CorruptPatchError, IntegrityError, UnsupportedVersionError
from tests.support.helpers import (
    assemble_patch,
    assert_states_equal,
    clone_state,
    mutate,
    patch_records,
    random_bits,
)

BF16 = dtype_info(torch.bfloat16)
BOTH_KERNELS = pytest.mark.parametrize(  # numba's kernels (the batch kernel included), then numpy's path
    "kernels",
    [
        pytest.param(True, id="numba", marks=pytest.mark.skipif(not jit.enabled, reason="no numba")),
        pytest.param(False, id="numpy"),
    ],
)


@pytest.fixture(scope="module")
def pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rng = np.random.default_rng(11)
    base = {
        "dense": random_bits(rng, BF16, (64,)),
        "gone": random_bits(rng, dtype_info(torch.float32), (8,)),
        "sparse": random_bits(rng, BF16, (3000,)),
    }
    new = {
        "added": random_bits(rng, dtype_info(torch.int32), (4, 4)),
        "dense": mutate(rng, base["dense"], 1.0),
        "sparse": mutate(rng, base["sparse"], 0.03),
    }
    return base, new


@pytest.fixture(scope="module")
def patch(pair) -> bytes:
    return encode_patch(*pair, CodecParams(chunk_elements=1024))


def _lie(patch: bytes, name: str, **fields: object) -> bytes:
    header, records = patch_records(patch)
    records = [(h._replace(**fields) if h.name == name else h, p) for h, p in records]
    return assemble_patch(header, records)


def _expect(error: type[Exception], base: dict, patch: bytes, match: str | None = None) -> None:
    with pytest.raises(error, match=match):
        apply_patch(clone_state(base), patch)


def test_reassembly_is_faithful(pair, patch) -> None:
    assert assemble_patch(*patch_records(patch)) == patch


def test_truncated_at_every_length_raises_and_leaves_state_untouched(pair, patch) -> None:
    base, _ = pair
    for cut in range(len(patch)):
        work = clone_state(base)
        with pytest.raises(CorruptPatchError):
            apply_patch(work, patch[:cut])  # one thread: the whole patch is parsed before anything is written
        assert_states_equal(work, base)


@pytest.mark.skipif(batch.apply_batch is None, reason="no numba")
@pytest.mark.parametrize("declared", [1, 10**12])
def test_a_header_that_misstates_its_changes_neither_sizes_the_buffers_nor_stops_the_patch(declared: int) -> None:
    """The batch sizes its buffer by the header's changed_elements, which nothing has checked: a run
    that does not fit gets a buffer of its own (declared 1), and a huge figure allocates nothing
    huge (declared 10**12). Either way the patch applies bit for bit."""
    rng = np.random.default_rng(4)
    base = {f"layer{i}": random_bits(rng, BF16, (4096,)) for i in range(8)}
    new = {n: mutate(rng, t, 0.05) for n, t in base.items()}
    header, records = patch_records(encode_patch(base, new, CodecParams(chunk_elements=1024)))
    work = clone_state(base)
    apply_patch(work, assemble_patch(header.model_copy(update={"changed_elements": declared}), records), threads=2)
    assert_states_equal(work, new)


@pytest.mark.skipif(batch.apply_batch is None, reason="no numba")
@pytest.mark.parametrize("threads", [2, 3])  # (on 2 cores, 3 is a pool of its own)
def test_a_patch_cut_short_after_its_first_runs_were_applied_is_rolled_back_exactly(threads: int) -> None:
    """With threads, the batch kernel applies the first runs of records while the rest are parsed: a
    patch that ends early is found out after some were written. All of it is in the undo log."""
    rng = np.random.default_rng(3)
    base = {f"layer{i}": random_bits(rng, BF16, (4096,)) for i in range(16)}
    patch = encode_patch(base, {n: mutate(rng, t, 0.05) for n, t in base.items()}, CodecParams(chunk_elements=1024))
    _, records = patch_records(patch)
    sizes = [len(p) for _, p in records]
    ends = len(patch) - sum(sizes) + np.cumsum(sizes)  # where each record's payload ends
    written_before_error = 0
    for cut in [*ends[-8:-1], len(patch) - 1]:  # after a whole record, or inside the last
        work, undo = clone_state(base), UndoLog()
        with pytest.raises(CorruptPatchError, match="truncated"):
            apply_patch(work, patch[:cut], threads=threads, undo=undo)
        written_before_error = max(written_before_error, len(undo.chunks))
        undo.rollback(work)
        assert_states_equal(work, base)
    assert written_before_error > 0  # the runs before the cut were applied, so the rollback had work to do


def test_streaming_decoder_reports_truncation(patch) -> None:
    decoder = PatchDecoder()
    decoder.feed(patch[:-5])
    with pytest.raises(CorruptPatchError, match="truncated"):
        decoder.finish()


def test_every_flipped_byte_is_caught(pair, patch) -> None:
    base, _ = pair
    for i in range(len(patch)):
        corrupted = bytearray(patch)
        corrupted[i] ^= 0xFF
        with pytest.raises((CorruptPatchError, UnsupportedVersionError)):
            apply_patch(clone_state(base), bytes(corrupted))


def test_random_single_bit_flips_are_caught(pair, patch) -> None:
    base, _ = pair
    rng = np.random.default_rng(5)
    for _ in range(2000):
        corrupted = bytearray(patch)
        corrupted[int(rng.integers(len(patch)))] ^= 1 << int(rng.integers(8))
        with pytest.raises(IntegrityError):
            apply_patch(clone_state(base), bytes(corrupted))


def test_version_and_magic(pair, patch) -> None:
    base, _ = pair
    _expect(CorruptPatchError, base, b"NOTAPATCH" + patch[9:], "magic")
    bumped = bytearray(patch)
    bumped[8] = max(SUPPORTED_VERSIONS) + 1  # format version u16 at offset 8; the header checksum is checked after
    _expect(UnsupportedVersionError, base, bytes(bumped), f"version {max(SUPPORTED_VERSIONS) + 1}")


def test_trailing_bytes(pair, patch) -> None:
    _expect(CorruptPatchError, pair[0], patch + b"\x00", "trailing")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"count": 5000}, "do not fit"),
        ({"raw_len": 1 << 40}, "decoded bytes"),
        ({"escapes": 3}, "decoded bytes"),
        ({"start": 2500}, "outside the tensor"),
        ({"shape": (3000, 1)}, "expects BF16"),
        ({"coding": ValueCoding.RAW}, "escaped values|decoded bytes"),
        ({"coding": ValueCoding.PREDICTED_CODES}, "PREDICTED_CODES in a SPARSE record"),  # HISTORY records only
        ({"kind": RecordKind.HISTORY, "positions": PositionCoding.CLASS_MASKS}, "CLASS_MASKS positions in a HISTORY"),
        (
            {"dtype": dtype_info(torch.float32), "shape": (1500,), "positions": PositionCoding.CLASS_MASKS},
            "CLASS_MASKS",
        ),
    ],
)
def test_record_field_lies(pair, patch, fields: dict, match: str) -> None:
    _expect(CorruptPatchError, pair[0], _lie(patch, "sparse", **fields), match)


def test_consistent_size_lie_is_caught_by_the_frame(pair, patch) -> None:
    header, records = patch_records(patch)
    # count, raw_len and the header total agree with each other, not with the zstd frame's content.
    lied = []
    for h, p in records:
        if h.name == "sparse" and h.kind == RecordKind.SPARSE:
            count = h.count + 4
            raw_len = raw_len_for(h._replace(count=count))
            header = header.model_copy(update={"decoded_bytes": header.decoded_bytes + raw_len - h.raw_len})
            h = h._replace(count=count, raw_len=raw_len)
        lied.append((h, p))
    _expect(CorruptPatchError, pair[0], assemble_patch(header, lied), "frame declares")


def test_huge_declared_tensor_is_refused_before_allocation(pair, patch) -> None:
    base, _ = pair
    header, records = patch_records(patch)
    numel = 1 << 40  # 4 TiB of int32 if anyone believed it
    records = [
        (h._replace(shape=(numel,), length=numel, count=numel, raw_len=4 * numel), p) if h.name == "added" else (h, p)
        for h, p in records
    ]
    # First with the header's honest total: the record exceeds the patch's declared decoded bytes.
    _expect(CorruptPatchError, base, assemble_patch(header, records), "exceeds the patch's declared")
    # Then with a header that lies too: the zstd frame's real content size gives it away.
    liar = header.model_copy(update={"decoded_bytes": header.decoded_bytes + 4 * numel})
    # Once untraced: a cold numba cache compiles the digest kernels on the first call (~24 MB),
    # which is not what the patch made anyone allocate.
    _expect(CorruptPatchError, base, assemble_patch(liar, records), "frame declares")
    tracemalloc.start()
    _expect(CorruptPatchError, base, assemble_patch(liar, records), "frame declares")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2 * header.decoded_bytes + (1 << 20)  # nothing near the claimed size was allocated


def test_max_decoded_bytes_limit(pair, patch) -> None:
    with pytest.raises(CorruptPatchError, match="above the limit"):
        apply_patch(clone_state(pair[0]), patch, max_decoded_bytes=10)


def test_record_count_and_order_lies(pair, patch) -> None:
    base, _ = pair
    header, records = patch_records(patch)
    _expect(CorruptPatchError, base, assemble_patch(header, records[:-1]), "record index ends inside entry")
    more = header.model_copy(update={"records": header.records - 1})
    _expect(CorruptPatchError, base, assemble_patch(more, records), "bytes after its")
    inline = header.model_copy(update=dict.fromkeys(("index_bytes", "index_hash", "index_raw_bytes")))  # format 3
    _expect(CorruptPatchError, base, assemble_patch(inline, records, end_count=len(records) + 1), "end record counts")
    _expect(CorruptPatchError, base, assemble_patch(inline, records[:-1]), "end record counts")
    swapped = [records[1], records[0], *records[2:]]
    _expect(CorruptPatchError, base, assemble_patch(header, swapped), "out of order")
    duplicated = [records[0], *records]
    more = header.model_copy(update={"records": header.records + 1, "decoded_bytes": 2 * header.decoded_bytes})
    _expect(CorruptPatchError, base, assemble_patch(more, duplicated), "out of order")


def test_a_record_index_that_lies_is_refused(pair, patch) -> None:
    """Format 4's index: every size is checked against the header before anything is allocated."""
    base, _ = pair
    header, records = patch_records(patch)
    payloads = b"".join(p for _, p in records)
    raw = encode_index([h for h, _ in records])

    def indexed(index: bytes, raw_bytes: int, version: int = 4, **fields: int) -> bytes:
        sized = {"index_bytes": len(index), "index_hash": xxhash.xxh3_64_intdigest(index), "index_raw_bytes": raw_bytes}
        return encode_header(header.model_copy(update=sized | fields), version) + index + payloads

    compressed = zstandard.ZstdCompressor().compress(raw)
    assert apply_patch(clone_state(base), indexed(compressed, len(raw)))  # the honest index applies
    _expect(CorruptPatchError, base, indexed(compressed, len(raw) + 1), "frame declares")
    _expect(CorruptPatchError, base, indexed(raw, len(raw)), "does not decompress")
    _expect(CorruptPatchError, base, indexed(compressed, len(raw), records=0), "record index of")
    _expect(CorruptPatchError, base, indexed(compressed, len(raw), version=3), "do not fit format 3")
    bumped = bytearray(indexed(compressed, len(raw)))
    bumped[len(bumped) - len(payloads) - len(compressed)] ^= 1  # the index's first byte
    _expect(CorruptPatchError, base, bytes(bumped), "index checksum")
    end = RecordHeader(RecordKind.END, "", None, count=len(records))
    ended = zstandard.ZstdCompressor().compress(raw + encode_index([end]))
    more = header.records + 1
    lied = indexed(ended, len(raw) + len(encode_index([end])), records=more)
    _expect(CorruptPatchError, base, lied, "unknown record kind 0")


def _one_record_patch(
    base: dict,
    kind: RecordKind,
    coding: ValueCoding,
    payload_raw: bytes,
    count: int,
    reference: str | None = None,
    **fields: object,
) -> bytes:
    """A patch of one hand-made record for tensor 'sparse' (chunk [0, 1024)), its checksums right."""
    payload = zstandard.ZstdCompressor(write_checksum=True).compress(payload_raw)
    raw, comp = len(payload_raw), len(payload)
    h = RecordHeader(kind, "sparse", BF16, (3000,), coding, 0, 1024, count, 0, 0, raw, comp, payload_hash(payload))
    h = h._replace(**fields)
    assert raw_len_for(h) == raw
    digest = "mixsum-128" if h.positions != PositionCoding.GAPS16 else "xxh3-128"
    header = PatchHeader(
        value_coding="adaptive" if digest == "mixsum-128" else "delta",
        zstd_level=1,
        chunk_elements=1024,
        digest_algorithm=digest,
        base_digest=state_digest(base, digest).root,
        state_digest="0" * 32,  # deliberately wrong: a patch that applies fails only at the end
        records=1,
        decoded_bytes=raw,
        changed_elements=count,
        dense_bytes=0,
        reference_sha256=reference,
    )
    return assemble_patch(header, [(h, payload)])


def _sparse_patch(base: dict, gaps: list[int], escapes: list[int], length: int = 1024) -> bytes:
    """A hand-made SPARSE record for tensor 'sparse' with the given u16 gaps and escapes."""
    n = len(gaps)
    planes = np.array(gaps, np.uint16).view(np.uint8).reshape(-1, 2).T.tobytes()
    values = np.zeros((n + 3) // 4, np.uint8).tobytes()  # codes 0: sym 0 -> zigzag 1 -> delta -1
    payload_raw = planes + np.array(escapes, "<u8").tobytes() + values
    return _one_record_patch(
        base, RecordKind.SPARSE, ValueCoding.DELTA, payload_raw, n, escapes=len(escapes), length=length
    )


@BOTH_KERNELS
def test_out_of_bounds_positions_are_refused_and_nothing_is_written(pair, kernels: bool, monkeypatch) -> None:
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)
    for gaps, escapes, match in [
        ([0, 1023], [], "outside the chunk"),  # positions 0 and 1024 in a chunk of 1024
        ([0xFFFF], [5000], "exceeds the chunk"),  # escaped gap beyond the chunk
        ([0xFFFF, 0xFFFF], [600, 600], "(exceeds|outside) the chunk"),  # each fits, together they do not
        ([0xFFFF], [], "decoded bytes|escape count"),  # an escape mark without its escape
        ([0, 5], [7], "decoded bytes|escape count"),  # an escape without its mark
    ]:
        work = clone_state(base)
        with pytest.raises(CorruptPatchError, match=match):
            apply_patch(work, _sparse_patch(base, gaps, escapes))
        assert_states_equal(work, base)
    # The same hand-made record with valid positions applies (so the checks above are the cause).
    work = clone_state(base)
    with pytest.raises(IntegrityError, match="promises"):  # its state digest is deliberately wrong
        apply_patch(work, _sparse_patch(base, [0, 10], []))
    expected = base["sparse"].view(torch.int16)[[0, 11]]
    assert not torch.equal(work["sparse"].view(torch.int16)[[0, 11]], expected)


def _gap_codes_patch(base: dict, positions: list[int]) -> bytes:
    """A hand-made SPARSE record for tensor 'sparse' with GAP_CODES positions (any, inside the chunk or not)."""
    codes, extra = encode_gap_codes(np.array(positions, np.int64))
    n = len(positions)
    payload_raw = codes.tobytes() + extra + np.zeros((n + 3) // 4, np.uint8).tobytes()  # every delta -1
    gap_codes = {"escapes": len(extra), "positions": PositionCoding.GAP_CODES}
    return _one_record_patch(base, RecordKind.SPARSE, ValueCoding.DELTA, payload_raw, n, **gap_codes)


@BOTH_KERNELS
def test_a_position_outside_the_chunk_late_in_a_gap_coded_record_is_refused_and_rolled_back(
    pair, kernels: bool, monkeypatch
) -> None:
    """The batch kernel decodes each position AHEAD elements before its write: the position after
    AHEAD + 24 inside the chunk is outside it, so the first 24 were written before it was seen. The
    error names the record, and the undo log holds exactly what was written (on both paths)."""
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)
    inside = batch.AHEAD + 24
    bad = [*range(0, 2 * inside, 2), 1024]  # positions inside the chunk of 1024, then one just outside
    work, undo = clone_state(base), UndoLog()
    with pytest.raises(CorruptPatchError, match="'sparse' at element 0: a position is outside the chunk of 1024"):
        apply_patch(work, _gap_codes_patch(base, bad), undo=undo)
    written = sum(0 if index is None else len(index) for _, _, _, index, _ in undo.chunks)
    assert written == (24 if kernels else 0)  # what the kernel wrote before it saw the position
    undo.rollback(work)
    assert_states_equal(work, base)
    # The same positions, all inside: applied (so the position is the cause), every delta -1.
    work = clone_state(base)
    with pytest.raises(IntegrityError, match="promises"):  # its state digest is deliberately wrong
        apply_patch(work, _gap_codes_patch(base, bad[:-1]))
    moved = work["sparse"].view(torch.int16)[0 : 2 * inside : 2].to(torch.int32)
    moved -= base["sparse"].view(torch.int16)[0 : 2 * inside : 2]
    assert moved.abs().max() >= 1


@BOTH_KERNELS
def test_a_class_ordered_record_with_a_position_outside_its_chunk_writes_nothing(
    pair, kernels: bool, monkeypatch
) -> None:
    """EXP_CODES values come in class order, so every old value is gathered before one is written;
    the batch kernel decodes the GAP_CODES positions inside that gather: the last one, outside the
    chunk, stops the record before any write (on both paths)."""
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)

    def patch(positions: list[int]) -> bytes:
        codes, extra = encode_gap_codes(np.array(positions, np.int64))
        symbols = bytes([2] * len(positions))  # every value +1 ordered step (code 1, sign 0)
        fields = {"escapes": len(extra), "positions": PositionCoding.GAP_CODES}
        return _one_record_patch(
            base, RecordKind.SPARSE, ValueCoding.EXP_CODES, codes.tobytes() + extra + symbols, len(positions), **fields
        )

    bad = [*range(0, 80, 2), 1024]
    work, undo = clone_state(base), UndoLog()
    with pytest.raises(CorruptPatchError, match="'sparse' at element 0: a position is outside the chunk of 1024"):
        apply_patch(work, patch(bad), undo=undo)
    assert undo.chunks == []
    assert_states_equal(work, base)
    work = clone_state(base)  # all inside: applied (so the position is the cause)
    with pytest.raises(IntegrityError, match="promises"):  # its state digest is deliberately wrong
        apply_patch(work, patch(bad[:-1]))
    assert not torch.equal(work["sparse"].view(torch.int16)[0:80:2], base["sparse"].view(torch.int16)[0:80:2])


def _history_patch(
    base: dict, marked: int, fresh: list[int], count: int, held: bool = False
) -> tuple[bytes, PatchHistory]:
    """A hand-made HISTORY record for 'sparse' against reference positions 10, 20, 30 (bitmap `marked`).

    held: class-ordered values (EXP_PLANES) against a reference that keeps the values it wrote, as
    the batch kernel's history does, so the kernel takes its one-pass path (_apply_history_known).
    """
    reference = PatchHistory("ab" * 32)
    positions, deltas = np.array([10, 20, 30], np.int64), np.ones(3, np.int16)
    chunk = ChunkHistory(positions, deltas)
    if held:  # the values the state holds there: what the reference patch wrote
        values = base["sparse"].view(torch.int16).numpy()[positions].copy()
        chunk = ChunkHistory(positions, deltas, (positions.ctypes.data, deltas.ctypes.data, values.ctypes.data), values)
    reference.chunks[("sparse", 0, 1024)] = chunk
    codes, extra = encode_gap_codes(np.array(fresh, np.int64))
    payload_raw = bytes([marked]) + codes.tobytes() + extra + bytes(2 * count)  # every residual 0
    fields = {"escapes": len(extra), "positions": PositionCoding.GAP_CODES, "ref_count": 3, "new_count": len(fresh)}
    coding = ValueCoding.EXP_PLANES if held else ValueCoding.PLANES
    patch = _one_record_patch(base, RecordKind.HISTORY, coding, payload_raw, count, reference.sha256, **fields)
    return patch, reference


@BOTH_KERNELS
@pytest.mark.parametrize("held", [False, True], ids=["values-free", "held-values"])
def test_history_records_that_contradict_their_reference_are_refused_with_one_message(
    pair, kernels: bool, held: bool, monkeypatch
) -> None:
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)
    for marked, fresh, count, match in [
        (0b111, [5], 3, "does not mark 2 positions"),  # 3 marked, the counts say 2
        (0b1000_0101, [5], 3, "does not mark 2 positions"),  # a padding bit set
        (0b101, [30], 3, "repeats one of the reference's"),  # 30 changed again, and is new
    ]:
        patch, reference = _history_patch(base, marked, fresh, count, held)
        work = clone_state(base)
        with pytest.raises(CorruptPatchError, match=f"'sparse' at element 0: .*{match}"):
            apply_patch(work, patch, reference=reference)
        assert_states_equal(work, base)
    patch, reference = _history_patch(base, 0b101, [5], 3, held)  # consistent: applied (deltas 1 at 10 and 30)
    work = clone_state(base)
    with pytest.raises(IntegrityError, match="promises"):
        apply_patch(work, patch, reference=reference)
    changed = torch.nonzero(work["sparse"].view(torch.int16) != base["sparse"].view(torch.int16)).flatten()
    assert changed.tolist() == [10, 30]


def _class_masks_patch(base: dict, table: np.ndarray, bitmap: bytes, count: int) -> bytes:
    """A hand-made SPARSE record for 'sparse' with CLASS_MASKS positions (any table and bitmap), every delta -1."""
    payload_raw = table.astype(np.uint8).tobytes() + bitmap + np.zeros((count + 3) // 4, np.uint8).tobytes()
    fields = {"escapes": len(bitmap), "positions": PositionCoding.CLASS_MASKS}
    return _one_record_patch(base, RecordKind.SPARSE, ValueCoding.DELTA, payload_raw, count, **fields)


@BOTH_KERNELS
def test_class_masks_that_contradict_the_chunk_are_refused_and_nothing_is_written(
    pair, kernels: bool, monkeypatch
) -> None:
    """The class table, the bitmap of the marked classes' elements and the count must agree with the old values."""
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)
    classes = (base["sparse"].view(torch.int16)[:1024].numpy().astype(np.int32) >> 7) & 0xFF
    every, marked = int(classes[0]), int(classes[1])
    assert every != marked
    in_every, in_marked = int((classes == every).sum()), int((classes == marked).sum())
    table = np.zeros(256, np.uint8)
    table[every], table[marked] = 1, 2
    first_only = np.packbits(np.arange(in_marked) == 0, bitorder="little").tobytes()  # the marked class's first
    padded = bytes([*first_only[:-1], first_only[-1] | 0x80]) if in_marked % 8 else first_only + b"\x01"
    bad_table = table.copy()
    bad_table[7] = 3
    for table_, bitmap, count, match in [
        (bad_table, first_only, in_every + 1, "a class-masks table entry is above 2"),
        (table, first_only, in_every + 2, "the class masks do not mark the record.s count of positions"),
        (table, first_only, in_every, "the class masks do not mark the record.s count of positions"),
        (table, first_only + b"\x00", in_every + 1, "the class-masks bitmap does not match"),  # one byte too many
        (table, padded, in_every + 1, "the class-masks bitmap does not match"),  # a padding bit set, or a byte too many
    ]:
        work = clone_state(base)
        with pytest.raises(CorruptPatchError, match=f"'sparse' at element 0: {match}"):
            apply_patch(work, _class_masks_patch(base, table_, bitmap, count))
        assert_states_equal(work, base)
    work = clone_state(base)  # consistent: applied (every element of one class, the first of the other)
    with pytest.raises(IntegrityError, match="promises"):  # its state digest is deliberately wrong
        apply_patch(work, _class_masks_patch(base, table, first_only, in_every + 1))
    changed = torch.nonzero(work["sparse"].view(torch.int16) != base["sparse"].view(torch.int16)).flatten()
    expected = [*np.flatnonzero(classes == every).tolist(), int(np.flatnonzero(classes == marked)[0])]
    assert changed.tolist() == sorted(expected)


@BOTH_KERNELS
def test_value_codes_that_do_not_match_their_stream_are_refused(pair, kernels: bool, monkeypatch) -> None:
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)
    codes, extra = encode_gap_codes(np.array([0, 10], np.int64))
    gap_codes = {"escapes": len(extra), "positions": PositionCoding.GAP_CODES}

    def patch(symbols: bytes, value_extra: bytes) -> bytes:
        payload_raw = codes.tobytes() + extra + symbols + value_extra
        fields = {**gap_codes, "value_escapes": len(value_extra)}
        return _one_record_patch(base, RecordKind.SPARSE, ValueCoding.EXP_CODES, payload_raw, 2, **fields)

    big = 2 * (8 + 4 * (10 - 4) + 1)  # |v| of 10 bits: 7 extra bits
    for symbols, value_extra, match in [
        (bytes([255, 2]), b"", "a value code is above 247"),
        (bytes([big, 2]), b"", "the extra-bits stream does not match the value codes"),  # its 7 bits missing
        (bytes([big, 2]), b"\x80", "the extra-bits stream does not match the value codes"),  # a padding bit set
        (bytes([2, 2]), b"\x00", "the extra-bits stream does not match the value codes"),  # a byte too many
    ]:
        work = clone_state(base)
        with pytest.raises(CorruptPatchError, match=f"'sparse' at element 0: {match}"):
            apply_patch(work, patch(symbols, value_extra))
        assert_states_equal(work, base)
    work = clone_state(base)  # consistent: +1 and -645 ordered steps, in class order, folded by the old signs
    with pytest.raises(IntegrityError, match="promises"):
        apply_patch(work, patch(bytes([2, big + 1]), b"\x05"))
    old = base["sparse"].view(torch.int16)[[0, 10]].numpy().astype(np.int32)
    new = work["sparse"].view(torch.int16)[[0, 10]].numpy().astype(np.int32)
    ordered = [np.where(x < 0, x ^ 0x7FFF, x) for x in (old, new)]
    moves = (ordered[1] - ordered[0]) * np.where(old < 0, -1, 1)
    in_class_order = moves[np.argsort((old >> 7) & 0xFF, kind="stable")]
    assert in_class_order.tolist() == [1, -((4 + 1) << 7 | 5)]


@BOTH_KERNELS
@pytest.mark.parametrize("coding", [ValueCoding.DELTA, ValueCoding.EXP_CODES])
def test_gap_codes_that_do_not_match_their_stream_are_refused(
    pair, kernels: bool, coding: ValueCoding, monkeypatch
) -> None:
    """The gap-code check (branch-free in the kernel) on the batch's two readers: DELTA records and
    the records whose positions are decoded before their values (EXP_CODES)."""
    base, _ = pair
    monkeypatch.setattr(jit, "enabled", kernels)
    values = bytes(1) if coding == ValueCoding.DELTA else bytes([2, 2])  # two values, every one small

    def patch(codes: bytes, extra: bytes) -> bytes:
        fields = {"escapes": len(extra), "positions": PositionCoding.GAP_CODES}
        return _one_record_patch(base, RecordKind.SPARSE, coding, codes + extra + values, 2, **fields)

    big = 8 + 4 * (10 - 4) + 1  # a gap of 10 bits: 7 extra bits
    for codes, extra, match in [
        (bytes([0, 255]), b"", "a position gap code is above 123"),
        (bytes([0, big]), b"", "the extra-bits stream does not match the gap codes"),  # its 7 bits missing
        (bytes([0, big]), b"\x80", "the extra-bits stream does not match the gap codes"),  # a padding bit set
        (bytes([0, 2]), b"\x00", "the extra-bits stream does not match the gap codes"),  # a byte too many
    ]:
        work = clone_state(base)
        with pytest.raises(CorruptPatchError, match=f"'sparse' at element 0: {match}"):
            apply_patch(work, patch(codes, extra))
        assert_states_equal(work, base)
    work = clone_state(base)  # consistent: positions 0 and 0 + 1 + ((4 + 1) << 7 | 5) = 646
    with pytest.raises(IntegrityError, match="promises"):
        apply_patch(work, patch(bytes([0, big]), b"\x05"))
    changed = torch.nonzero(work["sparse"].view(torch.int16) != base["sparse"].view(torch.int16)).flatten()
    assert changed.tolist() == [0, 646]


def test_wrong_base_is_refused_before_writing(pair, patch) -> None:
    base, _ = pair
    other = clone_state(base)
    other["sparse"].view(torch.int16)[7] += 1
    work = clone_state(other)
    with pytest.raises(IntegrityError, match="made against state digest") as info:
        apply_patch(work, patch)
    assert not isinstance(info.value, CorruptPatchError)
    assert_states_equal(work, other)


def test_result_digest_mismatch(pair, patch) -> None:
    header, records = patch_records(patch)
    wrong = header.model_copy(update={"state_digest": "f" * 32})
    _expect(IntegrityError, pair[0], assemble_patch(wrong, records), "promises")


def test_undo_log_restores_a_state_whose_patch_failed_after_writing(pair, patch) -> None:
    base, _ = pair
    header, records = patch_records(patch)
    wrong = header.model_copy(update={"state_digest": "f" * 32})  # fails only after every record is applied
    work, undo = clone_state(base), UndoLog()
    with pytest.raises(IntegrityError, match="promises"):
        apply_patch(work, assemble_patch(wrong, records), undo=undo)
    assert undo.chunks and not torch.equal(work["sparse"].view(torch.int16), base["sparse"].view(torch.int16))
    undo.rollback(work)
    assert_states_equal(work, base)


def test_patch_applies_only_to_matching_tensor_layout(pair, patch) -> None:
    base, _ = pair
    reshaped = clone_state(base)
    reshaped["sparse"] = reshaped["sparse"].reshape(3, 1000)
    digest = state_digest(base)  # pretend the caller's digest is stale: layout checks still hold
    with pytest.raises(CorruptPatchError, match="expects BF16"):
        apply_patch(reshaped, patch, base_digest=digest)


def test_header_declares_stats(pair, patch) -> None:
    base, new = pair
    header = read_header(patch)
    assert header.base_digest == state_digest(base).root
    assert header.state_digest == state_digest(new).root
    assert header.dense_bytes == sum(t.numel() * t.element_size() for t in new.values())
