"""A relaunched sharded job's rank rebuilds the pieces it now owns at the newest committed step, from the store.

Tensor by tensor, never the whole model: the elements of the anchor's pieces that the rank's piece
overlaps are read with ranged GETs (widened to whole chunks of the parts that patched them, whose
codings may read a chunk's old values), then the records of those tensors in the parts of every
patch since the anchor are applied (`codec.apply_records_of`), and the rank's elements are cut
out. Working memory is one tensor. Nothing read here is trusted on its own: the caller proves the
rebuilt pieces of every rank together against the step's signed digest (mixsum-128 lane sums,
as an anchor's commit composes them) before publishing anything against them.

The rank's part history at the step (what the next part is coded against) is rebuilt too when the
layout is the one the parts were made in (the same world size and pieces); after a reshard the
next part is coded without a reference.
"""

from __future__ import annotations

import asyncio
import json
import math
import mmap
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pulsesync.codec import PatchHistory, StepHistory, apply_records_of
from pulsesync.codec.history_file import HISTORY_FILE, read_history
from pulsesync.dtypes import DTYPES
from pulsesync.errors import IntegrityError
from pulsesync.model_dir import PIECES_METADATA, WEIGHT_SUFFIX
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
class RebuiltPieces:
    """A rank's pieces at a step (local tensors shaped as its copies), and its part's history where it holds."""

    state: dict[str, torch.Tensor]
    history: PatchHistory | None


async def rebuild_pieces(
    fetcher: Fetcher,
    anchor: AnchorManifest,
    links: list[PatchManifest],
    pieces: Mapping[str, Piece],
    like: Mapping[str, torch.Tensor],
    rank: int,
    world: int,
) -> RebuiltPieces:
    """This rank's `pieces` at the step `links` end at (the anchor's, without links), each shaped as `like`'s.

    IntegrityError (or another PulseSyncError) when the store's objects do not give them: the caller
    publishes an anchor instead.
    """
    stored = await _stored_pieces(fetcher, anchor)
    widths = {name: (s[0].piece.numel, _TORCH_DTYPES[s[0].piece.dtype].itemsize) for name, s in stored.items()}
    held, carried = StepHistory(), {}  # the anchor's histories; which object carried which
    bound = HISTORY_BYTES_PER_ELEMENT * sum(n for n, _ in widths.values()) + DECODE_MARGIN_BYTES
    for ref in (r for r in anchor.objects if r.key in anchor.histories):
        for sha, history in read_history(await fetcher.fetch(ref), ref.key, bound, widths).patches.items():
            held.patches[sha] = PatchHistory(sha, {k: c for k, c in history.chunks.items() if k[0] in pieces})
            carried[ref.key] = sha
    with tempfile.TemporaryDirectory(prefix="pulsesync-resume-") as spool:
        out = await _rebuild(fetcher, anchor, links, pieces, like, stored, held, _PartSpool(fetcher, Path(spool)))
    # The next part is coded against this rank's part of the step, if the step's parts were cut as it is now.
    same = all(
        any(s.piece.rank == rank and _same_place(s.piece, p) for s in stored.get(name, []))
        for name, p in pieces.items()
    )
    if same and links and len(links[-1].objects) == world:
        out.history = held.get(links[-1].objects[rank].sha256)
    elif same and not links and len(anchor.histories) == world:
        key = next((k for k in anchor.histories if k.endswith(HISTORY_FILE.format(part=rank))), "")
        out.history = held.get(carried.get(key))
    return out


@dataclass
class _PartSpool:
    """The parts a rebuild applies, each fetched (and checked) once into a local file and mapped: every tensor
    reads them again, and a long chain's parts are not held in memory. The maps close as they are collected
    (the decoder's views of a part may outlive its apply by a moment)."""

    fetcher: Fetcher
    folder: Path
    held: dict[str, memoryview] = field(default_factory=dict)

    async def get(self, ref: ObjectRef) -> memoryview:
        if ref.key not in self.held:
            path = self.folder / f"{len(self.held)}.bin"
            path.write_bytes(await self.fetcher.fetch(ref))
            with path.open("rb") as f:
                self.held[ref.key] = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        return self.held[ref.key]


async def _rebuild(
    fetcher: Fetcher,
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
            await _fill(fetcher, scratch, s, mine, chunk)
        view = {name: scratch.view(mine.shape)}
        patching = {s.piece.rank for s in found}
        for link in links:
            for k, ref in enumerate(link.objects):
                if len(link.objects) > 1 and k not in patching:
                    continue
                data, history = await parts.get(ref), held.add(ref.sha256)
                await asyncio.to_thread(
                    apply_records_of, view, data, reference=held, history=history, threads=fetcher.threads
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


async def _fill(fetcher: Fetcher, scratch: torch.Tensor, s: _Stored, mine: Piece, chunk: int) -> None:
    """Put the elements of stored piece `s` that `mine` needs into `scratch` (ranged reads)."""
    width = scratch.element_size()
    p = s.piece
    if p.runs == 1:  # the overlap, widened to the chunks of the part that patches it
        lo, hi = _span(mine)
        first = max(p.start, p.start + (max(lo, p.start) - p.start) // chunk * chunk)
        last = min(p.start + p.length, p.start + math.ceil((min(hi, p.start + p.length) - p.start) / chunk) * chunk)
        if last <= first:
            return
        data = await _read(fetcher, s.ref, s.offset + (first - p.start) * width, (last - first) * width)
        scratch[first:last] = torch.frombuffer(bytearray(data), dtype=scratch.dtype)
        return
    data = await _read(fetcher, s.ref, s.offset, p.length * width)  # a strided piece: all of it
    local = torch.frombuffer(bytearray(data), dtype=scratch.dtype).view(p.runs, p.run)
    scratch.as_strided((p.runs, p.run), (p.stride, 1), p.start).copy_(local)


def _cut(scratch: torch.Tensor, p: Piece) -> torch.Tensor:
    """A piece's elements of a whole flat tensor, in local order."""
    return scratch.as_strided((p.runs, p.run), (max(p.stride, p.run), 1), p.start).reshape(-1)


async def _read(fetcher: Fetcher, ref: ObjectRef, start: int, size: int) -> bytes:
    if start < 0 or size < 0 or start + size > ref.size:
        raise IntegrityError(f"{ref.key}: bytes {start}+{size} are outside its {ref.size} bytes")
    data = await fetcher.store.get_range(ref.key, start, start + size)
    if len(data) != size:
        raise IntegrityError(f"{ref.key}: {len(data)} bytes read of {size} asked")
    fetcher.bytes_downloaded += size
    return data


async def _stored_pieces(fetcher: Fetcher, anchor: AnchorManifest) -> dict[str, list[_Stored]]:
    """Where each tensor's pieces are in the anchor's weight files: their safetensors headers, read by range."""
    stored: dict[str, list[_Stored]] = {}
    for ref in anchor.objects:
        if ref.key in anchor.histories or not ref.key.endswith(WEIGHT_SUFFIX) or ref.size < 8:
            continue
        size = int.from_bytes(await _read(fetcher, ref, 0, 8), "little")
        if not 0 < size <= min(MAX_HEADER_BYTES, ref.size - 8):
            raise IntegrityError(f"{ref.key}: a safetensors header of {size} bytes")
        try:
            header = json.loads(await _read(fetcher, ref, 8, size))
            meta = header.pop("__metadata__", None) or {}
            places = json.loads(meta[PIECES_METADATA]) if PIECES_METADATA in meta else None
            rank = _rank_of(ref.key) if places is not None else 0
            for name, entry in header.items():
                begin, end = (int(x) for x in entry["data_offsets"])
                shape, dtype = tuple(int(x) for x in entry["shape"]), str(entry["dtype"])
                start, whole, runs, stride = places[name] if places is not None else (0, list(shape), 1, 0)
                whole = tuple(int(x) for x in whole)
                piece = Piece(name, int(start), math.prod(shape), whole, dtype, rank, int(runs), int(stride))
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
