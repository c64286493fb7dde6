"""Which part of each tensor a rank owns (pure): pieces from DTensors or declarations, checked across ranks.

A piece is `runs` runs of `run` consecutive flat C-order elements of a tensor, the k-th starting
at `start + k * stride`. A split of dim d of a tensor viewed as [P, S_d, Q] (P, Q the products of
the dimensions before and after d) is P runs of s_d * Q elements, S_d * Q apart: one run for a
split of dim 0 (FSDP2's `Shard(0)`, column-wise tensor parallelism, uneven shards, declared
rows), P for row-wise tensor parallelism (`Shard(1)`). Whole tensors (pipeline stages, experts,
replicas) are one run. The pieces of a tensor tile it when they share their stride and their
first runs tile `[0, stride)`: `validate` checks that across ranks, `Assembly` in an anchor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from pulsesync.dtypes import DTYPES, State, dtype_info
from pulsesync.errors import ConfigError, IntegrityError

_WIDTHS = {d.name: d.width for d in DTYPES}


@dataclass(frozen=True, order=True)
class Piece:
    """`length` elements of tensor `name` (global `shape`, `dtype`), owned by `rank`: `runs` runs of
    `length // runs` elements at flat `start + k * stride` (one run: `[start, start + length)`)."""

    name: str
    start: int
    length: int
    shape: tuple[int, ...]
    dtype: str
    rank: int = 0
    runs: int = 1
    stride: int = 0  # between run starts; 0 with one run

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)

    @property
    def run(self) -> int:
        """Consecutive elements per run."""
        return self.length // self.runs

    @property
    def period(self) -> int:
        """The span the pieces of a tensor tile with their first runs: the stride, or the whole tensor."""
        return self.stride if self.runs > 1 else self.numel

    def global_positions(self, local: Any) -> Any:
        """Global flat indices of local flat indices (numpy int64 array)."""
        if self.runs == 1:
            return local + self.start
        run = self.run
        return self.start + (local // run) * self.stride + local % run

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the whole tensor, dense."""
        return self.numel * _WIDTHS[self.dtype]


@dataclass(frozen=True)
class Rows:
    """A declaration for a plain tensor: this rank holds rows `[start, stop)` of a tensor of global `shape`."""

    start: int
    stop: int
    shape: tuple[int, ...]


Ownership = Rows | None
"""What a rank declares of a plain tensor it holds: rows of a larger tensor, or None (another rank owns it)."""


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def _dtensor_piece(name: str, t: Any) -> tuple[Piece, torch.Tensor] | None:
    """The piece of a DTensor this rank owns (None: another rank's, or empty), and its local tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    split = set()
    for dim, placement in enumerate(placements):
        if type(placement) is Replicate:
            if coordinate[dim] != 0:  # replicas: the first one publishes
                return None
        elif type(placement) is Shard:
            split.add(placement.dim)
        else:
            raise ConfigError(
                f"tensor {name!r}: placement {placement} is not a split of one dimension; pulsesync publishes Shard "
                "and Replicate placements (redistribute it, or publish it whole from one rank)"
            )
    if len(split) > 1:
        raise ConfigError(
            f"tensor {name!r}: split along dimensions {sorted(split)}; pulsesync publishes splits of one dimension"
        )
    local = t.to_local()
    shape = tuple(t.shape)
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if math.prod(local_shape) == 0:
        return None
    d = split.pop() if split else 0
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1 :])
    start, length = (offset[d] * inner if shape else 0), math.prod(local_shape)
    info = dtype_info(t.dtype).name
    if outer == 1:
        return Piece(name, start, length, shape, info), local
    return Piece(name, start, length, shape, info, runs=outer, stride=shape[d] * inner), local


def local_pieces(
    state: State, rank: int, declared: Mapping[str, Ownership] | None = None
) -> tuple[dict[str, Piece], dict[str, torch.Tensor]]:
    """The pieces this rank owns of `state` and their local tensors (views, never gathered).

    DTensors describe themselves. A plain tensor is whole and this rank's unless `declared` says
    it holds rows of a larger tensor (`Rows`) or that another rank owns it (None).
    """
    declared = declared or {}
    pieces, tensors = {}, {}
    for name, t in state.items():
        if _is_dtensor(t):
            found = _dtensor_piece(name, t)
            if found is None:
                continue
            piece, local = found
        elif name in declared:
            rows = declared[name]
            if rows is None:
                continue
            shape = tuple(rows.shape)
            inner = math.prod(shape[1:])
            if not (shape and 0 <= rows.start < rows.stop <= shape[0]) or t.numel() != (rows.stop - rows.start) * inner:
                raise ConfigError(
                    f"tensor {name!r}: rows {rows.start}..{rows.stop} of shape {list(shape)} do not describe the "
                    f"{list(t.shape)} held"
                )
            piece, local = Piece(name, rows.start * inner, t.numel(), shape, dtype_info(t.dtype).name), t
        else:
            piece, local = Piece(name, 0, t.numel(), tuple(t.shape), dtype_info(t.dtype).name), t
        if not local.is_contiguous():
            local = local.contiguous()
        pieces[name], tensors[name] = replace(piece, rank=rank), local
    return pieces, tensors


def validate(per_rank: list[list[Piece]]) -> dict[str, list[Piece]]:
    """Every tensor's pieces, ordered, each with the rank that publishes it.

    A tensor several ranks hold whole (a replicated plain tensor: data parallel, shared
    embeddings) is published by the lowest of them. ConfigError names the first tensors whose
    pieces disagree, overlap or leave gaps: the same verdict on every rank, which all see the
    same descriptors.
    """
    by_name: dict[str, list[Piece]] = {}
    for pieces in per_rank:
        for piece in pieces:
            by_name.setdefault(piece.name, []).append(piece)
    problems = []
    for name, pieces in sorted(by_name.items()):
        pieces.sort(key=lambda p: (p.start, p.rank))
        if len(pieces) > 1 and all(p.start == 0 and p.length == p.numel for p in pieces):
            del pieces[1:]  # replicas: the lowest rank's is published
        kinds = {(p.shape, p.dtype) for p in pieces}
        if len(kinds) > 1:
            problems.append(f"{name!r}: ranks disagree on shape/dtype {sorted(kinds)}")
            continue
        if problem := tiling_problem([(p.start, p.run, p.period, p.runs) for p in pieces], pieces[0].numel):
            ranks = sorted({p.rank for p in pieces})
            hint = " (declare what a rank holds of a plain tensor: Rows, or None where another rank owns it)"
            problems.append(f"{name!r}: ranks {ranks}: {problem}" + (hint if "overlap" in problem else ""))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ConfigError("sharded layout: " + "; ".join(problems[:5]) + more)
    return by_name


def tiling_problem(runs: list[tuple[int, int, int, int]], numel: int) -> str | None:
    """Why pieces given as (start, run, period, runs) do not tile a tensor of `numel` elements, or None.

    They tile when they share their period, repeat over the whole tensor (period * runs = numel),
    and their first runs `[start, start + run)` tile `[0, period)`.
    """
    shapes = {(period, count) for _, _, period, count in runs}
    if len(shapes) > 1:
        return f"pieces of different strides {sorted(shapes)}"
    period, count = shapes.pop()
    if period * count != numel:
        return f"pieces repeat {count} times every {period} elements, not over {numel}"
    at = 0
    for start, run, _, _ in sorted(runs):
        if start < at:
            return f"pieces overlap at element {start}"
        if start > at:
            return f"elements {at}..{start} are owned by no rank"
        at = start + run
    return None if at == period else f"elements {at}..{period} are owned by no rank"


class Assembly:
    """Whole tensors put together from the pieces of a sharded anchor's files (untrusted until the digest checks).

    Every piece must fit its tensor and tile it exactly once; anything else is an IntegrityError
    naming the tensor, before the state digest is even computed.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.state: dict[str, torch.Tensor] = {}
        self._covered: dict[str, list[tuple[int, int, int, int]]] = {}  # (start, run, period, runs) per piece

    def add(self, tensors: Mapping[str, torch.Tensor], metadata: str) -> None:
        """Place one file's tensors where its metadata (`{name: [start, shape, runs, stride]}`, JSON) says."""
        try:
            places = json.loads(metadata)
            assert isinstance(places, dict) and set(places) == set(tensors)
            parsed = {n: (int(v[0]), tuple(int(d) for d in v[1]), int(v[2]), int(v[3])) for n, v in places.items()}
        except (ValueError, TypeError, IndexError, AssertionError, RecursionError):
            raise IntegrityError(f"{self.where}: a pieces file's metadata does not describe its tensors") from None
        for name, (start, shape, runs, stride) in parsed.items():
            local = tensors[name]
            whole = self.state.get(name)
            if whole is None:
                if any(d < 0 for d in shape) or math.prod(shape) > 1 << 40:
                    raise IntegrityError(f"{self.where}: tensor {name!r} declares shape {list(shape)}")
                whole = self.state[name] = torch.empty(shape, dtype=local.dtype)
            if whole.dtype != local.dtype or tuple(whole.shape) != shape:
                raise IntegrityError(f"{self.where}: the pieces of tensor {name!r} disagree on its shape or dtype")
            run = local.numel() // max(runs, 1)
            end = start + (runs - 1) * stride + run
            shaped = runs >= 1 and run * runs == local.numel() and (runs == 1 or stride >= run)
            if not shaped or not 0 <= start <= end <= whole.numel():
                raise IntegrityError(f"{self.where}: a piece of tensor {name!r} lies outside it")
            whole.view(-1).as_strided((runs, run), (stride, 1), start).copy_(local.reshape(runs, run))
            period = stride if runs > 1 else whole.numel()
            self._covered.setdefault(name, []).append((start, run, period, runs))

    def finish(self) -> dict[str, torch.Tensor]:
        """The whole tensors; IntegrityError unless every element came from exactly one piece."""
        for name, runs in self._covered.items():
            if problem := tiling_problem(runs, self.state[name].numel()):
                raise IntegrityError(f"{self.where}: tensor {name!r}: {problem}")
        return self.state
