"""Patch application (pure): bounds-checked, bit-exact apply in place, the undo log, the verified result digest.

Every record is checked against the tensor it changes before anything is written, and every
position is bounds-checked (codec.parse decoded it); an undo log lets a caller patch its only
copy of a state and still restore it bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from pulsesync.codec import bits, fused
from pulsesync.codec.format import V2_CODINGS, RecordHeader, RecordKind, ValueCoding
from pulsesync.codec.history import ChunkHistory, PatchHistory
from pulsesync.codec.parse import PatchDecoder, PatchRecord, decode_planes, decode_record
from pulsesync.digest import (
    INCREMENTAL,
    StateDigest,
    TensorDigest,
    lane_change,
    root_digest,
    state_digest,
    tensor_digest,
    update_digest,
)
from pulsesync.dtypes import describe
from pulsesync.errors import CorruptPatchError, IntegrityError, MissingReferenceError
from pulsesync.threads import parallel_map, submit_beside


@dataclass
class UndoLog:
    """What applying a patch overwrote: enough to restore the state it was applied to.

    Lets a caller patch its only copy of a state in place (no full clone) and still get the old
    state back, bit for bit, if the result does not verify. Also says which positions changed.
    """

    # (name, start, length, chunk-relative positions or None for the whole chunk, old bits)
    chunks: list[tuple[str, int, int, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    tensors: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)  # old tensor (None: added)

    def rollback(self, state: MutableMapping[str, torch.Tensor]) -> None:
        """Restore `state` to what it was before the patch."""
        for name, start, length, index, old in reversed(self.chunks):
            chunk = state[name].view(-1).view(old.dtype).narrow(0, start, length)
            if index is None:
                chunk.copy_(old)
            else:
                chunk.index_copy_(0, index, old)
        for name, tensor in reversed(self.tensors):
            if tensor is None:
                state.pop(name, None)
            else:
                state[name] = tensor

    def changed(self) -> dict[str, torch.Tensor | None]:
        """Flat positions each changed tensor changed at (sorted), or None where the whole tensor changed."""
        out: dict[str, torch.Tensor | None] = {name: None for name, _ in self.tensors}
        pieces: dict[str, list[torch.Tensor]] = {}
        for name, start, _, index, _ in self.chunks:
            if index is None or name in out:
                out[name] = None
            else:
                pieces.setdefault(name, []).append(index + start)
        for name, parts in pieces.items():
            if name not in out:
                out[name] = torch.cat(parts)
        return out


def apply_record(
    record: PatchRecord,
    state: MutableMapping[str, torch.Tensor],
    device: torch.device | None = None,
    undo: UndoLog | None = None,
    history: PatchHistory | None = None,
    lanes: np.ndarray | None = None,
) -> None:
    """Apply one decoded record to `state` in place (a non-contiguous target is first replaced by a contiguous copy).

    With `history`, a SPARSE or HISTORY record adds its chunk's positions and deltas to it. With
    `lanes` (uint64[2]), a chunk record adds there how it moved its tensor's mixsum-128 lane sums.
    """
    h = record.header
    check_target(h, state)
    if undo is not None and (h.kind in (RecordKind.ADD, RecordKind.REPLACE, RecordKind.REMOVE)):
        undo.tensors.append((h.name, state.get(h.name)))
    if h.kind == RecordKind.REMOVE:
        del state[h.name]
        return
    if h.kind in (RecordKind.ADD, RecordKind.REPLACE):
        assert record.values is not None
        target = device or _state_device(state)
        if record.values.size == 0:  # views of empty buffers carry strides nothing can reinterpret
            state[h.name] = torch.empty(h.shape, dtype=h.info.torch_dtype, device=target)
        else:
            tensor = torch.from_numpy(record.values).view(h.info.torch_dtype).reshape(h.shape)
            state[h.name] = tensor.to(target)
        return
    tensor = state[h.name]
    if not tensor.is_contiguous():
        if undo is not None:
            undo.tensors.append((h.name, tensor))
        state[h.name] = tensor = tensor.contiguous()
    chunk = tensor.view(-1).view(h.info.int_dtype)[h.start : h.start + h.length]
    if h.coding in V2_CODINGS:
        _apply_deltas(record, chunk, undo, history, lanes)
    elif record.packed is not None and chunk.device.type == "cpu" and fused.apply_delta_2byte is not None:
        _apply_packed(record, chunk, undo, history, lanes)
    else:
        _apply_coded(record, chunk, undo, history, lanes)


def _apply_packed(
    record: PatchRecord,
    chunk: torch.Tensor,
    undo: UndoLog | None,
    history: PatchHistory | None,
    lanes: np.ndarray | None,
) -> None:
    """A SPARSE record of packed small deltas on a CPU chunk: the fused kernel, in one pass."""
    h, positions = record.header, record.positions
    assert record.packed is not None and positions is not None and fused.apply_delta_2byte is not None
    packed, escapes = record.packed
    old = np.empty(positions.size, np.int16)
    deltas = np.empty(positions.size if history is not None else 0, np.int16)
    target = chunk.detach().numpy()
    fused.apply_delta_2byte(
        target, positions, packed, escapes, old, deltas, h.start, _NO_LANES if lanes is None else lanes
    )
    _log_kernel_chunk(h, positions, old, deltas, undo, history)


def _apply_coded(
    record: PatchRecord,
    chunk: torch.Tensor,
    undo: UndoLog | None,
    history: PatchHistory | None,
    lanes: np.ndarray | None,
) -> None:
    """A format-1 SPARSE or DENSE record, or packed deltas off the CPU: decode the values, then write them."""
    h = record.header
    key = (h.name, h.start, h.length)
    coded_values = record.values
    if record.packed is not None:
        assert record.positions is not None
        packed, escapes = record.packed
        coded_values = deltas = bits.unpack_small_deltas(packed, record.positions.size, escapes, 1, h.name)
        if history is not None:
            history.chunks[key] = ChunkHistory(record.positions, deltas)
    assert coded_values is not None
    coded = torch.from_numpy(coded_values).to(chunk.device)
    if h.kind == RecordKind.DENSE:
        old = chunk.clone() if undo is not None or lanes is not None else None
        if undo is not None and old is not None:
            undo.chunks.append((h.name, h.start, h.length, None, old))
        bits.decode_values_(chunk, coded, h.info, h.coding)
        if lanes is not None and old is not None:
            _add_lanes(lanes, lane_change(old, chunk, h.start))
        return
    assert record.positions is not None
    index = torch.from_numpy(record.positions).to(chunk.device)
    values = chunk.index_select(0, index)
    # Packed records have put their (decoded) deltas into the history above.
    derive_history = history is not None and record.packed is None
    old_values = values.clone() if undo is not None or derive_history or lanes is not None else values
    if undo is not None:
        undo.chunks.append((h.name, h.start, h.length, index, old_values))
    new_values = bits.decode_values_(values, coded, h.info, h.coding)
    chunk.index_copy_(0, index, new_values)
    if lanes is not None:
        _add_lanes(lanes, lane_change(old_values, new_values, h.start, record.positions))
    if derive_history:
        assert history is not None
        ordered_deltas = bits.encode_values(old_values, new_values, h.info, ValueCoding.DELTA)
        history.chunks[key] = ChunkHistory(record.positions, bits.host(ordered_deltas))


def _apply_deltas(
    record: PatchRecord,
    chunk: torch.Tensor,
    undo: UndoLog | None,
    history: PatchHistory | None,
    lanes: np.ndarray | None,
) -> None:
    """Apply a format-2 SPARSE or HISTORY record: signed ordered deltas at positions."""
    h = record.header
    assert record.positions is not None
    key = (h.name, h.start, h.length)
    if record.planes is not None and chunk.device.type == "cpu" and fused.apply_planes_2byte is not None:
        positions = record.positions
        old_values, applied = np.empty(positions.size, np.int16), np.empty(positions.size, np.int16)
        ref_deltas = record.ref_deltas if record.ref_deltas is not None else np.empty(0, np.int16)
        by_class = h.coding == ValueCoding.EXP_PLANES
        target, out = chunk.detach().numpy(), _NO_LANES if lanes is None else lanes
        fused.apply_planes_2byte(
            target, positions, record.planes, by_class, ref_deltas, old_values, applied, h.start, out
        )
        _log_kernel_chunk(h, positions, old_values, applied, undo, history)
        return
    index = torch.from_numpy(record.positions).to(chunk.device)
    old = chunk.index_select(0, index)
    deltas = record.values if record.planes is None else decode_planes(record.planes, h)
    assert deltas is not None
    if h.coding == ValueCoding.EXP_PLANES:  # stored sorted by the old values' magnitude class
        in_order = np.empty_like(deltas)
        in_order[bits.magnitude_order(bits.host(old))] = deltas
        deltas = in_order
    if record.ref_deltas is not None:
        deltas = bits.wrapping_add(deltas, record.ref_deltas)
    before = old.clone() if undo is not None or lanes is not None else old
    if undo is not None:
        undo.chunks.append((h.name, h.start, h.length, index, before))
    coded = torch.from_numpy(deltas).to(chunk.device)
    new = bits.decode_values_(old, coded, h.info, ValueCoding.DELTA)
    chunk.index_copy_(0, index, new)
    if lanes is not None:
        _add_lanes(lanes, lane_change(before, new, h.start, record.positions))
    if history is not None:
        history.chunks[key] = ChunkHistory(record.positions, deltas)


def _log_kernel_chunk(
    h: RecordHeader,
    positions: np.ndarray,
    old: np.ndarray,
    deltas: np.ndarray,
    undo: UndoLog | None,
    history: PatchHistory | None,
) -> None:
    """What a fused kernel overwrote into the undo log, and the deltas it applied into the history."""
    if undo is not None:
        undo.chunks.append((h.name, h.start, h.length, torch.from_numpy(positions), torch.from_numpy(old)))
    if history is not None:
        history.chunks[(h.name, h.start, h.length)] = ChunkHistory(positions, deltas)


_NO_LANES = np.zeros(0, np.uint64)  # the kernels' "no digest to update"


def _add_lanes(lanes: np.ndarray, moved: tuple[int, int]) -> None:
    lanes += np.array(moved, np.uint64)  # modulo 2**64, as mixsum.add


def _kept(base: StateDigest, state: MutableMapping[str, torch.Tensor], name: str) -> TensorDigest:
    """The digest of a tensor the patch did not touch: the base digest's entry (hashed if it has none)."""
    kept = base.tensors.get(name)
    return kept if kept is not None else tensor_digest(state[name], base.algorithm)


def _state_device(state: MutableMapping[str, torch.Tensor]) -> torch.device:
    for t in state.values():
        return t.device
    return torch.device("cpu")


def check_target(h: RecordHeader, state: MutableMapping[str, torch.Tensor]) -> None:
    """Raise CorruptPatchError unless the record fits `state` (done before any allocation)."""
    present = h.name in state
    if h.kind == RecordKind.ADD:
        if present:
            raise CorruptPatchError(f"record adds tensor {h.name!r}, which the state already has")
        return
    if not present:
        raise CorruptPatchError(f"record {h.kind.name} targets tensor {h.name!r}, which the state lacks")
    if h.kind in (RecordKind.SPARSE, RecordKind.DENSE, RecordKind.HISTORY):
        t = state[h.name]
        if t.dtype != h.info.torch_dtype or tuple(t.shape) != h.shape:
            raise CorruptPatchError(
                f"record for tensor {h.name!r} expects {h.info.name}{list(h.shape)}, the state has {describe(t)}"
            )


def apply_patch(
    state: MutableMapping[str, torch.Tensor],
    patch: bytes | memoryview,
    *,
    base_digest: StateDigest | None = None,
    verify: bool = True,
    threads: int | None = 1,
    max_decoded_bytes: int | None = None,
    undo: UndoLog | None = None,
    reference: PatchHistory | None = None,
    history: PatchHistory | None = None,
) -> StateDigest | None:
    """Apply a patch to `state` in place; bit-exact. Returns the new state's digest if verified.

    `base_digest` is the digest of `state` if already known (else it is computed); it must equal
    the patch's base digest. With `verify`, the result's digest must equal the patch's state digest:
    each tensor is re-hashed on another core as soon as its last record is applied (overlapping
    the decode of the next ones), and tensors the patch does not touch keep their base digest.
    On any error `state` may be partially patched: pass an `undo` log and roll it back, or apply
    to a working copy and discard it. Records decode on one thread by default: their many small
    array operations contend for the GIL, so more threads were slower on every machine measured
    (docs/benchmarks.md).

    A history-coded patch needs `reference`, the history of the patch named in its header
    (MissingReferenceError otherwise). Pass an empty `history` to collect this patch's own.
    """
    parser = PatchDecoder(max_decoded_bytes)
    raw_records = parser.split(patch)
    header = parser.finish()
    if header.part is not None:
        raise CorruptPatchError(f"patch is part {header.part} of a sharded step: apply the step's parts together")
    algorithm = header.digest_algorithm
    current = base_digest or state_digest(state, algorithm, threads)
    if current.root != header.base_digest:
        raise IntegrityError(
            f"patch was made against state digest {header.base_digest}, "
            f"but the state to patch has {current.algorithm} digest {current.root}"
        )
    if header.reference_sha256 is not None and (reference is None or reference.sha256 != header.reference_sha256):
        held = "none" if reference is None else f"patch {reference.sha256[:16]}..."
        raise MissingReferenceError(
            f"patch is history-coded against patch {header.reference_sha256[:16]}..., the reference held is {held}"
        )
    incremental = verify and algorithm in INCREMENTAL
    moved, whole_records, rehashed = _apply_records(
        state, parser, raw_records, undo, reference, history, threads, verify, incremental
    )
    if not verify:
        return None
    if incremental:
        result = update_digest(current, state, moved, [r.name for r in whole_records])
    else:
        tensors = {n: rehashed[n].result() if n in rehashed else _kept(current, state, n) for n in sorted(state)}
        result = StateDigest(algorithm=algorithm, root=root_digest(tensors, algorithm), tensors=tensors)
    if result.root != header.state_digest:
        raise IntegrityError(f"patched state has digest {result.root}, the patch promises {header.state_digest}")
    return result


def apply_parts(
    state: MutableMapping[str, torch.Tensor],
    parts: Sequence[bytes | memoryview],
    *,
    base_digest: StateDigest,
    threads: int | None = 1,
    max_decoded_bytes: int | None = None,
    undo: UndoLog | None = None,
) -> StateDigest:
    """Apply a sharded step's parts in order, in place; returns the digest they compose to.

    Each part holds chunk records of the pieces one rank owns, made against the step's base
    (`base_digest`); the caller checks the result against the step's signed manifest. On any
    error `state` may be partially patched: roll `undo` back.
    """
    if base_digest.algorithm not in INCREMENTAL:
        raise IntegrityError(f"a sharded patch needs an incremental digest, the state has {base_digest.algorithm}")
    moved: list[tuple[str, tuple[int, int]]] = []
    for index, patch in enumerate(parts):
        parser = PatchDecoder(max_decoded_bytes)
        raw_records = parser.split(patch)
        header = parser.finish()
        if header.part != index or header.state_digest or header.reference_sha256 is not None:
            raise CorruptPatchError(f"part {index} of a sharded step: its header says part {header.part}")
        if header.base_digest != base_digest.root or header.digest_algorithm != base_digest.algorithm:
            raise IntegrityError(
                f"part {index} was made against state digest {header.base_digest}, the state to patch has "
                f"{base_digest.root}"
            )
        if whole := [h.name for h, _ in raw_records if h.kind not in _CHUNK_KINDS]:
            raise CorruptPatchError(f"part {index} of a sharded step: tensor {whole[0]!r} has a whole-tensor record")
        moved += _apply_records(state, parser, raw_records, undo, None, None, threads, True, True)[0]
    return update_digest(base_digest, state, moved, [])


_CHUNK_KINDS = (RecordKind.SPARSE, RecordKind.DENSE, RecordKind.HISTORY)


def _apply_records(
    state: MutableMapping[str, torch.Tensor],
    parser: PatchDecoder,
    raw_records: list[tuple[RecordHeader, memoryview]],
    undo: UndoLog | None,
    reference: PatchHistory | None,
    history: PatchHistory | None,
    threads: int | None,
    verify: bool,
    incremental: bool,
) -> tuple[list[tuple[str, tuple[int, int]]], list[PatchRecord], dict[str, Future[TensorDigest]]]:
    """Decode and apply a parsed patch's records: chunk records concurrently, whole-tensor ones after.

    Returns how each chunk record moved its tensor's lanes (incremental digests), the whole-tensor
    records applied, and the re-hashes started (a non-incremental digest with `verify`).
    """
    assert parser.header is not None
    algorithm = parser.header.digest_algorithm
    chunk_kinds = _CHUNK_KINDS
    for h, _ in raw_records:
        check_target(h, state)
        tensor = state[h.name] if h.kind in chunk_kinds else None
        if tensor is not None and not tensor.is_contiguous():
            if undo is not None:
                undo.tensors.append((h.name, tensor))
            state[h.name] = tensor.contiguous()

    references = reference.chunks if reference is not None else {}
    # An incremental digest is updated by each record as it writes: how it moved its tensor's lanes.
    moved: list[tuple[str, tuple[int, int]]] = []

    def decode_and_apply(item: tuple[RecordHeader, memoryview]) -> tuple[PatchRecord | None, np.ndarray | None]:
        h = item[0]
        record = decode_record(*item, parser.version, references.get((h.name, h.start, h.length)))
        if h.kind not in chunk_kinds:
            return record, None
        lanes = np.zeros(2, np.uint64) if incremental else None
        apply_record(record, state, undo=undo, history=history, lanes=lanes)  # disjoint chunks: safe concurrently
        return None, lanes

    rehashed: dict[str, Future[TensorDigest]] = {}

    def rehash(name: str) -> None:
        if verify and not incremental and name in state:
            rehashed[name] = submit_beside(tensor_digest, state[name], algorithm)

    device = _state_device(state)
    whole_records: list[PatchRecord] = []
    previous: str | None = None
    # In order: once a record of the next tensor has been applied, the previous tensor is final.
    with contextlib.closing(parallel_map(decode_and_apply, raw_records, threads)) as applied:
        for (h, _), (record, lanes) in zip(raw_records, applied, strict=True):
            if previous is not None and h.name != previous:
                rehash(previous)
            previous = None if record is not None else h.name
            if record is not None:
                whole_records.append(record)
            if lanes is not None:
                moved.append((h.name, (int(lanes[0]), int(lanes[1]))))
    if previous is not None:
        rehash(previous)
    for record in whole_records:  # whole-tensor records change the dict itself: after the concurrent part
        apply_record(record, state, device, undo)
        rehash(record.name)
    return moved, whole_records, rehashed
