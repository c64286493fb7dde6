"""The engine side of the vllm sink: a vLLM worker extension that applies update files and knows what it holds.

Loaded inside every vLLM worker with `--worker-extension-cls
pulsesync.sinks.vllm_worker.PulseSyncWorkerExtension`; the sidecar calls its `pulsesync_*` methods
through `POST /collective_rpc`. Each worker records the step and state digest it holds, set only
after an update applied completely and cleared (unknown) by any failure, so the sidecar sends a
delta only to an engine that provably holds its base.

Where a checkpoint tensor lives (`EngineLayout`): vLLM fuses q/k/v and gate/up into one
parameter (`packed_modules_mapping`, row blocks of `output_sizes`), ties lm_head to the
embeddings, and post-processes weights after loading (CPU oneDNN packing empties `layer.weight`;
quantization; non-contiguous layouts). A module takes in-place writes only when its parameters
are plain, contiguous, unsharded and unprocessed, and a full load through vLLM's loader left
exactly the checkpoint's bits in them; every other module goes through vLLM's own
`reload_weights` (which re-runs the post-load processing), whole modules at a time, from a host
copy of its checkpoint tensors kept by the extension so that sparse updates stay sparse.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from pulsesync.digest import DEFAULT_ALGORITHM, DigestAlgorithm, state_digest
from pulsesync.errors import EngineError
from pulsesync.sinks.weight_update import WeightUpdate

log = logging.getLogger("pulsesync.vllm_worker")
_PLAIN_QUANT_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives: rows [row_offset, row_offset + shape[0]) of a parameter."""

    module: str
    param: str
    row_offset: int
    shape: tuple[int, ...]
    fused: bool  # one of several checkpoint tensors packed into the parameter


@dataclass
class EngineLayout:
    """The checkpoint names a model holds, where, which of its modules take in-place writes, and its aliases."""

    slots: dict[str, Slot]
    aliases: dict[str, str]  # checkpoint name -> the name it is tied to
    alias_modules: dict[str, str] = field(default_factory=dict)  # checkpoint name -> module of its alias
    in_place: set[str] = field(default_factory=set)  # module names

    def describe(self) -> dict[str, Any]:
        """What the sidecar needs: names, aliases, how each module is written."""
        return {
            "names": sorted(self.slots),
            "aliases": self.aliases,
            "in_place": sorted(n for n, s in self.slots.items() if s.module in self.in_place),
        }


def _checkpoint_shape(module: torch.nn.Module, pname: str, param: torch.Tensor, rows: int | None) -> tuple[int, ...]:
    """The checkpoint tensor's shape, also where the engine emptied or padded the parameter."""
    in_size, out_size = getattr(module, "input_size", None), getattr(module, "output_size", None)
    if isinstance(in_size, int) and isinstance(out_size, int):  # a linear layer (maybe packed away on CPU)
        out = rows if rows is not None else out_size
        return (out, in_size) if pname == "weight" else (out,)
    vocab = getattr(module, "org_vocab_size", None)
    if isinstance(vocab, int) and param.dim() == 2:  # vocab rows padded to a multiple of 64
        return (vocab, param.shape[1])
    return tuple(param.shape)


def _plain(module: torch.nn.Module, param: torch.Tensor) -> bool:
    """Parameters the forward pass reads as they are: in-place writes reach the computation."""
    quant = getattr(module, "quant_method", None)
    return (
        type(param.data) is torch.Tensor
        and param.numel() > 0
        and param.is_contiguous()
        and getattr(module, "tp_size", 1) == 1
        and not hasattr(module, "cpu_linear")  # CPU: computes from a packed copy
        and (quant is None or type(quant).__name__ in _PLAIN_QUANT_METHODS)
    )


def engine_layout(model: torch.nn.Module) -> EngineLayout:
    """Map checkpoint names to the model's parameters (fused blocks by row offsets), with aliases."""
    mapping: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    slots: dict[str, Slot] = {}
    aliases: dict[str, str] = {}
    alias_modules: dict[str, str] = {}
    first_name: dict[int, str] = {}
    plain: dict[str, bool] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix, _, local = mname.rpartition(".")
        for pname, param in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if id(param) in first_name:
                aliases[full] = first_name[id(param)]
                alias_modules[full] = mname
                continue
            first_name[id(param)] = full
            plain[mname] = plain.get(mname, True) and _plain(module, param)
            subs = mapping.get(local)
            sizes = getattr(module, "output_sizes", None)
            if subs and subs != [local] and isinstance(sizes, list) and len(sizes) == len(subs):
                offset = 0
                for sub, rows in zip(subs, sizes, strict=True):
                    name = f"{prefix}.{sub}.{pname}" if prefix else f"{sub}.{pname}"
                    slots[name] = Slot(mname, full, offset, _checkpoint_shape(module, pname, param, rows), True)
                    offset += rows
            else:
                slots[full] = Slot(mname, full, 0, _checkpoint_shape(module, pname, param, None), False)
    layout = EngineLayout(slots, aliases, alias_modules)
    params = dict(model.named_parameters())
    for slot in slots.values():
        p = params[slot.param]
        if (
            p.dim() != len(slot.shape)
            or tuple(p.shape[1:]) != slot.shape[1:]
            or slot.row_offset + slot.shape[0] > p.shape[0]
        ):
            plain[slot.module] = False
    layout.in_place = {m for m, ok in plain.items() if ok}
    return layout


def _view(params: Mapping[str, torch.Tensor], slot: Slot) -> torch.Tensor:
    return params[slot.param].data.narrow(0, slot.row_offset, slot.shape[0])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    b = b.to(a.device)  # engine parameters live on the GPU, update tensors on the host
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class WeightApplier:
    """Applies update files to one worker's model and records the state it holds."""

    def __init__(self, model: torch.nn.Module, reload: Any) -> None:
        self.model = model
        self.reload = reload  # reload_weights(weights_iterator=...): vLLM's loader and post-processing
        self.layout = engine_layout(model)
        self.shadow: dict[str, torch.Tensor] = {}  # checkpoint tensors of the modules written by reload
        self.held_step: int | None = None
        self.held_digest: str | None = None  # None: unknown (launch checkpoint, or after a failure)

    def held(self) -> dict[str, Any]:
        """The step and state digest this worker holds (None when unknown)."""
        return {"step": self.held_step, "digest": self.held_digest}

    def validate(self, update: WeightUpdate, source: str) -> None:
        """Raise EngineError unless the update applies to what this worker holds; changes nothing."""
        if update.base is not None and update.base != self.held_digest:
            raise EngineError(
                f"{source}: applies to state {update.base}, the engine holds {self.held_digest or 'an unknown state'}"
            )
        slots, names = self.layout.slots, update.names
        for name in sorted(names):
            if name in self.layout.aliases:
                raise EngineError(
                    f"{source}: {name!r} is tied to {self.layout.aliases[name]!r} in this engine; send it once"
                )
            if name not in slots:
                raise EngineError(f"{source}: names {name!r}, which this engine does not hold")
        if update.base is None and (missing := sorted(set(slots) - names)):
            raise EngineError(f"{source}: a full update lacks {missing[0]!r} ({len(missing)} tensors)")
        for name, t in update.whole.items():
            if tuple(t.shape) != slots[name].shape or not t.is_floating_point():
                raise EngineError(
                    f"{source}: {name!r} is {t.dtype} {tuple(t.shape)}, the engine holds {slots[name].shape}"
                )
        for name, (positions, values) in update.sparse.items():
            numel = math.prod(slots[name].shape)
            if not values.is_floating_point() or (
                len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < numel
            ):
                raise EngineError(f"{source}: sparse {name!r} has positions outside its {numel} elements")
            if slots[name].module not in self.layout.in_place and name not in self.shadow:
                raise EngineError(f"{source}: sparse {name!r} needs its previous value, which this engine lacks")

    def apply(self, update: WeightUpdate, source: str) -> dict[str, Any]:
        """Validate, then apply; the held state is unknown from the first change until it completes."""
        self.validate(update, source)
        started = time.perf_counter()
        self.held_step = self.held_digest = None
        params = dict(self.model.named_parameters())
        slots = self.layout.slots
        with torch.no_grad():
            if update.base is None:  # everything through vLLM's loader, then learn which modules take writes
                self.reload(weights_iterator=self._in_model_order(update.whole))
                self._check_in_place(params, update.whole)
                reloaded, written = len(update.whole), 0
            else:
                modules: set[str] = set()
                written = 0
                for name in update.names:
                    slot = slots[name]
                    if slot.module in self.layout.in_place:
                        self._write(_view(params, slot), update, name)
                        written += 1
                    else:
                        self._write(self.shadow.get(name), update, name)
                        modules.add(slot.module)
                batch = {n: self.shadow[n] for n, s in slots.items() if s.module in modules}
                if batch:
                    self.reload(weights_iterator=self._in_model_order(batch))
                reloaded = len(batch)
            self._reprocess_tied(update.names)
        self.held_step, self.held_digest = update.step, update.digest
        return {
            "step": update.step,
            "digest": update.digest,
            "written": written,
            "reloaded": reloaded,
            "seconds": round(time.perf_counter() - started, 4),
        }

    def _reprocess_tied(self, changed: set[str]) -> None:
        """Redo the post-load processing of modules tied to a changed tensor.

        vLLM reprocesses only the module it loaded a tensor into; a tied lm_head on CPU computes
        logits from its own packed copy of the shared weight, which would otherwise go stale.
        """
        for alias, name in self.layout.aliases.items():
            if name in changed:
                module = self.model.get_submodule(self.layout.alias_modules[alias])
                process = getattr(getattr(module, "quant_method", None), "process_weights_after_loading", None)
                if callable(process):
                    process(module)

    def _write(self, target: torch.Tensor | None, update: WeightUpdate, name: str) -> None:
        if name in update.whole:
            if target is None:
                self.shadow[name] = update.whole[name]  # read from the update file: owned, no copy needed
            else:
                target.copy_(update.whole[name])
            return
        assert target is not None
        positions, values = update.sparse[name]
        flat = target.view(-1)
        flat.index_copy_(0, positions.to(flat.device, torch.int64), values.to(flat.device, flat.dtype))

    def _in_model_order(self, tensors: dict[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
        # Layer by layer: vLLM's layerwise reload buffers a layer until all its tensors arrived.
        order = {n: i for i, n in enumerate(self.layout.slots)}
        return [(n, tensors[n]) for n in sorted(tensors, key=order.__getitem__)]

    def _check_in_place(self, params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
        """After a full load: in-place modules are those whose views hold exactly the loaded bits."""
        by_module: dict[str, list[str]] = defaultdict(list)
        for name, slot in self.layout.slots.items():
            by_module[slot.module].append(name)
        for module, names in by_module.items():
            if module in self.layout.in_place and not all(
                _same_bits(_view(params, self.layout.slots[n]), state[n].to(params[self.layout.slots[n].param].dtype))
                for n in names
            ):
                log.warning("%s: vLLM changed its weights after loading; updating it through reload_weights", module)
                self.layout.in_place.discard(module)
        self.shadow = {n: state[n] for n, s in self.layout.slots.items() if s.module not in self.layout.in_place}

    def engine_state(self) -> dict[str, torch.Tensor]:
        """What the engine holds, by checkpoint name: in-place views read back, the rest as last loaded."""
        params = dict(self.model.named_parameters())
        state = {
            n: _view(params, s) if s.module in self.layout.in_place else self.shadow[n]
            for n, s in self.layout.slots.items()
        }
        return state | {alias: state[name] for alias, name in self.layout.aliases.items() if name in state}


class PulseSyncWorkerExtension:
    """vLLM worker extension (`--worker-extension-cls`): its methods run on every worker via collective_rpc."""

    model_runner: Any  # set by vLLM's worker

    def _pulsesync(self) -> WeightApplier:
        applier: WeightApplier | None = getattr(self, "_pulsesync_applier", None)
        if applier is None:
            applier = WeightApplier(self.model_runner.get_model(), self.model_runner.reload_weights)
            self._pulsesync_applier = applier
        return applier

    def pulsesync_layout(self) -> dict[str, Any]:
        """Checkpoint names this worker holds, their aliases, and which are written in place."""
        return self._pulsesync().layout.describe()

    def pulsesync_held(self) -> dict[str, Any]:
        """The step and state digest this worker holds; None for both when unknown."""
        return self._pulsesync().held()

    def pulsesync_apply(self, path: str) -> dict[str, Any]:
        """Apply an update file written by the vllm sink; EngineError before any change if it does not fit."""
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
        return self._pulsesync().apply(WeightUpdate.from_file(tensors, meta, path), path)

    def pulsesync_digest(self, algorithm: DigestAlgorithm = DEFAULT_ALGORITHM) -> dict[str, Any]:
        """State digest of what this worker holds (tied names included), to compare with the published one."""
        applier = self._pulsesync()
        digest = state_digest(applier.engine_state(), algorithm)
        return {"root": digest.root, "held": applier.held_digest}
