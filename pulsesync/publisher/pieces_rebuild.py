"""A relaunched sharded job's rank rebuilds the pieces it now owns at the newest committed step, from the store.

Tensor by tensor, never the whole model: the elements of the anchor's pieces that the rank's piece
overlaps are read with ranged GETs (widened to whole chunks of the parts that patched them, whose
codings may read a chunk's old values), then the records of those tensors in the parts of every
patch since the anchor are applied (`codec.apply_records_of`), and the rank's elements are cut
out. Working memory is one tensor. Nothing read here is trusted on its own: the caller proves the
rebuilt pieces of every rank together against the step's signed digest (mixsum-128 lane sums,
as an anchor's commit composes them) before publishing anything against them.

The rank's part history at the step (what the next part is coded against) is rebuilt too: when the
layout is the one the parts were made in (the same world size and pieces), its own part's; after a
reshard, the histories of the parts its pieces overlap, joined by position and cut into its
contiguous pieces' chunks (`StepHistory.joined`; a strided piece's chunks hold other ranks'
elements, whose parts it did not read: coded without a reference).

Only what the rank's pieces need is read: its own pieces file's header first (on the same layout
no other file's), the histories and parts of the ranks whose pieces overlap its own, each object
from the rank's cache (`pieces_cache.py`) where it holds a copy, else from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import mmap
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pulsesync.codec import PatchHistory, StepHistory, apply_records_of
from pulsesync.codec.encoder import contiguous_chunks
from pulsesync.codec.history_file import HISTORY_FILE, read_history
from pulsesync.dtypes import DTYPES
from pulsesync.errors import IntegrityError, PulseSyncError
from pulsesync.model_dir import PIECES_FILE, PIECES_METADATA, WEIGHT_SUFFIX
from pulsesync.protocol.fetcher import Fetcher
from pulsesync.protocol.manifest import AnchorManifest, ObjectRef, PatchManifest
from pulsesync.rebuild import DECODE_MARGIN_BYTES, HISTORY_BYTES_PER_ELEMENT
from pulsesync.sharding.layout import Piece

MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header
_TORCH_DTYPES = {d.name: d.torch_dtype for d in DTYPES}


@dataclass(frozen=True)
class _Stored:
    """One tensor's piece in one of the anchor's files: where its bytes are, where its elements sit."""

    ref: ObjectRef
    offset: int  # of its first byte in the object
    piece: Piece  # rank: the index of the part that patches it (the file's rank; 0 for a whole shard)


@dataclass
class PieceReader:
    """Where a rebuild reads objects: the rank's cache first (when it has one), the store for the rest.

    A cached object that is missing or not the manifest's (size, SHA-256) is read from the store;
    ranged reads of a cached file are proven with the rebuilt pieces, as the store's are.
    """

    store: Fetcher
    cache: Fetcher | None = None
    _cached: dict[str, bool] = field(default_factory=dict)  # key -> the cache holds an object of its size

    @property
    def threads(self) -> int | None:
        return self.store.threads

    async def fetch(self, ref: ObjectRef) -> bytes:
        if self.cache is not None and await self._holds(ref):
            with contextlib.suppress(PulseSyncError):
                return await self.cache.fetch(ref)
        return await self.store.fetch(ref)

    async def read(self, ref: ObjectRef, start: int, size: int) -> bytes:
        """Bytes [start, start + size) of an object, inside the size its manifest lists."""
        if start < 0 or size < 0 or start + size > ref.size:
            raise IntegrityError(f"{ref.key}: bytes {start}+{size} are outside its {ref.size} bytes")
        source = self.cache if self.cache is not None and await self._holds(ref) else self.store
        data = await source.store.get_range(ref.key, start, start + size)
        if len(data) != size:
            raise IntegrityError(f"{ref.key}: {len(data)} bytes read of {size} asked")
        source.bytes_downloaded += size
        return data

    async def _holds(self, ref: ObjectRef) -> bool:
        if ref.key not in self._cached:
            assert self.cache is not None
            try:
                self._cached[ref.key] = (await self.cache.store.head(ref.key)).size == ref.size
            except PulseSyncError:
                self._cached[ref.key] = False
        return self._cached[ref.key]


@dataclass
class RebuiltPieces:
    """A rank's pieces at a step (local tensors shaped as its copies), and its part's history where it holds."""

    state: dict[str, torch.Tensor]
    history: PatchHistory | None


async def rebuild_pieces(
    reader: PieceReader,
    anchor: AnchorManifest,
    links: list[PatchManifest],
    pieces: Mapping[str, Piece],
    like: Mapping[str, torch.Tensor],
    rank: int,
    world: int,
    chunk_elements: int,
) -> RebuiltPieces:
    """This rank's `pieces` at the step `links` end at (the anchor's, without links), each shaped as `like`'s,
    and its next part's reference (its next part is cut in chunks of `chunk_elements`).

    IntegrityError (or another PulseSyncError) when the objects read do not give them: the caller
    publishes an anchor instead.
    """
    stored = await _stored_pieces(reader, anchor, pieces, rank, world)
    widths = {name: (s[0].piece.numel, _TORCH_DTYPES[s[0].piece.dtype].itemsize) for name, s in stored.items()}
    patching = {s.piece.rank for name, p in pieces.items() for s in stored.get(name, []) if _overlap(s.piece, p)}
    held, carried = StepHistory(), {}  # the anchor's histories of the overlapping parts; which object carried which
    bound = HISTORY_BYTES_PER_ELEMENT * sum(n for n, _ in widths.values()) + DECODE_MARGIN_BYTES
    for part, ref in _histories(anchor).items():
        if part not in patching:
            continue
        for sha, history in read_history(await reader.fetch(ref), ref.key, bound, widths).patches.items():
            held.patches[sha] = PatchHistory(sha, {k: c for k, c in history.chunks.items() if k[0] in pieces})
            carried[part] = sha
    with tempfile.TemporaryDirectory(prefix="pulsesync-resume-") as spool:
        spooled = _PartSpool(reader, Path(spool))
        out = await _rebuild(reader, anchor, links, pieces, like, stored, held, spooled)
    # The next part is coded against this rank's part of the step, if the step's parts were cut as it is now.
    same = all(
        any(s.piece.rank == rank and _same_place(s.piece, p) for s in stored.get(name, []))
        for name, p in pieces.items()
    )
    if same and links and len(links[-1].objects) == world:
        out.history = held.get(links[-1].objects[rank].sha256)
    elif same and not links and len(anchor.histories) == world:
        out.history = held.get(carried.get(rank))
    elif not same:  # another layout: the overlapping parts' histories, joined, in this rank's chunks
        if links:
            objects = links[-1].objects
            read = [objects[k].sha256 for k in sorted(patching)] if len(objects) > 1 else [objects[0].sha256]
        else:
            read = [carried[k] for k in sorted(carried)]
        out.history = held.joined(read, contiguous_chunks(pieces, chunk_elements)) if read else None
    return out


def _histories(anchor: AnchorManifest) -> dict[int, ObjectRef]:
    """The anchor's part histories by part (`patch-history-{part:05d}…`)."""
    keys = set(anchor.histories)
    parts = {HISTORY_FILE.format(part=k): k for k in range(len(keys))}
    named = ((ref, ref.key.rsplit("/", 1)[-1]) for ref in anchor.objects if ref.key in keys)
    return {parts[name]: ref for ref, name in named if name in parts}


@dataclass
class _PartSpool:
    """The parts a rebuild applies, each fetched (and checked) once into a local file and mapped: every tensor
    reads them again, and a long chain's parts are not held in memory. The maps close as they are collected
    (the decoder's views of a part may outlive its apply by a moment)."""

    reader: PieceReader
    folder: Path
    held: dict[str, memoryview] = field(default_factory=dict)

    async def get(self, ref: ObjectRef) -> memoryview:
        if ref.key not in self.held:
            path = self.folder / f"{len(self.held)}.bin"
            path.write_bytes(await self.reader.fetch(ref))
            with path.open("rb") as f:
                self.held[ref.key] = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        return self.held[ref.key]


async def _rebuild(
    reader: PieceReader,
    anchor: AnchorManifest,
    links: list[PatchManifest],
    pieces: Mapping[str, Piece],
    like: Mapping[str, torch.Tensor],
    stored: Mapping[str, list[_Stored]],
    held: StepHistory,
    parts: _PartSpool,
) -> RebuiltPieces:
    """Each of `pieces`, one tensor at a time: the anchor's overlapping elements, then every patch's records."""
    out = RebuiltPieces({}, None)
    for name in sorted(pieces):
        mine = pieces[name]
        found = [s for s in stored.get(name, []) if _overlap(s.piece, mine)]
        if not found or any(s.piece.shape != mine.shape or s.piece.dtype != mine.dtype for s in found):
            raise IntegrityError(f"anchor {anchor.step}: tensor {name!r} is not held as this rank now holds it")
        dtype = like[name].dtype
        scratch = torch.zeros(mine.numel, dtype=dtype)
        chunk = max((link.codec.chunk_elements for link in links), default=1)
        for s in found:
            await _fill(reader, scratch, s, mine, chunk)
        view = {name: scratch.view(mine.shape)}
        patching = {s.piece.rank for s in found}
        for link in links:
            for k, ref in enumerate(link.objects):
                if len(link.objects) > 1 and k not in patching:
                    continue
                data, history = await parts.get(ref), held.add(ref.sha256)
                await asyncio.to_thread(
                    apply_records_of, view, data, reference=held, history=history, threads=reader.threads
                )
        out.state[name] = _cut(scratch, mine).view(like[name].shape).clone()
        del scratch, view
    return out


def _same_place(a: Piece, b: Piece) -> bool:
    return (a.start, a.length, a.runs, a.stride) == (b.start, b.length, b.runs, b.stride)


def _span(p: Piece) -> tuple[int, int]:
    """The flat interval a piece's elements lie in."""
    return p.start, p.start + (p.runs - 1) * p.stride + p.run


def _overlap(a: Piece, b: Piece) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


async def _fill(reader: PieceReader, scratch: torch.Tensor, s: _Stored, mine: Piece, chunk: int) -> None:
    """Put the elements of stored piece `s` that `mine` needs into `scratch` (ranged reads)."""
    width = scratch.element_size()
    p = s.piece
    if p.runs == 1:  # the overlap, widened to the chunks of the part that patches it
        lo, hi = _span(mine)
        first = max(p.start, p.start + (max(lo, p.start) - p.start) // chunk * chunk)
        last = min(p.start + p.length, p.start + math.ceil((min(hi, p.start + p.length) - p.start) / chunk) * chunk)
        if last <= first:
            return
        data = await reader.read(s.ref, s.offset + (first - p.start) * width, (last - first) * width)
        scratch[first:last] = torch.frombuffer(bytearray(data), dtype=scratch.dtype)
        return
    data = await reader.read(s.ref, s.offset, p.length * width)  # a strided piece: all of it
    local = torch.frombuffer(bytearray(data), dtype=scratch.dtype).view(p.runs, p.run)
    scratch.as_strided((p.runs, p.run), (p.stride, 1), p.start).copy_(local)


def _cut(scratch: torch.Tensor, p: Piece) -> torch.Tensor:
    """A piece's elements of a whole flat tensor, in local order."""
    return scratch.as_strided((p.runs, p.run), (max(p.stride, p.run), 1), p.start).reshape(-1)


async def _stored_pieces(
    reader: PieceReader, anchor: AnchorManifest, pieces: Mapping[str, Piece], rank: int, world: int
) -> dict[str, list[_Stored]]:
    """Where each tensor's pieces are in the anchor's weight files: their safetensors headers, read by range.

    The rank's own pieces file first: when it holds every one of `pieces` where the rank now holds
    it (a relaunch on the same layout), no other file is read.
    """
    stored: dict[str, list[_Stored]] = {}
    own = PIECES_FILE.format(rank=rank, world=world)
    files = [r for r in anchor.objects if r.key not in anchor.histories and r.key.endswith(WEIGHT_SUFFIX)]
    for ref in sorted(files, key=lambda r: not r.key.endswith("/" + own)):
        if all(any(_same_place(s.piece, p) for s in stored.get(n, [])) for n, p in pieces.items()):
            break
        if ref.size < 8:
            continue
        size = int.from_bytes(await reader.read(ref, 0, 8), "little")
        if not 0 < size <= min(MAX_HEADER_BYTES, ref.size - 8):
            raise IntegrityError(f"{ref.key}: a safetensors header of {size} bytes")
        try:
            header = json.loads(await reader.read(ref, 8, size))
            meta = header.pop("__metadata__", None) or {}
            places = json.loads(meta[PIECES_METADATA]) if PIECES_METADATA in meta else None
            part = _rank_of(ref.key) if places is not None else 0
            for name, entry in header.items():
                begin, end = (int(x) for x in entry["data_offsets"])
                shape, dtype = tuple(int(x) for x in entry["shape"]), str(entry["dtype"])
                start, whole, runs, stride = places[name] if places is not None else (0, list(shape), 1, 0)
                whole = tuple(int(x) for x in whole)
                piece = Piece(name, int(start), math.prod(shape), whole, dtype, part, int(runs), int(stride))
                _check_place(piece)
                width = _TORCH_DTYPES[dtype].itemsize
                if end - begin != piece.length * width or 8 + size + end > ref.size or begin < 0:
                    raise ValueError(f"tensor {name!r}: its bytes do not fit the file")
                stored.setdefault(name, []).append(_Stored(ref, 8 + size + begin, piece))
        except (ValueError, KeyError, TypeError) as e:
            raise IntegrityError(f"{ref.key}: its safetensors header is not one ({type(e).__name__}: {e})") from None
    return stored


def _check_place(p: Piece) -> None:
    """ValueError unless a stored piece's runs lie inside its tensor (what `_fill` reads and writes)."""
    if p.runs < 1 or p.length % p.runs or p.start < 0 or min(p.shape, default=1) < 0:
        raise ValueError(f"tensor {p.name!r}: {p.runs} runs of {p.length} elements at {p.start}")
    if (p.runs > 1 and p.stride < p.run) or _span(p)[1] > p.numel:
        raise ValueError(f"tensor {p.name!r}: its runs do not fit its {p.numel} elements")


def _rank_of(key: str) -> int:
    """The rank of a pieces file (`pieces-{rank:05d}-of-{world:05d}.safetensors`)."""
    return int(key.rsplit("/", 1)[-1].split("-")[1])
