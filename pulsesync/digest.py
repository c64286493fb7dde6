"""State digest: a root digest over the sorted (name, dtype, shape, per-tensor digest) of each tensor.

The serialization is canonical (little-endian raw bits in C order, names sorted, compact JSON),
so the same state has the same digest on every machine and device. Authenticity comes from the
manifest's signature; this digest catches divergence (reconstruction errors, corrupted memory or
disk), so a fast hash is used. Algorithms:
- `mixsum-128` (default): per tensor, an additive hash of (flat index, raw bits) terms
  (pulsesync.mixsum), so a patch updates it in O(changed elements): `update_digest`;
- `xxh3-128`, `sha256`: per tensor, a hash of its raw bytes; a changed tensor is hashed again.
The root is xxh3-128 (sha256 for sha256) over the canonical JSON of the per-tensor entries.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np
import torch
import xxhash
from pydantic import BaseModel, ConfigDict

from pulsesync import mixsum
from pulsesync.digest_algorithms import DEFAULT_ALGORITHM, DigestAlgorithm
from pulsesync.dtypes import State, dtype_info, flat_bits
from pulsesync.threads import parallel_map

INCREMENTAL: frozenset[str] = frozenset({"mixsum-128"})  # updatable from the changed elements alone
_DEVICE_CHUNK_BYTES = 256 << 20


class _Hasher(Protocol):
    def update(self, data: Any) -> None: ...  # any buffer: bytes, memoryview, numpy array
    def hexdigest(self) -> str: ...


def _new_hasher(algorithm: DigestAlgorithm) -> _Hasher:
    if algorithm in ("xxh3-128", "mixsum-128"):
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


class TensorDigest(BaseModel):
    """Digest of one tensor's canonical raw bytes, with the dtype and shape it was taken at."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: str
    shape: tuple[int, ...]
    digest: str


class StateDigest(BaseModel):
    """Root digest of a state plus the per-tensor digests it is computed from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: DigestAlgorithm
    root: str
    tensors: dict[str, TensorDigest]

    def mismatches(self, other: StateDigest) -> list[str]:
        """Names whose entry differs between two digests (present in one only, or changed)."""
        names = sorted(set(self.tensors) | set(other.tensors))
        return [n for n in names if self.tensors.get(n) != other.tensors.get(n)]

    def describe_mismatch(self, other: StateDigest, limit: int = 5) -> str:
        """One-line summary of which tensors differ, for error messages."""
        bad = self.mismatches(other)
        if not bad:
            return "per-tensor digests agree"
        more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
        return f"tensors differ: {', '.join(repr(n) for n in bad[:limit])}{more}"


class TensorHasher:
    """One tensor's digest, hashed piece by piece in element order (a scrub paces itself between pieces)."""

    def __init__(self, t: torch.Tensor, algorithm: DigestAlgorithm = DEFAULT_ALGORITHM) -> None:
        self.tensor = t
        self.flat = flat_bits(t)
        self.hashed = 0  # elements hashed so far
        self._lanes = (0, 0)
        self._hasher = None if algorithm in INCREMENTAL else _new_hasher(algorithm)

    def update(self, elements: int) -> int:
        """Hash the next `elements` elements; returns the bytes hashed."""
        piece = self.flat[self.hashed : self.hashed + elements].cpu().numpy()
        if self._hasher is None:
            self._lanes = mixsum.add(self._lanes, mixsum.sum_range(mixsum.unsigned(piece), self.hashed))
        else:
            self._hasher.update(piece.view(np.uint8))
        self.hashed += piece.size
        return piece.nbytes

    def digest(self) -> TensorDigest:
        """The digest of the elements hashed (the whole tensor once `hashed` reaches its size)."""
        value = mixsum.to_hex(self._lanes) if self._hasher is None else self._hasher.hexdigest()
        return TensorDigest(dtype=dtype_info(self.tensor.dtype).name, shape=tuple(self.tensor.shape), digest=value)


def tensor_digest(t: torch.Tensor, algorithm: DigestAlgorithm = DEFAULT_ALGORITHM) -> TensorDigest:
    """Digest of one tensor's canonical raw bits."""
    hasher = TensorHasher(t, algorithm)
    # Device tensors go to the host in pieces, so a 10 GB tensor never needs 10 GB of host RAM.
    piece = hasher.flat.numel() if t.device.type == "cpu" else _DEVICE_CHUNK_BYTES // t.element_size()
    while hasher.hashed < hasher.flat.numel():
        hasher.update(max(piece, 1))
    return hasher.digest()


def lane_change(
    old: torch.Tensor, new: torch.Tensor, start: int, positions: np.ndarray | None = None
) -> tuple[int, int]:
    """How a change of elements moves a tensor's mixsum-128 lanes: `old` and `new` are their bits
    (integer views, any device), at flat index start + positions[k], or start + k for a range."""
    return mixsum.change(mixsum.unsigned(old.cpu().numpy()), mixsum.unsigned(new.cpu().numpy()), start, positions)


def update_digest(
    base: StateDigest,
    state: Mapping[str, torch.Tensor],
    changes: Iterable[tuple[str, tuple[int, int]]],
    whole: Iterable[str],
    expected: StateDigest | None = None,
) -> StateDigest:
    """The digest of `state` from the digest of the state before some changes (an incremental algorithm only).

    `changes` holds (tensor, how its lane sums moved) pairs, any number per tensor (`lane_change`, or the
    apply kernels): O(changed elements) in all. Tensors named in `whole` (added, replaced) are
    hashed whole; tensors gone are dropped. With `expected` (the digest the state must have: a
    signed manifest's), `expected` itself is returned when the updated entries hash to its root:
    no entry objects are made (~280 a fast-path step of a 0.5B model, half of this function's time).
    """
    if base.algorithm not in INCREMENTAL:
        raise ValueError(f"digest algorithm {base.algorithm} cannot be updated incrementally")
    rehash = set(whole) & state.keys()
    tensors = {n: d for n, d in base.tensors.items() if n in state}
    lanes: dict[str, tuple[int, int]] = {}
    for name, moved in changes:
        if name not in state or name in rehash:
            continue
        if name not in tensors:  # no digest to update: hash it whole
            rehash.add(name)
            continue
        lanes[name] = mixsum.add(lanes.get(name) or mixsum.from_hex(tensors[name].digest), moved)
    if expected is not None and not rehash and expected.algorithm == base.algorithm and len(tensors) == len(state):
        updated = {n: mixsum.to_hex(sums) for n, sums in lanes.items()}
        entries = [(n, d.dtype, d.shape, updated.get(n, d.digest)) for n, d in tensors.items()]
        if _root_of(entries, base.algorithm) == expected.root:
            return expected
    for name, sums in lanes.items():  # (validating costs less than pydantic's model_construct)
        kept = tensors[name]
        tensors[name] = TensorDigest(dtype=kept.dtype, shape=kept.shape, digest=mixsum.to_hex(sums))
    for name in rehash:
        tensors[name] = tensor_digest(state[name], base.algorithm)
    tensors = {n: tensors[n] for n in sorted(tensors)}
    return StateDigest(algorithm=base.algorithm, root=root_digest(tensors, base.algorithm), tensors=tensors)


def moved_digest(base: StateDigest, changes: Iterable[tuple[str, tuple[int, int]]]) -> StateDigest:
    """A mixsum-128 digest moved by lane changes of its tensors (no state needed: a sharded commit's
    coordinator composes every rank's part this way, docs/protocol.md)."""
    lanes = {name: mixsum.from_hex(d.digest) for name, d in base.tensors.items()}
    for name, moved in changes:
        if name not in lanes:
            raise ValueError(f"tensor {name!r} is not in the state the changes apply to")
        lanes[name] = mixsum.add(lanes[name], moved)
    tensors = {n: d.model_copy(update={"digest": mixsum.to_hex(lanes[n])}) for n, d in base.tensors.items()}
    return StateDigest(algorithm=base.algorithm, root=root_digest(tensors, base.algorithm), tensors=tensors)


def summed_digest(
    algorithm: DigestAlgorithm,
    kinds: Mapping[str, tuple[str, tuple[int, ...]]],
    sums: Iterable[tuple[str, tuple[int, int]]],
) -> StateDigest:
    """A mixsum-128 state digest from lane sums over pieces of its tensors (`kinds`: name -> dtype, shape):
    the sum over disjoint pieces that cover a tensor is that tensor's digest."""
    lanes: dict[str, tuple[int, int]] = {}
    for name, piece in sums:
        lanes[name] = mixsum.add(lanes.get(name, (0, 0)), piece)
    tensors = {
        n: TensorDigest(dtype=kinds[n][0], shape=kinds[n][1], digest=mixsum.to_hex(lanes.get(n, (0, 0))))
        for n in sorted(kinds)
    }
    return StateDigest(algorithm=algorithm, root=root_digest(tensors, algorithm), tensors=tensors)


def root_digest(tensors: dict[str, TensorDigest], algorithm: DigestAlgorithm) -> str:
    """Root digest over the canonical JSON of the sorted per-tensor entries."""
    return _root_of([(n, d.dtype, d.shape, d.digest) for n, d in tensors.items()], algorithm)


def _root_of(entries: list[tuple[str, str, tuple[int, ...], str]], algorithm: DigestAlgorithm) -> str:
    """Root digest over the canonical JSON of (name, dtype, shape, digest) entries, sorted by name."""
    ordered = [[name, dtype, list(shape), digest] for name, dtype, shape, digest in sorted(entries)]
    canonical = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hasher = _new_hasher(algorithm)
    hasher.update(canonical)
    return hasher.hexdigest()


def state_digest(
    state: State, algorithm: DigestAlgorithm = DEFAULT_ALGORITHM, threads: int | None = None
) -> StateDigest:
    """Digest of a whole state, hashing tensors in parallel."""
    names = sorted(state)
    digests = parallel_map(lambda n: tensor_digest(state[n], algorithm), names, threads)
    tensors = dict(zip(names, digests, strict=True))
    return StateDigest(algorithm=algorithm, root=root_digest(tensors, algorithm), tensors=tensors)
