"""The update file a sidecar hands an engine: which state it makes, what it applies to, the tensors (pure).

One safetensors file in checkpoint coordinates (the names and shapes of the published state):
a whole tensor under its name, or a sparse one as `NAME::pulsesync_index` (flat positions, int32
where they fit, else int64) and `NAME::pulsesync_values` (the new values, the state's dtype).
Its metadata says the step and state digest the engine holds once it is applied, and `base`: the
state digest the engine must hold for it to apply ("" for a full update, which applies to any
state and names every tensor). Parsing checks the structure only; an engine checks its own names.

A tensor-parallel engine rank holds a `Region` of some tensors (rows or columns of the checkpoint
tensor); `for_rank` cuts a delta down to one rank's regions, in the rank's own coordinates, so
each worker receives about its share of a patch (`pulsesync.rank` in the metadata says whose).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass, field
from typing import Any

import torch

from pulsesync.digest import StateDigest
from pulsesync.errors import EngineError

INDEX_SUFFIX = "::pulsesync_index"
VALUE_SUFFIX = "::pulsesync_values"
META_STEP = "pulsesync.step"
META_DIGEST = "pulsesync.digest"
META_BASE = "pulsesync.base"
META_RANK = "pulsesync.rank"


@dataclass(frozen=True)
class Region:
    """What one engine rank holds of a checkpoint tensor of `shape`: `[start, start + size)` along `dim` (0 or 1)."""

    shape: tuple[int, ...]
    dim: int
    start: int
    size: int

    @classmethod
    def from_reply(cls, spec: object) -> Region:
        """From a worker's `[shape, dim, start, size]`; ValueError unless it describes a region of that shape."""
        try:
            fields: list[Any] = list(spec)  # type: ignore[call-overload]
            shape, dim, start, size = fields
            region = cls(tuple(int(n) for n in shape), int(dim), int(start), int(size))
        except (TypeError, ValueError):
            raise ValueError(f"not a region: {str(spec)[:200]!r}") from None
        if region.dim not in (0, 1) or region.dim >= len(region.shape):
            raise ValueError(f"region {spec!r}: no dimension {region.dim}")
        if not 0 <= region.start < region.start + region.size <= region.shape[region.dim]:
            raise ValueError(f"region {spec!r}: outside its dimension")
        return region

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the rank's part."""
        return tuple(self.size if d == self.dim else n for d, n in enumerate(self.shape))

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of the whole tensor: a contiguous copy (not a view that keeps the whole alive)."""
        return tensor.narrow(self.dim, self.start, self.size).clone(memory_format=torch.contiguous_format)

    def localize(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of the flat `positions` of the whole tensor lie in the region, their flat positions in it)."""
        inner = math.prod(self.shape[self.dim + 1 :])
        if self.dim == 0:
            low = self.start * inner
            inside = (positions >= low) & (positions < low + self.size * inner)
            return inside, positions[inside] - low
        columns = self.shape[1] * inner
        row, column = positions // columns, positions % columns - self.start * inner
        inside = (column >= 0) & (column < self.size * inner)
        return inside, row[inside] * (self.size * inner) + column[inside]


@dataclass
class WeightUpdate:
    """Tensors that move an engine from the state `base` (None: any) to `digest` at `step`."""

    step: int
    digest: str
    base: str | None
    whole: dict[str, torch.Tensor] = field(default_factory=dict)
    sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # positions, values
    rank: int | None = None  # the engine rank it was cut for (None: every rank)

    @property
    def names(self) -> set[str]:
        """Every tensor the update touches."""
        return set(self.whole) | set(self.sparse)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        sizes = [t.nbytes for t in self.whole.values()] + [i.nbytes + v.nbytes for i, v in self.sparse.values()]
        return sum(sizes)

    def to_file(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Tensors and metadata for safetensors' save_file."""
        tensors = dict(self.whole)
        for name, (positions, values) in self.sparse.items():
            tensors[name + INDEX_SUFFIX], tensors[name + VALUE_SUFFIX] = positions, values
        meta = {META_STEP: str(self.step), META_DIGEST: self.digest, META_BASE: self.base or ""}
        if self.rank is not None:
            meta[META_RANK] = str(self.rank)
        return tensors, meta

    def without(self, names: Collection[str]) -> WeightUpdate:
        """The update less these tensors (those another engine rank holds, under expert parallelism)."""
        part = WeightUpdate(self.step, self.digest, self.base, rank=self.rank)
        part.whole = {n: t for n, t in self.whole.items() if n not in names}
        part.sparse = {n: s for n, s in self.sparse.items() if n not in names}
        return part

    def for_rank(
        self, rank: int, regions: Mapping[str, Region], elsewhere: Collection[str] = frozenset()
    ) -> WeightUpdate:
        """This delta as one engine rank receives it: its tensors (not those `elsewhere`), each cut to its region."""
        if self.base is None:
            raise ValueError("a full update goes whole to every rank: vLLM's loader shards it")
        part = WeightUpdate(self.step, self.digest, self.base, rank=rank)
        for name, tensor in self.whole.items():
            if name in elsewhere:
                continue
            region = regions.get(name)
            part.whole[name] = tensor if region is None else region.take(tensor)
        for name, (positions, values) in self.sparse.items():
            if name in elsewhere:
                continue
            region = regions.get(name)
            if region is None:
                part.sparse[name] = (positions, values)
                continue
            inside, local = region.localize(positions.to(torch.int64))
            if len(local):
                part.sparse[name] = (local.to(positions.dtype), values[inside])
        return part

    @classmethod
    def from_file(
        cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str] | None, source: str
    ) -> WeightUpdate:
        """Parse save_file's parts back; EngineError naming `source` if they are not a well-formed update."""
        meta = meta or {}
        try:
            step, digest, base = int(meta[META_STEP]), meta[META_DIGEST], meta[META_BASE]
            rank = int(meta[META_RANK]) if META_RANK in meta else None
        except (KeyError, ValueError):
            raise EngineError(f"{source}: not a pulsesync update file (metadata {dict(meta)!r})") from None
        update = cls(step, digest, base or None, rank=rank)
        for key, t in tensors.items():
            if key.endswith(VALUE_SUFFIX):
                continue
            if not key.endswith(INDEX_SUFFIX):
                update.whole[key] = t
                continue
            name = key.removesuffix(INDEX_SUFFIX)
            values = tensors.get(name + VALUE_SUFFIX)
            if values is None or t.dim() != 1 or values.shape != t.shape or t.dtype not in (torch.int32, torch.int64):
                raise EngineError(f"{source}: sparse entry {name!r} has no matching 1-D positions and values")
            update.sparse[name] = (t, values)
        orphans = {k.removesuffix(VALUE_SUFFIX) for k in tensors if k.endswith(VALUE_SUFFIX)} - set(update.sparse)
        if orphans:
            raise EngineError(f"{source}: values without positions for {sorted(orphans)[0]!r}")
        if base is None and update.sparse:
            raise EngineError(f"{source}: a full update cannot hold sparse entries")
        return update


def part_of(
    state: Mapping[str, torch.Tensor], regions: Mapping[str, Region], aliases: Mapping[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """What one rank holds of a whole state: tensors with a region cut to it (a tied name as what it is tied to)."""
    tied = aliases or {}
    regions = dict(regions) | {alias: regions[name] for alias, name in tied.items() if name in regions}
    return {n: regions[n].take(t) if n in regions else t for n, t in state.items()}


def build_update(
    step: int,
    state: Mapping[str, torch.Tensor],
    digest: StateDigest,
    base: StateDigest | None,
    changes: Mapping[str, torch.Tensor | None] | None,
    skip: Set[str] = frozenset(),
) -> WeightUpdate:
    """The update from `base` (None: a full update) to `state`, leaving out `skip` (aliases the engine ties).

    Against a base it holds the tensors whose digest changed: sparse where `changes` knows the
    changed positions (they must be relative to `base`), whole otherwise.
    """
    update = WeightUpdate(step, digest.root, base.root if base is not None else None)
    for name, new in state.items():
        if name in skip:
            continue
        if base is not None:
            before = base.tensors.get(name)
            if before is not None and before == digest.tensors.get(name):
                continue
            positions = changes.get(name) if changes is not None and before is not None else None
            if positions is not None:
                narrow = torch.int32 if new.numel() < 2**31 else torch.int64
                update.sparse[name] = (positions.to(narrow), new.reshape(-1)[positions].contiguous())
                continue
        update.whole[name] = new.contiguous()
    return update
