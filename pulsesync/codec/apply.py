"""Patch application (pure): bounds-checked, bit-exact apply in place, the undo log, the verified result digest.

Every record is checked against the tensor it changes before anything is written, and every
position is bounds-checked (codec.parse decoded it); an undo log lets a caller patch its only
copy of a state and still restore it bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, MutableMapping, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pulsesync.codec import batch, jit
from pulsesync.codec.arenas import ArenaPool
from pulsesync.codec.codings.class_masks import decode_class_masks, magnitude_order
from pulsesync.codec.codings.history import predicted_offsets
from pulsesync.codec.codings.small_codes import unpack_small_deltas
from pulsesync.codec.codings.values import decode_values_, encode_values, fold_by_sign, host, wrapping_add
from pulsesync.codec.format import (
    BY_CLASS,
    CODES,
    V2_CODINGS,
    PatchHeader,
    RecordHeader,
    RecordKind,
    ValueCoding,
)
from pulsesync.codec.history import ChunkHistory, ChunkKey, PatchHistory, StepHistory
from pulsesync.codec.parse import (
    PatchDecoder,
    PatchRecord,
    decode_planes,
    decode_record,
    decompress_payload,
    record_where,
)
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
from pulsesync.threads import Runner, default_threads, parallel_map, submit_beside

Logged = torch.Tensor | np.ndarray  # what an undo log entry holds: a tensor, or a CPU kernel's array


def _tensor(logged: Logged) -> torch.Tensor:
    """An undo log entry as a tensor (a CPU kernel's array without a copy)."""
    return torch.from_numpy(logged) if isinstance(logged, np.ndarray) else logged


@dataclass
class UndoLog:
    """What applying a patch overwrote: enough to restore the state it was applied to.

    Lets a caller patch its only copy of a state in place (no full clone) and still get the old
    state back, bit for bit, if the result does not verify. Also says which positions changed.
    """

    # (name, start, length, chunk-relative positions or None for the whole chunk, old bits); the
    # compiled kernels log numpy arrays (CPU only), made tensors only if used: a view costs ~2 us.
    chunks: list[tuple[str, int, int, Logged | None, Logged]] = field(default_factory=list)
    tensors: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)  # old tensor (None: added)

    def rollback(self, state: MutableMapping[str, torch.Tensor]) -> None:
        """Restore `state` to what it was before the patch."""
        for name, start, length, index, logged in reversed(self.chunks):
            old = _tensor(logged)
            chunk = state[name].view(-1).view(old.dtype).narrow(0, start, length)
            if index is None:
                chunk.copy_(old)
            else:
                chunk.index_copy_(0, _tensor(index), old)
        for name, tensor in reversed(self.tensors):
            if tensor is None:
                state.pop(name, None)
            else:
                state[name] = tensor

    def changed(self) -> dict[str, torch.Tensor | None]:
        """Flat positions each changed tensor changed at (sorted), or None where the whole tensor changed."""
        out: dict[str, torch.Tensor | None] = {name: None for name, _ in self.tensors}
        pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for name, start, _, index, _ in self.chunks:
            if index is None or name in out:
                out[name] = None
            else:
                pieces.setdefault(name, []).append((start, _tensor(index) + start))
        for name, parts in pieces.items():
            if name not in out:  # chunks are logged in the order they were applied, not by position
                out[name] = torch.cat([part for _, part in sorted(parts, key=lambda p: p[0])])
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
    if record.class_masks is not None:  # positions coded by the old values' classes: decoded before any write
        found = decode_class_masks(host(chunk), *record.class_masks, h.count, record_where(h))
        record = replace(record, positions=found, class_masks=None)
    if h.coding in V2_CODINGS:
        _apply_deltas(record, chunk, undo, history, lanes)
    elif record.packed is not None and chunk.device.type == "cpu" and batch.apply_delta_2byte is not None:
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
    """A SPARSE record of packed small deltas on a CPU chunk: batch.apply_delta_2byte, in one pass."""
    h, positions = record.header, record.positions
    assert record.packed is not None and positions is not None and batch.apply_delta_2byte is not None
    packed, escapes = record.packed
    old = np.empty(positions.size, np.int16)
    deltas = np.empty(positions.size if history is not None else 0, np.int16)
    target = chunk.detach().numpy()
    batch.apply_delta_2byte(
        target, positions, packed, escapes, old, deltas, h.start, _NO_LANES if lanes is None else lanes, _NO_NEWS
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
        coded_values = deltas = unpack_small_deltas(packed, record.positions.size, escapes, 1, h.name)
        if history is not None:
            history.chunks[key] = ChunkHistory(record.positions, deltas)
    assert coded_values is not None
    coded = torch.from_numpy(coded_values).to(chunk.device)
    if h.kind == RecordKind.DENSE:
        old = chunk.clone() if undo is not None or lanes is not None else None
        if undo is not None and old is not None:
            undo.chunks.append((h.name, h.start, h.length, None, old))
        decode_values_(chunk, coded, h.info, h.coding)
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
    new_values = decode_values_(values, coded, h.info, h.coding)
    chunk.index_copy_(0, index, new_values)
    if lanes is not None:
        _add_lanes(lanes, lane_change(old_values, new_values, h.start, record.positions))
    if derive_history:
        assert history is not None
        ordered_deltas = encode_values(old_values, new_values, h.info, ValueCoding.DELTA)
        history.chunks[key] = ChunkHistory(record.positions, host(ordered_deltas))


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
    if record.planes is not None and chunk.device.type == "cpu" and batch.apply_planes_2byte is not None:
        positions = record.positions
        old_values, applied = np.empty(positions.size, np.int16), np.empty(positions.size, np.int16)
        ref_deltas = record.ref_deltas if record.ref_deltas is not None else np.empty(0, np.int16)
        target, out = chunk.detach().numpy(), _NO_LANES if lanes is None else lanes
        batch.apply_planes_2byte(
            target, positions, record.planes, int(h.coding), ref_deltas, old_values, applied, h.start, out, _NO_NEWS
        )
        _log_kernel_chunk(h, positions, old_values, applied, undo, history)
        return
    index = torch.from_numpy(record.positions).to(chunk.device)
    old = chunk.index_select(0, index)
    deltas = record.values if record.planes is None else decode_planes(record.planes, h)
    assert deltas is not None
    old_bits = host(old)
    if h.coding in BY_CLASS:  # stored sorted by the old values' magnitude class
        in_order = np.empty_like(deltas)
        in_order[magnitude_order(old_bits)] = deltas
        deltas = in_order
    if h.coding in CODES:  # stored negated where the old value is negative
        deltas = fold_by_sign(deltas, old_bits)
    if record.ref_deltas is not None:
        reference = record.ref_deltas
        if h.coding == ValueCoding.PREDICTED_CODES:  # residuals against a float-space prediction
            reference = predicted_offsets(old_bits, reference)
        deltas = wrapping_add(deltas, reference)
    before = old.clone() if undo is not None or lanes is not None else old
    if undo is not None:
        undo.chunks.append((h.name, h.start, h.length, index, before))
    coded = torch.from_numpy(deltas).to(chunk.device)
    new = decode_values_(old, coded, h.info, ValueCoding.DELTA)
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
    addresses: tuple[int, int, int] | None = None,
    values: np.ndarray | None = None,
) -> None:
    """What a kernel overwrote into the undo log, and the deltas (and new values) it applied into the history."""
    if undo is not None:
        undo.chunks.append((h.name, h.start, h.length, positions, old))
    if history is not None:
        history.chunks[(h.name, h.start, h.length)] = ChunkHistory(positions, deltas, addresses, values)


_NO_LANES = np.zeros(0, np.uint64)  # the kernels' "no digest to update"
_NO_NEWS = np.zeros(0, np.int16)  # the kernels' "new values not kept"


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
    expected: StateDigest | None = None,
) -> StateDigest | None:
    """Apply a patch to `state` in place; bit-exact. Returns the new state's digest if verified.

    `base_digest` is the digest of `state` if already known (else it is computed); it must equal
    the patch's base digest. With `verify`, the result's digest must equal the patch's state digest
    (`expected`, the digest its signed manifest lists, is returned as the result's when it is):
    each tensor is re-hashed on another core as soon as its last record is applied (overlapping
    the decode of the next ones), and tensors the patch does not touch keep their base digest.
    On any error `state` may be partially patched: pass an `undo` log and roll it back, or apply
    to a working copy and discard it. SPARSE and HISTORY records of 2-byte floats on the CPU (nearly all of an
    RL patch) are decoded and applied in compiled batches, one per thread; the other records one
    at a time, on `threads` threads (None: one per CPU).

    A history-coded patch needs `reference`, the history of the patch named in its header
    (MissingReferenceError otherwise). Pass an empty `history` to collect this patch's own.
    """
    parser = PatchDecoder(max_decoded_bytes)
    raw_records = parser.records(patch)  # parsed while the first ones are applied
    header = parser.header
    assert header is not None
    if header.part is not None:
        raise CorruptPatchError(f"patch is part {header.part} of a sharded step: apply the step's parts together")
    algorithm = header.digest_algorithm
    current = base_digest or state_digest(state, algorithm, threads)
    if current.root != header.base_digest:
        raise IntegrityError(
            f"patch was made against state digest {header.base_digest}, "
            f"but the state to patch has {current.algorithm} digest {current.root}"
        )
    _check_reference(header.reference_sha256, reference, "patch")
    incremental = verify and algorithm in INCREMENTAL
    moved, whole_records, rehashed = _apply_records(
        state, parser, raw_records, len(patch), undo, reference, history, threads, verify, incremental
    )
    if not verify:
        return None
    if incremental:
        result = update_digest(current, state, moved, [r.name for r in whole_records], expected)
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
    expected: StateDigest | None = None,
    reference: StepHistory | None = None,
    histories: Sequence[PatchHistory] | None = None,
) -> StateDigest:
    """Apply a sharded step's parts in order, in place; returns the digest they compose to.

    Each part holds chunk records of the pieces one rank owns, made against the step's base
    (`base_digest`); the caller checks the result against the step's signed manifest (`expected`,
    returned as the result when they compose to it). A history-coded part needs the history of
    the part it names in `reference` (the step before's, MissingReferenceError otherwise); pass
    an empty history per part in `histories` (each named by its part's SHA-256, from the signed
    manifest) to collect each part's own. On any error `state` may be partially patched: roll
    `undo` back.
    """
    if base_digest.algorithm not in INCREMENTAL:
        raise IntegrityError(f"a sharded patch needs an incremental digest, the state has {base_digest.algorithm}")
    moved: list[tuple[str, tuple[int, int]]] = []
    for index, patch in enumerate(parts):
        parser = PatchDecoder(max_decoded_bytes)
        raw_records = parser.split(patch)
        header = parser.finish()
        if header.part != index or header.state_digest:
            raise CorruptPatchError(f"part {index} of a sharded step: its header says part {header.part}")
        if header.base_digest != base_digest.root or header.digest_algorithm != base_digest.algorithm:
            raise IntegrityError(
                f"part {index} was made against state digest {header.base_digest}, the state to patch has "
                f"{base_digest.root}"
            )
        if whole := [h.name for h, _ in raw_records if h.kind not in _CHUNK_KINDS]:
            raise CorruptPatchError(f"part {index} of a sharded step: tensor {whole[0]!r} has a whole-tensor record")
        against = _part_reference(header, raw_records, reference, f"part {index}")
        own = histories[index] if histories is not None else None
        moved += _apply_records(state, parser, raw_records, len(patch), undo, against, own, threads, True, True)[0]
    return update_digest(base_digest, state, moved, [], expected)


def apply_records_of(
    state: MutableMapping[str, torch.Tensor],
    patch: bytes | memoryview,
    *,
    reference: StepHistory | None,
    history: PatchHistory | None,
    threads: int | None = 1,
    max_decoded_bytes: int | None = None,
) -> None:
    """Apply, in place, the chunk records of a patch or a sharded step's part whose tensor `state` holds; skip the rest.

    What a relaunched rank rebuilding its pieces tensor by tensor applies (`publisher/pieces_rebuild.py`):
    no digest is checked here, the caller proves what it rebuilt against the step's signed digest.
    `reference` holds (at least) these tensors' chunks of the history the header names; an empty
    `history` collects theirs. A whole-tensor record of a held tensor raises CorruptPatchError.
    """
    parser = PatchDecoder(max_decoded_bytes)
    raw_records = parser.split(patch)
    header = parser.finish()
    held = [(h, payload) for h, payload in raw_records if h.name in state]
    what = "patch" if header.part is None else f"part {header.part}"
    against = _part_reference(header, held, reference, what)
    if whole := [h.name for h, _ in held if h.kind not in _CHUNK_KINDS]:
        raise CorruptPatchError(f"tensor {whole[0]!r} has a whole-tensor record: its pieces cannot be patched")
    _apply_records(state, parser, held, len(patch), None, against, history, threads, False, False)


def _part_reference(
    header: PatchHeader,
    records: Sequence[tuple[RecordHeader, memoryview]],
    reference: StepHistory | None,
    what: str,
) -> PatchHistory | None:
    """The history a patch or part is coded against: the one its header names, or (`reference_parts`) the
    step before's parts it names joined and cut into its HISTORY records' chunks. MissingReferenceError
    when what it needs is not held."""
    if header.reference_parts is None:
        against = reference.get(header.reference_sha256) if reference is not None else None
        _check_reference(header.reference_sha256, against, what)
        return against
    keys = [(h.name, h.start, h.length) for h, _ in records if h.kind == RecordKind.HISTORY]
    joined = reference.joined(header.reference_parts, keys) if reference is not None else None
    if joined is None:
        raise MissingReferenceError(
            f"{what} is history-coded against the step before's parts {header.reference_parts[0][:16]}... "
            f"({len(header.reference_parts)} in all), not all of whose histories are held"
        )
    return joined


def _check_reference(sha256: str | None, held: PatchHistory | None, what: str) -> None:
    """MissingReferenceError unless a patch coded against the patch of `sha256` has that patch's history."""
    if sha256 is not None and (held is None or held.sha256 != sha256):
        name = "none" if held is None else f"patch {held.sha256[:16]}..."
        raise MissingReferenceError(
            f"{what} is history-coded against patch {sha256[:16]}..., the reference held is {name}"
        )


_CHUNK_KINDS = (RecordKind.SPARSE, RecordKind.DENSE, RecordKind.HISTORY)


def _apply_records(
    state: MutableMapping[str, torch.Tensor],
    parser: PatchDecoder,
    raw_records: Iterable[tuple[RecordHeader, memoryview]],
    patch_bytes: int,
    undo: UndoLog | None,
    reference: PatchHistory | None,
    history: PatchHistory | None,
    threads: int | None,
    verify: bool,
    incremental: bool,
) -> tuple[list[tuple[str, tuple[int, int]]], list[PatchRecord], dict[str, Future[TensorDigest]]]:
    """Decode and apply a parsed patch's records: batchable records first (_apply_batch), the other
    chunk records concurrently, whole-tensor ones after.

    Returns how each chunk record moved its tensor's lanes (incremental digests), the whole-tensor
    records applied, and the re-hashes started (a non-incremental digest with `verify`).
    """
    assert parser.header is not None
    algorithm = parser.header.digest_algorithm
    chunk_kinds = _CHUNK_KINDS
    references = reference.chunks if reference is not None else {}
    runs = None
    if batch.apply_batch is not None and jit.enabled:
        runs = _Batch(state, parser.header, patch_bytes, undo, references, history, threads, incremental)
    rest: list[tuple[RecordHeader, memoryview]] = []
    try:  # records are checked, and batchable ones applied, as they are parsed
        for item in raw_records:
            h = item[0]
            check_target(h, state)
            tensor = state[h.name] if h.kind in chunk_kinds else None
            if tensor is not None and not tensor.is_contiguous():
                if undo is not None:
                    undo.tensors.append((h.name, tensor))
                state[h.name] = tensor.contiguous()
            if runs is not None and _batchable(h, state):
                runs.add(item)
            else:
                rest.append(item)
    except BaseException as e:
        if runs is not None:
            runs.close(e)  # raises e, or an error of a record before it
        raise
    # An incremental digest is updated by each record as it writes: how it moved its tensor's lanes.
    moved = runs.close() if runs is not None else []
    batched = list(runs.names) if runs is not None else []  # tensors the kernel changed (re-hashed at the end)
    raw_records = rest

    def decode_and_apply(item: tuple[RecordHeader, memoryview]) -> tuple[PatchRecord | None, np.ndarray | None]:
        h = item[0]
        record = decode_record(*item, parser.version, references.get((h.name, h.start, h.length)))
        if h.kind not in chunk_kinds:
            return record, None
        lanes = np.zeros(2, np.uint64) if incremental else None
        apply_record(record, state, undo=undo, history=history, lanes=lanes)  # disjoint chunks: safe concurrently
        return None, lanes

    rehashed: dict[str, Future[TensorDigest]] = {}
    rehashing = verify and not incremental  # an incremental digest re-hashes nothing

    def rehash(name: str) -> None:
        if rehashing and name in state and name not in rehashed:
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
    if rehashing:  # (else ~300 calls a step that do nothing, on the serial tail)
        for name in batched:  # (a tensor with records of both kinds was re-hashed after its last one above)
            rehash(name)
    return moved, whole_records, rehashed


_ARENAS = ArenaPool()
_BATCH_KINDS = (RecordKind.SPARSE, RecordKind.HISTORY)
# HISTORY records: the last two only (format.py refuses others)
_BATCH_CODINGS = (ValueCoding.RAW, ValueCoding.DELTA, *V2_CODINGS)


def _batchable(h: RecordHeader, state: MutableMapping[str, torch.Tensor]) -> bool:
    """Whether batch.apply_batch applies this record: a SPARSE or HISTORY record of a 2-byte float on the CPU."""
    if h.kind not in _BATCH_KINDS or h.coding not in _BATCH_CODINGS:
        return False
    return h.info.width == 2 and h.info.is_float and state[h.name].device.type == "cpu"


class _Batch:
    """SPARSE and HISTORY records of 2-byte floats, applied by the compiled kernel (batch.apply_batch) a run at a time.

    Records are added as the patch is parsed. Once a run holds about 1/RANGES_PER_THREAD of a
    thread's share of the patch's payload bytes (the first run, 1/FIRST_RUN_FRACTION of that), its
    payloads are decompressed here (zstd releases the GIL) and a thread decodes and applies the
    whole run in one call, every check of the single-record path included: threads - 1 workers apply
    the first runs while the caller parses the next, then the caller applies those no worker has
    started (threads.Runner). close() waits for every run, logs what each applied (and what a
    failing record wrote) into the undo log and the history, and returns how each record moved its
    tensor's lanes.
    """

    def __init__(
        self,
        state: MutableMapping[str, torch.Tensor],
        header: PatchHeader,
        patch_bytes: int,
        undo: UndoLog | None,
        references: dict[ChunkKey, ChunkHistory],
        history: PatchHistory | None,
        threads: int | None,
        incremental: bool,
    ) -> None:
        self.state, self.undo, self.references, self.history = state, undo, references, history
        self.incremental = incremental
        self.names: dict[str, None] = {}  # tensors the kernel changed, in order
        parts = 1 if threads == 1 else RANGES_PER_THREAD * (threads or default_threads())
        self.cut = max(header.decoded_bytes // parts, 1)  # payload bytes of a run
        # With workers the first run is smaller: one starts applying sooner while the caller parses on.
        # (One thread: a single run, so nothing is written before the whole patch has parsed.)
        self.first_cut = max(self.cut // FIRST_RUN_FRACTION, 1) if parts > 1 else self.cut
        # One buffer for the outputs (positions, old values, deltas, new values: 14 bytes a change) and
        # payloads of every run, sized by the header's declared totals,
        # reused once the undo log and history that refer to it are gone (codec.arenas: fresh pages
        # fault in the kernel's stores). The totals are not trusted: capped far above what a patch of
        # this size holds (~1 change a byte), and a run that would not fit gets a buffer of its own.
        # Each run's payloads are followed by 8 zero bytes: the kernel's bit reader reads a few past.
        self.changes = min(header.changed_elements, 4 * patch_bytes)
        self.payload_bytes = min(header.decoded_bytes, 8 * patch_bytes) + 8 * (parts + 2)
        self.arena: np.ndarray | None = None  # taken with the first run
        self.out = self.at = 0  # of the arena's outputs and payloads, taken by the runs so far
        self.items: list[tuple[RecordHeader, memoryview]] = []  # the run being filled
        self.raw = 0  # its payload bytes
        self.runs: list[tuple[list[tuple[RecordHeader, memoryview]], _Run, Future[tuple[int, int, int]]]] = []
        self.runner = Runner(threads)
        kernel = batch.apply_batch
        assert kernel is not None
        self.kernel = kernel

    def add(self, item: tuple[RecordHeader, memoryview]) -> None:
        """One more record (checked against the state by the caller); a full run is handed to a thread."""
        self.items.append(item)
        self.names[item[0].name] = None
        self.raw += item[0].raw_len  # decompress_payload checks the payload is exactly that
        if self.raw >= (self.cut if self.runs else self.first_cut):
            self._submit()

    def _submit(self) -> None:
        """Decompress the run's payloads and hand it to a thread (CorruptPatchError: a payload does not decompress)."""
        items, self.items, raw, self.raw = self.items, [], self.raw, 0
        if not items:
            return
        run = self._run_buffers(items, raw)
        into = memoryview(run.payloads.data)  # (a memoryview's slice assignment costs a fifth of numpy's)
        at = 0
        undecompressed: CorruptPatchError | None = None
        for index, (h, payload) in enumerate(items):
            try:
                into[at : at + h.raw_len] = decompress_payload(h, payload)
            except CorruptPatchError as e:  # the records before it are still applied (and logged)
                undecompressed = e
                items, run.table = items[:index], run.table[:index]
                break
            at += h.raw_len
        self.runs.append((items, run, self.runner.submit(self.kernel, *run.arguments())))
        if undecompressed is not None:
            raise undecompressed

    def _run_buffers(self, items: list[tuple[RecordHeader, memoryview]], raw: int) -> _Run:
        """A run's table of rows and its views of the arena (or a buffer of its own)."""
        rows: list[tuple[int, ...]] = []
        kept: list[ChunkHistory] = []  # the reference chunks the kernel reads by address stay alive until it is done
        at = out = 0
        for h, _ in items:
            address = self.state[h.name].data_ptr() + 2 * h.start  # contiguous, checked by check_target
            ref_positions = ref_deltas = ref_values = 0
            new_count = h.count
            if h.kind == RecordKind.HISTORY:
                reference = _reference_of(h, self.references)
                kept.append(reference)
                assert reference.addresses is not None
                ref_positions, ref_deltas, ref_values = reference.addresses
                new_count = h.new_count
            head = (address, h.length, at, h.count, h.escapes, h.value_escapes, h.positions, h.coding, h.start, out)
            rows.append((*head, new_count, h.ref_count, ref_positions, ref_deltas, h.kind, ref_values))
            at += h.raw_len
            out += h.count
        if self.out + out <= self.changes and self.at + raw + 8 <= self.payload_bytes:
            if self.arena is None:
                self.arena = _ARENAS.take(_OUT_BYTES * self.changes + self.payload_bytes)
            buffer, first_out, changes = self.arena, self.out, self.changes
            first_at = _OUT_BYTES * changes + self.at
            self.out, self.at = self.out + out, self.at + raw + 8
        else:  # the header declared fewer changes than the records hold
            buffer, first_out, first_at, changes = _ARENAS.take(_OUT_BYTES * out + raw + 8), 0, _OUT_BYTES * out, out
        positions = buffer[8 * first_out : 8 * (first_out + out)].view(np.int64)

        def int16s(column: int) -> np.ndarray:  # the 2-byte output after `column` others
            at = (8 + 2 * column) * changes + 2 * first_out
            return buffer[at : at + 2 * out].view(np.int16)

        payloads = buffer[first_at : first_at + raw + 8]
        payloads[raw:] = 0
        table = np.array(rows, np.int64).reshape(-1, batch.ROW_COLUMNS)
        lanes = np.zeros((len(rows), 2 if self.incremental else 0), np.uint64)
        return _Run(table, payloads, positions, int16s(0), int16s(1), int16s(2), lanes, kept)

    def close(self, pending: BaseException | None = None) -> list[tuple[str, tuple[int, int]]]:
        """Hand the last run over, wait for every run and log what it applied; raise the first error in patch order.

        With `pending` (what stopped the caller's parse), it is raised unless a run before it failed.
        """
        try:
            if pending is None:
                self._submit()
        except CorruptPatchError as e:
            pending = e
        moved: list[tuple[str, tuple[int, int]]] = []
        errors: list[BaseException] = []
        try:
            for items, run, future in self.runs:  # in order, each as soon as it is done
                # The caller is done parsing: until this run is done, it applies runs no worker has started
                # (the newest first), then logs each done one while the workers apply the last.
                while not future.done() and self.runner.run_one():
                    pass
                failed, status, done = future.result()
                end = len(items) if failed < 0 else failed
                positions_at, deltas_at = run.positions.ctypes.data, run.deltas.ctypes.data
                news_at = run.news.ctypes.data
                moved_lanes, outs = run.lanes.tolist(), run.table[:, batch.ROW_OUT].tolist()
                for index in range(end + 1 if failed >= 0 and done else end):  # and what a failing record wrote
                    h, o = items[index][0], outs[index]
                    n = h.count if index < end else done
                    written = (positions_at + 8 * o, deltas_at + 2 * o, news_at + 2 * o)
                    part = slice(o, o + n)
                    _log_kernel_chunk(
                        h, run.positions[part], run.old[part], run.deltas[part], self.undo, self.history, written,
                        run.news[part],
                    )  # fmt: skip
                    if self.incremental:
                        moved.append((h.name, (moved_lanes[index][0], moved_lanes[index][1])))
                if failed >= 0:
                    h = items[failed][0]
                    errors.append(CorruptPatchError(f"{record_where(h)}: {batch.kernel_error(status, h)}"))
        finally:
            futures = [future for _, _, future in self.runs]
            wait(futures)  # (an error above: no run may still write when the caller rolls back)
            self.runner.close()
        if pending is not None:
            errors.append(pending)
        if errors:
            raise errors[0]
        return moved


@dataclass
class _Run:
    """One run of records for batch.apply_batch: its rows and the buffers it reads and writes."""

    table: np.ndarray
    payloads: np.ndarray
    positions: np.ndarray
    old: np.ndarray
    deltas: np.ndarray
    news: np.ndarray
    lanes: np.ndarray
    kept: list[ChunkHistory]

    def arguments(self) -> tuple[np.ndarray, ...]:
        """batch.apply_batch's arguments."""
        return self.payloads, self.table, self.positions, self.old, self.deltas, self.news, self.lanes


def _reference_of(h: RecordHeader, references: dict[ChunkKey, ChunkHistory]) -> ChunkHistory:
    """The reference chunk a HISTORY record is coded against, checked to fit it (as parse's decoder checks)."""
    reference = references.get((h.name, h.start, h.length))
    if reference is None or reference.positions.size != h.ref_count:
        held = "none" if reference is None else f"{reference.positions.size} positions"
        raise CorruptPatchError(
            f"{record_where(h)}: coded against {h.ref_count} reference positions, the reference holds {held}"
        )
    if reference.addresses is not None:  # the batch kernel's own output
        return reference
    if reference.deltas.dtype != np.int16 or reference.positions.dtype != np.int64:
        raise CorruptPatchError(
            f"{record_where(h)}: the reference chunk holds {reference.deltas.dtype} deltas for {h.info.name}"
        )
    positions, deltas = np.ascontiguousarray(reference.positions), np.ascontiguousarray(reference.deltas)
    return ChunkHistory(positions, deltas, (positions.ctypes.data, deltas.ctypes.data, 0))


_OUT_BYTES = 14  # a change's outputs in a run's buffer: its position (8 bytes), old value, delta and new value
RANGES_PER_THREAD = 4  # runs a thread: threads take the next run when done, one slow run holds none back
FIRST_RUN_FRACTION = 4  # of a run, the first (a 0.62B step of bench/scale.py: 18.33 -> 18.13 ms on two threads)
