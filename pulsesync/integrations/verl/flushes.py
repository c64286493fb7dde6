"""A weight update in the shapes verl's server adapters consume (pure: tensors in, tensors out).

`delta_flush` is verl's own wire format for delta updates (`verl.checkpoint_engine.delta_sync.encode`,
decoded by its vLLM and SGLang consumers): each flush is `[("__delta_spec__", JSON bytes),
("__positions__", int32 positions as bytes), ("__values__", values)]` with an `is_last` flag. A
spec lists each parameter's name, dtype, shape and its slices of the two buffers; an `indices`
flush carries changed positions and their values, a `dense` one (no positions) whole tensors; one
update is all of one encoding. One flush holds one dtype (its values are one tensor) and about
`bucket_bytes`; a parameter larger than that travels alone. `checksum` is verl's wire check, computed the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from pulsesync.sinks.vllm.wire.update_file import WeightUpdate

Flush = tuple[list[tuple[str, torch.Tensor]], bool]  # (named tensors, is_last)


def checksum(positions: torch.Tensor, values: torch.Tensor) -> int:
    """verl's wire check of one flush (`delta_sync.encode.checksum`): XOR hashes of both buffers."""
    p = int(torch.hash_tensor(positions).item()) if positions.numel() else 0
    v = int(torch.hash_tensor(values).item()) if values.numel() else 0
    return p ^ (v << 1)


@dataclass
class _Pending:
    """The parameters gathered for one flush: a spec entry and its positions and values each."""

    encoding: str
    dtype: torch.dtype
    params: list[dict[str, object]] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    pos_end: int = 0
    val_end: int = 0

    def add(self, name: str, shape: tuple[int, ...], positions: torch.Tensor | None, values: torch.Tensor) -> None:
        count = values.numel()
        pos_bytes = 4 * count if positions is not None else 0
        self.params.append(
            {
                "name": name,
                "dtype": str(values.dtype).removeprefix("torch."),
                "shape": list(shape),
                "pos_start": self.pos_end,
                "pos_end": self.pos_end + pos_bytes,
                "pos_width": 4,
                "val_start": self.val_end,
                "val_end": self.val_end + count,
            }
        )
        if positions is not None:
            self.positions.append(positions.to(torch.int32))
        self.values.append(values.reshape(-1))
        self.pos_end += pos_bytes
        self.val_end += count
        self.nbytes += pos_bytes + values.nbytes

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        values = torch.cat(self.values) if len(self.values) > 1 else self.values[0].contiguous()
        positions = torch.cat(self.positions).view(torch.uint8) if self.positions else torch.empty(0, dtype=torch.uint8)
        spec = {"encoding": self.encoding, "params": self.params, "checksum": checksum(positions, values)}
        named = [("__delta_spec__", torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8))]
        if self.encoding == "indices":
            named.append(("__positions__", positions))
        return [*named, ("__values__", values)]


def delta_flushes(
    update: WeightUpdate, state: Mapping[str, torch.Tensor], digests: Mapping[str, object], bucket_bytes: int
) -> Iterator[Flush]:
    """The update to `state` as verl `delta_flush` flushes, all of one encoding (verl's vLLM consumer refuses a mix).

    Against a base the engine holds: `indices`, a tensor that changed whole listing every position.
    Without one (`update.base` None: every tensor whole), or when a changed tensor has 2^31 elements
    or more (past verl's int32 positions): `dense`, every tensor of the state, as verl's own first
    sync (vLLM reloads a dense update layer by layer). Tensors of equal `digests` (tied embeddings:
    `lm_head.weight` and `model.embed_tokens.weight`) travel in one flush: vLLM's loader refuses a
    load that holds a tied alias without the tensor it is tied to. Nothing to send yields nothing:
    verl's adapters then only record the step.
    """
    entries: list[tuple[str, tuple[int, ...], torch.Tensor | None, torch.Tensor]] = []
    if update.base is not None and all(state[n].numel() < 2**31 for n in update.names):
        for name, (changed, values) in update.sparse.items():
            entries.append((name, tuple(state[name].shape), changed, values))
        for name, tensor in update.whole.items():
            entries.append((name, tuple(tensor.shape), torch.arange(tensor.numel(), dtype=torch.int32), tensor))
    else:
        entries = [(name, tuple(t.shape), None, t) for name, t in state.items()]
    groups: dict[object, list[tuple[str, tuple[int, ...], torch.Tensor | None, torch.Tensor]]] = {}
    for entry in entries:  # equal digests are equal dtypes too: a group fits one flush's values
        groups.setdefault(digests.get(entry[0], entry[0]), []).append(entry)
    pending: dict[torch.dtype, _Pending] = {}
    ready: _Pending | None = None
    for group in groups.values():
        dtype = group[0][3].dtype
        size = sum(v.nbytes + (4 * v.numel() if p is not None else 0) for _, _, p, v in group)
        gathering = pending.get(dtype)
        if gathering is not None and gathering.nbytes + size > bucket_bytes:
            if ready is not None:
                yield ready.named_tensors(), False
            ready = pending.pop(dtype)
            gathering = None
        if gathering is None:
            gathering = pending[dtype] = _Pending("indices" if group[0][2] is not None else "dense", dtype)
        for name, shape, positions, values in group:
            gathering.add(name, shape, positions, values)
    for gathering in pending.values():
        if ready is not None:
            yield ready.named_tensors(), False
        ready = gathering
    if ready is not None:
        yield ready.named_tensors(), True


def whole_tensors(update: WeightUpdate, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The update as `named_tensors`: every tensor it touches, whole, from the state it moves to."""
    for name in (*update.sparse, *update.whole):
        yield name, state[name]
