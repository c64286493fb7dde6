"""The engine side of the vllm sink: apply update files to one vLLM worker's model, transactionally.

Both engine paths run this inside every vLLM worker: the weight-transfer backend
(`engine.backend`, vLLM's native API) and the worker extension (`engine.extension`). Each worker
records the step and state digest it holds, so the sidecar sends a delta only to an engine that
provably holds its base.

An update is first staged while the engine still serves (`stage`: validated before anything
changes; a delta's parts of rebuilt modules written into the shadow copy, and each such module
prepared on a twin: its post-load processing, the expensive part on CPU), then applied while it
is paused (`apply_staged`: the in-place writes and the twins installed, the engine's own writes
only). Both keep a journal of what they overwrite (the old values at a delta's positions; for a
full update, this rank's whole previous state). Any failure restores those bits before the error
leaves the worker, and `rollback` restores them on a worker whose own apply succeeded while
another rank's failed: a worker never serves half an update. `commit` makes the new state the
held one.

Where each checkpoint tensor lives on this worker, and which part of it under tensor parallelism,
is `engine.layout`. A module takes in-place writes only when its parameters are plain, contiguous
and unprocessed, and a full load through vLLM's loader left exactly the checkpoint's bits in
them. Every other module (on CPU: every linear layer and the embedding, repacked for oneDNN)
is rebuilt from this worker's copy of its part of the checkpoint tensors, on a twin
(`engine.twins`), so a sparse update stays sparse and each rank keeps only its share.
Full updates go through vLLM's `reload_weights`, which shards whole checkpoint tensors itself.
A full update ends by rehearsing the first delta's work (`_rehearse`): the shadow copied into memory
of its own (not pages of the update file) and every rebuilt module rebuilt from it as a delta
rebuilds them (not in MoE models), so that the first delta after a start costs what the next ones do.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pulsesync.errors import EngineError
from pulsesync.sinks.vllm.engine.layout import (
    EngineLayout,
    Slot,
    engine_layout,
    rows,
)
from pulsesync.sinks.vllm.engine.twins import (
    LiveRebuilder,
    Rebuilder,
    VLLMRebuilder,
    experts_kernel,
    install,
    process,
    rebuild,
    same_bits,
)
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate

log = logging.getLogger("pulsesync.vllm_applier")


def _view(params: Mapping[str, torch.Tensor], slot: Slot) -> torch.Tensor:
    shape = slot.local_shape
    return rows(params[slot.param].data).narrow(0, slot.row_offset, shape[0]).view(shape)


@dataclass
class Journal:
    """What one apply overwrote on this worker: enough to put back the bits it held before."""

    held: tuple[int | None, str | None]  # (step, digest) before the apply
    target: tuple[int, str]  # (step, digest) once committed
    names: set[str] = field(default_factory=set)  # the checkpoint tensors it touched
    writes: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    # ^ (name, positions or None for the whole tensor, the old values or None: no shadow copy before)
    rebuilt: set[str] = field(default_factory=set)  # modules rebuilt from the shadow
    full: bool = False  # a full update: restore everything from `in_place_before` and `shadow_before`
    in_place_before: dict[str, torch.Tensor] = field(default_factory=dict)  # the in-place views' old bits
    shadow_before: dict[str, torch.Tensor] = field(default_factory=dict)
    in_place_modules: set[str] = field(default_factory=set)


def _failing_after(
    weights: Iterable[tuple[str, torch.Tensor]], drill: int | None, source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights, raising Drill after `drill` of them (None: never)."""
    for count, item in enumerate(weights):
        if count == drill:
            raise Drill(f"{source}: a drill failed the full update after {count} tensors")
        yield item


@dataclass
class Staged:
    """An update validated and prepared by `stage`: its journal so far and the twins of the modules to rebuild."""

    update: WeightUpdate
    source: str
    journal: Journal
    twins: dict[str, torch.nn.Module]
    seconds: float


class Drill(Exception):
    """The failure a drill injects inside an apply (`WeightApplier.drill`), to exercise the rollback."""


class WeightApplier:
    """Applies update files to one worker's model, transactionally, and records the state it holds."""

    def __init__(
        self,
        model: torch.nn.Module,
        reload: Any,
        rebuilder: Rebuilder | None = None,
        rank: int = 0,
        abort_reload: Any = None,
    ) -> None:
        self.model = model
        self.reload = reload  # reload_weights(weights_iterator=...): vLLM's loader and post-processing
        self.abort_reload = abort_reload  # ends a reload that failed partway (vLLM: finalize_layerwise_reload)
        self.rebuilder: Rebuilder = rebuilder or LiveRebuilder()
        self.rank = rank  # which rank's cut of a delta this worker takes
        self.layout: EngineLayout = engine_layout(model, self.rebuilder.model_params)
        self.shadow: dict[str, torch.Tensor] = {}  # this rank's part of the tensors of rebuilt modules
        self.held_step: int | None = None
        self.held_digest: str | None = None  # None: unknown (launch checkpoint, or an apply not yet committed)
        self.staged: Staged | None = None  # a staged update, not yet applied
        self.pending: Journal | None = None  # an apply that succeeded, not yet committed or rolled back
        self.drill: int | None = None  # the next apply raises Drill after writing this many tensors

    def held(self) -> dict[str, Any]:
        """The step and state digest this worker holds (None when unknown), and the bytes it keeps."""
        kept = sum(t.nbytes for t in self.shadow.values())
        return {"step": self.held_step, "digest": self.held_digest, "kept_bytes": kept}

    def validate(self, update: WeightUpdate, source: str) -> None:
        """Raise EngineError unless the update applies to what this worker holds; changes nothing."""
        if self.layout.unknown:
            module, why = next(iter(sorted(self.layout.unknown.items())))
            raise EngineError(f"{source}: pulsesync cannot place the weights of module {module!r} ({why})")
        if update.base is not None and update.base != self.held_digest:
            raise EngineError(
                f"{source}: applies to state {update.base}, the engine holds {self.held_digest or 'an unknown state'}"
            )
        if update.rank is not None and update.rank != self.rank:
            raise EngineError(f"{source}: was cut for rank {update.rank}, this worker is rank {self.rank}")
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
            shape = slots[name].shape if update.base is None else slots[name].local_shape
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise EngineError(f"{source}: {name!r} is {t.dtype} {tuple(t.shape)}, the engine holds {shape}")
        for name, (positions, values) in update.sparse.items():
            numel = math.prod(slots[name].local_shape)
            if not values.is_floating_point() or (
                len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < numel
            ):
                raise EngineError(f"{source}: sparse {name!r} has positions outside its {numel} elements")
            if slots[name].module not in self.layout.in_place and name not in self.shadow:
                raise EngineError(f"{source}: sparse {name!r} needs its previous value, which this engine lacks")

    def stage(self, update: WeightUpdate, source: str) -> None:
        """Validate, then do everything that does not change what the engine computes with.

        A delta's parts of rebuilt modules are written into the shadow (journaled) and each such
        module is prepared on a twin (its post-load processing, the expensive part on CPU), so
        that `apply_staged` only writes: that is what runs while requests are held.
        """
        if self.pending is not None or self.staged is not None:
            raise EngineError(f"{source}: the previous update is neither committed nor rolled back")
        if update.base is not None and update.rank is None:  # an uncut delta: take this rank's part
            regions = {n: s.region for n, s in self.layout.slots.items() if s.region is not None}
            update = update.for_rank(self.rank, regions)
        update = update.without(self.layout.elsewhere)  # experts another rank holds (its loader skips them too)
        self.validate(update, source)
        started = time.perf_counter()
        journal = Journal((self.held_step, self.held_digest), (update.step, update.digest), names=update.names)
        twins: dict[str, torch.nn.Module] = {}
        if update.base is not None:
            try:
                with torch.no_grad():
                    modules = set()
                    for name in sorted(update.names):
                        slot = self.layout.slots[name]
                        if slot.module not in self.layout.in_place:
                            self._write(self.shadow.get(name), update, name, journal)
                            modules.add(slot.module)
                    for module in sorted(modules):
                        twins[module] = self.rebuilder.prepare(
                            self.model.get_submodule(module), self._model_format(module, self.shadow)
                        )
            except BaseException:
                self._restore(journal)
                raise
        self.staged = Staged(update, source, journal, twins, time.perf_counter() - started)

    def apply_staged(self, *, hold: bool = False) -> dict[str, Any]:
        """Apply what `stage` prepared; any failure restores the bits held before and re-raises.

        With `hold`, the journal is kept and the held state unknown until `commit` (`rollback` puts
        the previous one back); otherwise the update is committed at once.
        """
        if self.staged is None:
            raise EngineError("vllm worker: nothing is staged to apply")
        staged, self.staged = self.staged, None
        update, journal = staged.update, staged.journal
        started = time.perf_counter()
        self.held_step = self.held_digest = None
        drill, self.drill = self.drill, None
        try:
            with torch.no_grad():
                if update.base is None:
                    written, rebuilt = 0, self._apply_full(update, staged.source, journal, drill)
                else:
                    written, rebuilt = self._apply_delta(update, journal, staged.twins, drill)
                self._reprocess_tied(update.names)
        except BaseException:
            self._restore(journal)
            raise
        self.pending = journal
        if not hold:
            self.commit()
        return {
            "step": update.step,
            "digest": update.digest,
            "written": written,
            "reloaded": rebuilt,
            "received_bytes": update.nbytes,
            "kept_bytes": self.held()["kept_bytes"],
            "staged_seconds": round(staged.seconds, 4),
            "seconds": round(time.perf_counter() - started, 4),
        }

    def apply(self, update: WeightUpdate, source: str, *, hold: bool = False) -> dict[str, Any]:
        """`stage` then `apply_staged`."""
        self.stage(update, source)
        return self.apply_staged(hold=hold)

    def commit(self) -> None:
        """The applied update's state is now the one held."""
        if self.pending is not None:
            self.held_step, self.held_digest = self.pending.target
            self.pending = None

    def rollback(self) -> None:
        """Put back the bits held before the staged or uncommitted apply (none: nothing to do)."""
        if self.staged is not None:
            staged, self.staged = self.staged, None
            with torch.no_grad():
                self._restore(staged.journal)
        if self.pending is not None:
            journal, self.pending = self.pending, None
            with torch.no_grad():
                self._restore(journal)

    def _apply_full(self, update: WeightUpdate, source: str, journal: Journal, drill: int | None) -> int:
        """Everything through vLLM's loader, then learn which modules take writes; the modules rebuilt."""
        params = dict(self.model.named_parameters())
        journal.full = True
        journal.in_place_modules = set(self.layout.in_place)
        if journal.held[1] is not None:  # a verified state to come back to (the launch checkpoint is reloaded)
            journal.in_place_before = {
                n: _view(params, s).clone() for n, s in self.layout.slots.items() if s.module in self.layout.in_place
            }
            journal.shadow_before = self.shadow  # replaced below, never written in place
        self.shadow = {}
        weights = _failing_after(self._in_model_order(update.whole), drill, source)
        with self._verifying_placement(update.whole) as misplaced:
            try:
                self.reload(weights_iterator=weights)
            except BaseException:
                if self.abort_reload is not None:
                    self.abort_reload()  # no layer may stay half-loaded on the meta device
                raise
        self._check_in_place(params, update.whole)
        if misplaced:
            self._refuse(misplaced, source)
        self._rehearse()
        return len(update.whole)

    def _rehearse(self) -> None:
        """Do once, at a full update, what the first delta after it would pay before its pause.

        A delta prepares a twin of every module it rebuilds, holds them all, then installs them.
        The first to do so after a start grew the worker's heap from the operating system page by
        page: for a 0.27B Llama, 229k minor faults and a staging 5x the next ones'
        (bench/engines.py). So the full update rebuilds every such module the same way, from the
        shadow (the bits it holds), and gives the shadow memory of its own (not pages of the update
        file). The twins are installed, never dropped: dropped twins left an in-process engine
        computing otherwise than a fresh one (tests/test_vllm_inprocess.py). Not in a MoE model: a
        twin there prepacks into the experts kernel it shares with the live layer, and no MoE engine
        test passes here to prove a rehearsal harmless (tests/test_vllm_moe.py fails on this machine
        without it too).
        """
        if any(experts_kernel(module) is not None for module in self.model.modules()):
            return  # a MoE model: its twins share the experts kernel; left as it was until a MoE test proves it safe
        modules = sorted({self.layout.slots[name].module for name in self.shadow})
        self.shadow = {name: tensor.clone() for name, tensor in self.shadow.items()}
        with torch.no_grad():
            twins = {
                m: self.rebuilder.prepare(self.model.get_submodule(m), self._model_format(m, self.shadow))
                for m in modules
            }
            for module, twin in sorted(twins.items()):
                install(self.model.get_submodule(module), twin)

    def _apply_delta(
        self, update: WeightUpdate, journal: Journal, twins: Mapping[str, torch.nn.Module], drill: int | None
    ) -> tuple[int, int]:
        """Write the in-place tensors, install the prepared twins; (tensors written, modules rebuilt)."""
        params = dict(self.model.named_parameters())
        written = 0
        for name in sorted(update.names):
            slot = self.layout.slots[name]
            if slot.module in self.layout.in_place:
                if drill is not None and written == drill:
                    raise Drill(f"a drill failed rank {self.rank}'s update after {written} of its tensors")
                self._write(_view(params, slot), update, name, journal)
                written += 1
        for module, twin in sorted(twins.items()):
            if drill is not None and written + len(journal.rebuilt) == drill:
                raise Drill(f"a drill failed rank {self.rank}'s update after {drill} of its tensors and modules")
            journal.rebuilt.add(module)
            install(self.model.get_submodule(module), twin)
        return written, len(twins)

    def _restore(self, journal: Journal) -> None:
        """Put back what the journal says was overwritten, and the held state from before it."""
        params = dict(self.model.named_parameters())
        if journal.full:
            self.layout.in_place = set(journal.in_place_modules)
            if journal.held[1] is None:  # it held the launch checkpoint: vLLM loads it again from disk
                self.shadow = {}
                self.reload(weights_iterator=None)
                self.held_step, self.held_digest = journal.held
                return
            self.shadow = journal.shadow_before
            for name, before in journal.in_place_before.items():
                _view(params, self.layout.slots[name]).copy_(before)
            modules = {s.module for s in self.layout.slots.values() if s.module not in self.layout.in_place}
        else:
            for name, positions, old in reversed(journal.writes):
                slot = self.layout.slots[name]
                target = _view(params, slot) if slot.module in self.layout.in_place else self.shadow.get(name)
                if old is None:
                    self.shadow.pop(name, None)
                elif target is None:
                    continue
                elif positions is None:
                    target.copy_(old)
                else:
                    target.view(-1).index_copy_(0, positions, old)
            modules = journal.rebuilt
        for module in sorted(modules):
            rebuild(self.rebuilder, self.model.get_submodule(module), self._model_format(module, self.shadow))
        self._reprocess_tied(journal.names)
        self.held_step, self.held_digest = journal.held

    def _model_format(self, module: str, parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's parameters in model format, assembled from this rank's parts (padding rows zero)."""
        out = {pname: torch.zeros(shape, dtype=dtype) for pname, (shape, dtype) in self.layout.params[module].items()}
        for name in self.layout.modules[module]:
            slot = self.layout.slots[name]
            target = out[slot.param.removeprefix(f"{module}.") if module else slot.param]
            rows(target).narrow(0, slot.row_offset, slot.local_shape[0]).copy_(parts[name])
        return out

    @contextmanager
    def _verifying_placement(self, state: Mapping[str, torch.Tensor]) -> Iterator[set[str]]:
        """During a full load, compare what vLLM's loader put in each rebuilt module with what a rebuild would.

        Just before a module's post-load processing, its parameters hold exactly what the loader
        placed there; a rebuild from this rank's parts must produce the same bits, or the layout's
        rules are not the engine's and a later delta would be misplaced. Yields the modules that differ.
        """
        misplaced: set[str] = set()
        rebuilt = {s.module for s in self.layout.slots.values() if s.module not in self.layout.in_place}
        names = {id(self.model.get_submodule(m)): m for m in rebuilt}
        patched = []
        for module in rebuilt:
            method = getattr(self.model.get_submodule(module), "quant_method", None)
            if method is None or "process_weights_after_loading" in vars(method):
                continue

            def process(layer: torch.nn.Module, _original: Any = method.process_weights_after_loading) -> Any:
                name = names.get(id(layer))
                if name is None:
                    return _original(layer)
                parts = {n: self.layout.slots[n].take(state[n]) for n in self.layout.modules[name]}
                expected = self._model_format(name, parts)
                if not all(same_bits(getattr(layer, p).data, t) for p, t in expected.items()):
                    misplaced.add(name)
                result = _original(layer)
                self.rebuilder.finish(layer, expected)
                return result

            method.process_weights_after_loading = process
            patched.append(method)
        try:
            yield misplaced
        finally:
            for method in patched:
                del method.process_weights_after_loading

    def _refuse(self, misplaced: set[str], source: str) -> None:
        """Mark modules whose weights vLLM placed otherwise as unknown: deltas would be misplaced."""
        for module in misplaced:
            self.layout.unknown[module] = "vLLM's loader placed its weights otherwise than pulsesync's rules"
        module = sorted(misplaced)[0]
        raise EngineError(f"{source}: pulsesync cannot place the weights of module {module!r} (vLLM's loader differs)")

    def _reprocess_tied(self, changed: set[str]) -> None:
        """Redo the post-load processing of modules tied to a changed tensor.

        vLLM reprocesses only the module it loaded a tensor into; a tied lm_head on CPU computes
        logits from its own packed copy of the shared weight, which would otherwise go stale.
        """
        for alias, name in self.layout.aliases.items():
            if name in changed:
                process(self.model.get_submodule(self.layout.alias_modules[alias]))

    def _write(self, target: torch.Tensor | None, update: WeightUpdate, name: str, journal: Journal) -> None:
        if name in update.whole:
            if target is None:
                journal.writes.append((name, None, None))
                self.shadow[name] = update.whole[name]  # read from the update file: owned, no copy needed
            else:
                journal.writes.append((name, None, target.clone()))
                target.copy_(update.whole[name])
            return
        assert target is not None
        positions, values = update.sparse[name]
        flat = target.view(-1)
        positions = positions.to(flat.device, torch.int64)
        journal.writes.append((name, positions, flat[positions].clone()))
        flat.index_copy_(0, positions, values.to(flat.device, flat.dtype))

    def _in_model_order(self, tensors: dict[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
        # Layer by layer: vLLM's layerwise reload buffers a layer until all its tensors arrived.
        order = {n: i for i, n in enumerate(self.layout.slots)}
        return [(n, tensors[n]) for n in sorted(tensors, key=order.__getitem__)]

    def _check_in_place(self, params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
        """After a full load: in-place modules are those whose views hold exactly this rank's part of the bits."""
        slots = self.layout.slots
        for module, names in self.layout.modules.items():
            if module in self.layout.in_place and not all(
                same_bits(_view(params, slots[n]), slots[n].take(state[n]).to(params[slots[n].param].dtype))
                for n in names
            ):
                log.warning("%s: vLLM changed its weights after loading; rebuilding it on updates", module)
                self.layout.in_place.discard(module)
        self.shadow = {n: s.take(state[n]) for n, s in slots.items() if s.module not in self.layout.in_place}

    def engine_state(self) -> dict[str, torch.Tensor]:
        """What this worker holds, by checkpoint name (its parts under tensor parallelism), tied names included."""
        params = dict(self.model.named_parameters())
        state = {
            n: _view(params, s) if s.module in self.layout.in_place else self.shadow[n]
            for n, s in self.layout.slots.items()
        }
        return state | {alias: state[name] for alias, name in self.layout.aliases.items() if name in state}


def vllm_applier(model: torch.nn.Module, vllm_config: Any, rank: int, reload: Any = None) -> WeightApplier:
    """A WeightApplier on a vLLM worker's model: vLLM's reload for full updates, its layerwise rebuild for deltas.

    `reload` defaults to vLLM's in-place reload (checkpoint-format tensors, or the model's own
    files when given none); a failed reload is ended with vLLM's layerwise finalization.
    """
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    def reload_in_place(weights_iterator: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        reload_weights(vllm_config, model, weights_iterator, None, True)

    def abort_reload() -> None:
        finalize_layerwise_reload(model, vllm_config.model_config)

    return WeightApplier(model, reload or reload_in_place, VLLMRebuilder(), rank, abort_reload)
