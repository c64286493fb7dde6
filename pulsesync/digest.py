"""State digest: a root digest over the sorted (name, dtype, shape, raw-bytes digest) of each tensor.

The serialization is canonical (little-endian raw bytes in C order, names sorted, compact JSON),
so the same state has the same digest on every machine and device. Authenticity comes from the
manifest's signature; this digest catches reconstruction errors, so a fast hash is the default.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Protocol

import torch
import xxhash
from pydantic import BaseModel, ConfigDict

from pulsesync.dtypes import State, dtype_info, flat_bytes
from pulsesync.threads import parallel_map

DigestAlgorithm = Literal["xxh3-128", "sha256"]
DEFAULT_ALGORITHM: DigestAlgorithm = "xxh3-128"
# Device tensors are hashed in host-sized pieces so a 10 GB tensor never needs 10 GB of host RAM.
_DEVICE_CHUNK_BYTES = 256 << 20


class _Hasher(Protocol):
    def update(self, data: Any) -> None: ...  # any buffer: bytes, memoryview, numpy array
    def hexdigest(self) -> str: ...


def _new_hasher(algorithm: DigestAlgorithm) -> _Hasher:
    if algorithm == "xxh3-128":
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


def tensor_digest(t: torch.Tensor, algorithm: DigestAlgorithm = DEFAULT_ALGORITHM) -> TensorDigest:
    """Digest of one tensor's canonical raw bytes."""
    hasher = _new_hasher(algorithm)
    raw = flat_bytes(t)
    if raw.device.type == "cpu":
        hasher.update(raw.numpy())
    else:
        for start in range(0, raw.numel(), _DEVICE_CHUNK_BYTES):
            hasher.update(raw[start : start + _DEVICE_CHUNK_BYTES].cpu().numpy())
    return TensorDigest(dtype=dtype_info(t.dtype).name, shape=tuple(t.shape), digest=hasher.hexdigest())


def root_digest(tensors: dict[str, TensorDigest], algorithm: DigestAlgorithm) -> str:
    """Root digest over the canonical JSON of the sorted per-tensor entries."""
    entries = [[n, tensors[n].dtype, list(tensors[n].shape), tensors[n].digest] for n in sorted(tensors)]
    canonical = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
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
