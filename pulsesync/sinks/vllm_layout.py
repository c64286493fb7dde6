"""Where each checkpoint tensor lives in one vLLM worker (no I/O): fused blocks, tied aliases, tensor-parallel regions.

vLLM fuses q/k/v and gate/up into one parameter (`packed_modules_mapping`, row blocks), ties
lm_head to the embeddings, and under tensor parallelism gives each worker a region of most
weights. The regions follow vLLM 0.32's loaders (model_executor/layers/linear.py and
vocab_parallel_embedding.py), read from the layer's own attributes:

- ColumnParallelLinear: rows `[rank * n, (rank + 1) * n)` of the checkpoint tensor, n its local rows;
- MergedColumnParallelLinear (gate/up): block i has `output_sizes[i] / tp` rows from `rank * n_i`,
  placed at row `sum(output_sizes[:i]) / tp` of the fused parameter;
- QKVParallelLinear: q as column-parallel; k and v by KV head, the rank's head being
  `rank // num_kv_head_replicas` (KV heads are replicated when there are fewer than ranks);
- RowParallelLinear: columns `[rank * n, (rank + 1) * n)`; its bias is replicated;
- VocabParallelEmbedding and ParallelLMHead: vocab rows `[org_vocab_start_index,
  org_vocab_end_index)` at row 0; the padding rows after them hold zeros;
- any parameter without `output_dim`/`input_dim`: replicated, whole.

A parameter sharded any other way (quantized packing, pre-sharded checkpoints, checkpoints that
already fuse q/k/v, layer kinds not listed) makes its module unknown; the worker then refuses
every update, naming it. The shapes come from the model format (the parameters as created,
before post-load processing such as CPU oneDNN packing empties them), given by `ModelParams`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pulsesync.sinks.weight_update import Region

_PLAIN_QUANT_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
_FUSED_KINDS = {"MergedColumnParallelLinear", "QKVParallelLinear"}

ModelParams = Callable[[str, torch.nn.Module], dict[str, torch.Tensor]]
"""A module's parameters in model format (maybe on the meta device, with vLLM's attributes), by name."""


class UnknownLayout(Exception):
    """A parameter this layout cannot place (its module is refused)."""


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives: rows `[row_offset, +local rows)` of a parameter hold its `region`."""

    module: str
    param: str
    row_offset: int
    shape: tuple[int, ...]  # the checkpoint tensor's, whole
    region: Region | None = None  # the part this rank holds; None: all of it

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of what this rank holds."""
        return self.shape if self.region is None else self.region.local_shape

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole checkpoint tensor."""
        return tensor if self.region is None else self.region.take(tensor)


@dataclass
class EngineLayout:
    """The checkpoint names a worker holds, where, which modules take in-place writes, and its aliases."""

    slots: dict[str, Slot]
    aliases: dict[str, str]  # checkpoint name -> the name it is tied to
    alias_modules: dict[str, str] = field(default_factory=dict)  # checkpoint name -> module of its alias
    in_place: set[str] = field(default_factory=set)  # module names
    params: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = field(default_factory=dict)  # model format
    unknown: dict[str, str] = field(default_factory=dict)  # module -> why its layout is not known
    modules: dict[str, list[str]] = field(default_factory=dict)  # module -> its checkpoint names

    def describe(self) -> dict[str, Any]:
        """What the sidecar needs: names, aliases, how each module is written, each name's region."""
        regions = {
            n: [list(s.region.shape), s.region.dim, s.region.start, s.region.size]
            for n, s in self.slots.items()
            if s.region is not None
        }
        return {
            "names": sorted(self.slots),
            "aliases": self.aliases,
            "in_place": sorted(n for n, s in self.slots.items() if s.module in self.in_place),
            "regions": regions,
        }


def live_params(name: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Model format read from the module itself (engines without vLLM's reload metadata).

    A linear layer whose weight was packed away has its shape from `input_size`/`output_size`.
    """
    out: dict[str, torch.Tensor] = {}
    in_size, out_size = getattr(module, "input_size", None), getattr(module, "output_size", None)
    for pname, param in module.named_parameters(recurse=False):
        if param.numel() == 0 and pname == "weight" and isinstance(in_size, int) and isinstance(out_size, int):
            out[pname] = torch.empty((out_size, in_size), dtype=param.dtype, device="meta")
        else:
            out[pname] = param
    return out


def _plain(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """Parameters the forward pass reads as they are: in-place writes reach the computation."""
    quant = getattr(module, "quant_method", None)
    return (
        type(param.data) is torch.Tensor
        and param.numel() > 0
        and param.is_contiguous()
        and not hasattr(module, "cpu_linear")  # CPU: computes from a packed copy
        and (quant is None or type(quant).__name__ in _PLAIN_QUANT_METHODS)
    )


def _region(shape: tuple[int, ...], dim: int, start: int, size: int) -> Region | None:
    return None if start == 0 and size == shape[dim] else Region(shape, dim, start, size)


def _kinds(module: torch.nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _module_slots(
    module: torch.nn.Module, mname: str, pname: str, fmt: torch.Tensor, subs: list[str] | None
) -> list[tuple[str, Slot]]:
    """The checkpoint tensors in parameter `pname` of `module` and where each lies (the rules above)."""
    prefix, _, local = mname.rpartition(".")
    tp, rank = int(getattr(module, "tp_size", 1)), int(getattr(module, "tp_rank", 0))
    shape = tuple(fmt.shape)
    full = f"{mname}.{pname}" if mname else pname
    kinds = _kinds(module)
    out_dim, in_dim = getattr(fmt, "output_dim", None), getattr(fmt, "input_dim", None)
    if getattr(fmt, "packed_dim", None) is not None or getattr(fmt, "is_sharded_weight", False):
        raise UnknownLayout(f"{full} is packed or pre-sharded")
    sizes = getattr(module, "output_sizes", None)
    if subs and subs != [local] and isinstance(sizes, list) and len(sizes) == len(subs):
        if tp > 1 and out_dim != 0:
            raise UnknownLayout(f"{full} is fused but not split by rows")
        fused: list[tuple[str, Slot]] = []
        offset = 0
        qkv: Any = module
        for i, sub in enumerate(subs):
            if "QKVParallelLinear" in kinds:
                shard, replicas = "qkv"[i], int(qkv.num_kv_head_replicas)
                rows, offset = int(qkv._get_shard_size_mapping(shard)), int(qkv._get_shard_offset_mapping(shard))
                copies, shard_rank = (tp, rank) if shard == "q" else (tp // replicas, rank // replicas)
            else:
                rows, copies, shard_rank = sizes[i] // tp, tp, rank
            whole = (rows * copies, *shape[1:])
            name = f"{prefix}.{sub}.{pname}" if prefix else f"{sub}.{pname}"
            region = _region(whole, 0, shard_rank * rows, rows)
            fused.append((name, Slot(mname, full, offset, whole, region)))
            offset += rows
        return fused
    vocab = getattr(module, "org_vocab_size", None)
    if isinstance(vocab, int) and len(shape) == 2:
        indices = getattr(module, "shard_indices", None)
        if indices is None:
            return [(full, Slot(mname, full, 0, (vocab, shape[1])))]
        if indices.num_added_elements:
            raise UnknownLayout(f"{full} has added vocabulary")
        start, stop = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
        return [(full, Slot(mname, full, 0, (vocab, shape[1]), _region((vocab, shape[1]), 0, start, stop - start)))]
    if tp == 1 or (out_dim is None and in_dim is None):
        return [(full, Slot(mname, full, 0, shape))]
    if "RowParallelLinear" in kinds and in_dim == 1:
        whole = (shape[0], shape[1] * tp)
        return [(full, Slot(mname, full, 0, whole, _region(whole, 1, rank * shape[1], shape[1])))]
    if "ColumnParallelLinear" in kinds and not kinds & _FUSED_KINDS and out_dim == 0:
        whole = (shape[0] * tp, *shape[1:])
        return [(full, Slot(mname, full, 0, whole, _region(whole, 0, rank * shape[0], shape[0])))]
    raise UnknownLayout(f"{full} is sharded by a rule pulsesync does not know ({type(module).__name__})")


def _covered(slots: list[Slot], shape: tuple[int, ...], padded: bool) -> bool:
    """Do the slots of a parameter fill its rows from 0 (up to padding rows, for a vocabulary)?"""
    end = 0
    for slot in sorted(slots, key=lambda s: s.row_offset):
        if slot.row_offset != end or tuple(slot.local_shape[1:]) != shape[1:]:
            return False
        end += slot.local_shape[0]
    return end == shape[0] or (padded and end <= shape[0])


def engine_layout(model: torch.nn.Module, model_params: ModelParams = live_params) -> EngineLayout:
    """Map checkpoint names to this worker's parameters (fused blocks, regions), with aliases and unknown modules."""
    mapping: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    layout = EngineLayout({}, {})
    first_name: dict[int, str] = {}
    plain: dict[str, bool] = {}
    by_param: dict[tuple[str, str], list[Slot]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        local = mname.rpartition(".")[2]
        formats: dict[str, torch.Tensor] | None = None
        for pname, param in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if id(param) in first_name:
                layout.aliases[full] = first_name[id(param)]
                layout.alias_modules[full] = mname
                continue
            first_name[id(param)] = full
            if formats is None:
                try:
                    formats = model_params(mname, module)
                except UnknownLayout as e:
                    layout.unknown.setdefault(mname, str(e))
                    formats = {}
            fmt = formats.get(pname, param)
            layout.params.setdefault(mname, {})[pname] = (tuple(fmt.shape), fmt.dtype)
            plain[mname] = plain.get(mname, True) and _plain(module, param) and tuple(param.shape) == tuple(fmt.shape)
            try:
                placed = _module_slots(module, mname, pname, fmt, mapping.get(local))
            except UnknownLayout as e:
                layout.unknown.setdefault(mname, str(e))
                continue
            for name, slot in placed:
                layout.slots[name] = slot
                layout.modules.setdefault(mname, []).append(name)
                by_param.setdefault((mname, pname), []).append(slot)
    for (mname, pname), slots in by_param.items():
        shape = layout.params[mname][pname][0]
        padded = isinstance(getattr(model.get_submodule(mname), "org_vocab_size", None), int)
        if math.prod(shape) and not _covered(slots, shape, padded):
            layout.unknown.setdefault(mname, f"{slots[0].param}: its checkpoint tensors do not tile the parameter")
    layout.in_place = {m for m, ok in plain.items() if ok and m not in layout.unknown}
    return layout
