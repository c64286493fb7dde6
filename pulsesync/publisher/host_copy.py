"""Host copies of a state: the only work publish() does on the trainer's thread.

States are copied into recycled host buffers: fresh memory costs a page fault per 4 KiB (and
pinned memory a cudaHostAlloc), several times more than the copy itself. The pipeline releases a
copy when nothing holds it any more (superseded baseline, skipped or failed step, finished
background anchor), and its buffers take the next copy. CUDA tensors are copied into pinned
buffers with non-blocking copies and one synchronize per device, so publish() returns only once
every byte is on the host (the trainer may overwrite its weights right after).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pulsesync.dtypes import State
from pulsesync.sharding.layout import Piece

Buffers = dict[str, torch.Tensor]
FileSource = Mapping[str, Path | str | bytes]
"""Files an anchor carries besides the weights: name -> path or content."""


def read_files(files: FileSource | None) -> dict[str, bytes]:
    """File contents keyed by name (read now: the source may be gone when an anchor is written)."""
    out = {}
    for name, source in (files or {}).items():
        out[name] = source if isinstance(source, bytes) else Path(source).read_bytes()
    return out


def _signature(items: list[tuple[str, torch.Size, torch.dtype]], pinned: bool) -> Hashable:
    return (tuple(items), pinned)


class HostCopyPool:
    """Copies states into host buffers and recycles the buffers of released copies."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep  # free buffer sets kept for reuse; more are returned to the allocator
        self._free: dict[Hashable, list[Buffers]] = {}
        self._refs: dict[int, int] = {}
        self._lock = threading.Lock()

    def copy(self, state: State) -> Buffers:
        """A contiguous host copy of every tensor, complete when this returns."""
        items = [(n, t.shape, t.dtype) for n, t in state.items()]
        pinned = any(t.device.type == "cuda" for t in state.values())
        key = _signature(items, pinned)
        with self._lock:
            free = self._free.get(key)
            out = free.pop() if free else None
        if out is None:
            out = {n: torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned) for n, shape, dtype in items}
        devices = set()
        for name, t in state.items():
            t = t.detach()
            cuda = t.device.type == "cuda"
            out[name].copy_(t, non_blocking=cuda)
            if cuda:
                devices.add(t.device)
        for device in devices:
            torch.cuda.synchronize(device)
        with self._lock:
            self._refs[id(out)] = 1
        return out

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        with self._lock:
            return sum(t.numel() * t.element_size() for sets in self._free.values() for b in sets for t in b.values())

    def retain(self, buffers: Buffers) -> None:
        """One more holder of a copy."""
        with self._lock:
            if id(buffers) in self._refs:
                self._refs[id(buffers)] += 1

    def release(self, buffers: Buffers) -> None:
        """One holder fewer; the last one returns the buffers for reuse."""
        with self._lock:
            refs = self._refs.get(id(buffers))
            if refs is None:  # not from this pool (e.g. a state rebuilt at resume)
                return
            if refs > 1:
                self._refs[id(buffers)] = refs - 1
                return
            del self._refs[id(buffers)]
            items = [(n, t.shape, t.dtype) for n, t in buffers.items()]
            pinned = any(t.is_pinned() for t in buffers.values())
            key = _signature(items, pinned)
            # Sets of another signature (the tensors before a layout change) would never be copied into again.
            self._free = {key: self._free.get(key, [])}
            free = self._free[key]
            if len(free) < self._keep:
                free.append(buffers)


@dataclass
class HostCopy:
    """A step's state (on a rank of a sharded job, its pieces) copied to host memory, queued for the rounds."""

    step: int
    state: Buffers
    seconds: float  # the copy's duration: the step report's snapshot_s
    files: dict[str, bytes] = field(default_factory=dict)
    pieces: dict[str, Piece] | None = None  # on a rank of a sharded job: what it owns of each tensor
