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
- ReplicatedLinear (a MoE router), and any parameter without `output_dim`/`input_dim`: replicated, whole;
- RoutedExperts (fused_moe/routed_experts.py): expert e's `gate_proj`/`up_proj`/`down_proj`
  checkpoint tensors (`<layer_name>.<e>.<name>.weight`) live in `w13_weight` [E_local, 2I/tp, H]
  (gate rows, then up rows) and `w2_weight` [E_local, H, I/tp] at the expert's local index; the
  TP cut is rows `[rank * I/tp, +I/tp)` of gate and up, columns of down; under expert parallelism
  an expert the engine's expert map gives another rank (-1) is held elsewhere (`expert_map`).

Parameters of three or more dimensions are addressed by rows of their leading dimensions
flattened (`rows`): expert e's down projection is rows `[e * H, (e + 1) * H)` of `w2_weight`.

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

from pulsesync.sinks.vllm.wire.update_file import Region

_PLAIN_QUANT_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
_FUSED_KINDS = {"MergedColumnParallelLinear", "QKVParallelLinear"}

ModelParams = Callable[[str, torch.nn.Module], dict[str, torch.Tensor]]
"""A module's parameters in model format (maybe on the meta device, with vLLM's attributes), by name."""


def rows(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as rows: its leading dimensions flattened (a view; 1-D and 2-D tensors as they are)."""
    return tensor.flatten(0, -2) if tensor.dim() > 2 else tensor


def expert_map(num_experts: int, ep_size: int, ep_rank: int, strategy: str = "linear") -> list[int]:
    """Each global expert's local index on `ep_rank`, -1 where another rank holds it.

    vLLM 0.32's placement (fused_moe/expert_map_manager.py `determine_expert_map`): experts
    spread evenly, the first `num_experts % ep_size` ranks one more; "linear" gives each rank a
    contiguous run, "round_robin" every `ep_size`-th expert from `ep_rank`.
    """
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is outside ep_size {ep_size}")
    base, extra = divmod(num_experts, ep_size)
    local = base + 1 if ep_rank < extra else base
    if strategy == "linear":
        start = ep_rank * base + min(ep_rank, extra)
        mine = list(range(start, start + local))
    elif strategy == "round_robin":
        mine = list(range(ep_rank, num_experts, ep_size))
    else:
        raise ValueError(f"unknown expert placement strategy {strategy!r}")
    out = [-1] * num_experts
    for index, expert in enumerate(mine):
        out[expert] = index
    return out


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
    elsewhere: set[str] = field(default_factory=set)  # checkpoint names other ranks hold (expert parallelism)

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
            "elsewhere": sorted(self.elsewhere),
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
) -> list[tuple[str, Slot | None]]:
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
        fused: list[tuple[str, Slot | None]] = []
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
    if tp == 1 or (out_dim is None and in_dim is None) or "ReplicatedLinear" in kinds:
        return [(full, Slot(mname, full, 0, shape))]
    if "RowParallelLinear" in kinds and in_dim == 1:
        whole = (shape[0], shape[1] * tp)
        return [(full, Slot(mname, full, 0, whole, _region(whole, 1, rank * shape[1], shape[1])))]
    if "ColumnParallelLinear" in kinds and not kinds & _FUSED_KINDS and out_dim == 0:
        whole = (shape[0] * tp, *shape[1:])
        return [(full, Slot(mname, full, 0, whole, _region(whole, 0, rank * shape[0], shape[0])))]
    raise UnknownLayout(f"{full} is sharded by a rule pulsesync does not know ({type(module).__name__})")


def _expert_slots(module: torch.nn.Module, mname: str, pname: str, fmt: torch.Tensor) -> list[tuple[str, Slot | None]]:
    """The experts' checkpoint tensors in `w13_weight`/`w2_weight` of a RoutedExperts (None: another rank's)."""
    full = f"{mname}.{pname}"
    moe: Any = module
    names = (moe.ckpt_gate_proj_name, moe.ckpt_up_proj_name, moe.ckpt_down_proj_name)
    parallel = moe.moe_config.moe_parallel_config
    tp, rank = int(parallel.tp_size), int(parallel.tp_rank)
    if None in names or len(fmt.shape) != 3 or getattr(moe, "is_fused_checkpoint_transposed", False):
        raise UnknownLayout(f"{full} is not a gated, per-expert MoE weight")
    engine_map = getattr(moe, "_expert_map", None)
    local_of = list(range(int(moe.global_num_experts))) if engine_map is None else engine_map.tolist()
    experts, height, width = (int(d) for d in fmt.shape)
    if sum(i >= 0 for i in local_of) != experts:
        raise UnknownLayout(f"{full} holds {experts} experts, its expert map {sum(i >= 0 for i in local_of)}")
    out: list[tuple[str, Slot | None]] = []
    for expert, local in enumerate(local_of):
        prefix = f"{moe.layer_name}.{expert}"
        if pname == "w13_weight":
            size = height // 2
            whole = (size * tp, width)
            for i, sub in enumerate(names[:2]):
                region = _region(whole, 0, rank * size, size)
                slot = Slot(mname, full, local * height + i * size, whole, region)
                out.append((f"{prefix}.{sub}.weight", slot if local >= 0 else None))
        elif pname == "w2_weight":
            whole = (height, width * tp)
            slot = Slot(mname, full, local * height, whole, _region(whole, 1, rank * width, width))
            out.append((f"{prefix}.{names[2]}.weight", slot if local >= 0 else None))
        else:
            raise UnknownLayout(f"{full}: pulsesync places only the experts' weights (not {pname})")
    return out


def _covered(slots: list[Slot], shape: tuple[int, ...], padded: bool) -> bool:
    """Do the slots of a parameter fill its rows from 0 (up to padding rows, for a vocabulary)?"""
    shape = (math.prod(shape[:-1]), shape[-1]) if len(shape) > 2 else shape
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
    for mname, module in model.named_modules():  # a module registered twice (a MoE router) counts once
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
                placed = (
                    _expert_slots(module, mname, pname, fmt)
                    if "RoutedExperts" in _kinds(module)
                    else _module_slots(module, mname, pname, fmt, mapping.get(local))
                )
            except UnknownLayout as e:
                layout.unknown.setdefault(mname, str(e))
                continue
            for name, slot in placed:
                if slot is None:
                    layout.elsewhere.add(name)
                    continue
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
