"""The engine side's transactions without vLLM: a failed apply, on any rank, leaves every rank's exact bits.

`WeightApplier` on a module with an in-place norm and a "packed" linear layer (computing from a
copy made by its post-load processing, as vLLM's CPU build does, so it is rebuilt from the
worker's shadow copy); `TransferWorker`s driven by the sink's `TransferSession` through in-memory
verbs, two ranks. The real engines: tests/test_vllm_transfer.py and tests/test_vllm_tp.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pulsesync.digest import state_digest
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Update
from pulsesync.sinks.config import VLLMSinkConfig
from pulsesync.sinks.vllm.engine.applier import Drill, WeightApplier
from pulsesync.sinks.vllm.engine.transfer_worker import TransferInit, TransferStep, TransferWorker
from pulsesync.sinks.vllm.sidecar.sessions import EngineSession, Serving, TransferSession, TransferVerbs
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy, parse_version
from pulsesync.verified import VerifiedState
from tests.support.helpers import copying_loader


class Packing:  # vLLM's CPU linear method: the forward pass reads a copy packed after loading
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = layer.weight.detach().clone() * 1


class Packed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
        self.quant_method, self.cpu_linear = Packing(), None
        self.quant_method.process_weights_after_loading(self)


def model() -> torch.nn.Module:
    root = torch.nn.Module()
    root.norm = torch.nn.Module()
    root.norm.weight = torch.nn.Parameter(torch.zeros(16, dtype=torch.bfloat16), requires_grad=False)
    root.proj = Packed()
    return root


def loader(m: torch.nn.Module) -> Any:
    """vLLM's loader on this module: copy every tensor, then the post-load processing (None: the launch files)."""
    copy = copying_loader(m)

    def reload(weights_iterator: Any) -> None:
        copy(weights_iterator)
        m.proj.quant_method.process_weights_after_loading(m.proj)

    return reload


def states() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    first = {
        "norm.weight": torch.randn(16, generator=gen).to(torch.bfloat16),
        "proj.weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16),
    }
    second = {n: t.clone() for n, t in first.items()}
    second["norm.weight"][[1, 5]] += 1
    second["proj.weight"][2, 3] += 1
    return [first, second]


def served(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What the forward pass reads: the norm in place, the projection's packed copy."""
    return {"norm": m.norm.weight.detach().clone(), "packed": m.proj.packed.clone()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def full(step: int, state: dict[str, torch.Tensor]) -> WeightUpdate:
    return WeightUpdate(step, f"s{step}", None, whole=dict(state))


def delta(step: int, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> WeightUpdate:
    update = WeightUpdate(step, f"s{step}", f"s{step - 1}")
    for name, t in new.items():
        positions = (t.view(torch.int16) != old[name].view(torch.int16)).reshape(-1).nonzero().reshape(-1)
        update.sparse[name] = (positions.to(torch.int32), t.reshape(-1)[positions])
    return update


def test_a_delta_that_fails_mid_way_or_is_rolled_back_leaves_the_bits_held_before() -> None:
    s0, s1 = states()
    m = model()
    applier = WeightApplier(m, loader(m))
    applier.apply(full(0, s0), "full")
    assert "proj" not in applier.layout.in_place and "norm" in applier.layout.in_place
    before = served(m)
    applier.drill = 1  # one tensor written (the norm, in place), then a raise before the rebuild
    with pytest.raises(Drill):
        applier.apply(delta(1, s0, s1), "delta")
    assert same(served(m), before) and applier.held()["digest"] == "s0" and applier.pending is None
    assert torch.equal(applier.shadow["proj.weight"].view(torch.int16), s0["proj.weight"].view(torch.int16))

    applier.apply(delta(1, s0, s1), "delta", hold=True)  # applied on this rank; another rank failed
    assert not same(served(m), before) and applier.held()["digest"] is None
    applier.rollback()
    assert same(served(m), before) and applier.held()["digest"] == "s0"
    applier.apply(delta(1, s0, s1), "delta", hold=True)
    applier.commit()
    assert applier.held()["digest"] == "s1"
    assert same(served(m), {"norm": s1["norm.weight"], "packed": s1["proj.weight"]})


def test_a_full_update_that_fails_restores_the_verified_state_or_reads_the_launch_checkpoint_again() -> None:
    s0, s1 = states()
    m = model()
    launch = served(m)
    aborted: list[int] = []
    applier = WeightApplier(m, loader(m), abort_reload=lambda: aborted.append(1))
    applier.drill = 1
    with pytest.raises(Drill):  # over the launch checkpoint: nothing verified to return to
        applier.apply(full(0, s0), "full")
    assert aborted == [1] and same(served(m), launch) and applier.held()["digest"] is None

    applier.apply(full(0, s0), "full")
    before = served(m)
    applier.drill = 1
    with pytest.raises(Drill):  # over a verified state: its exact bits come back
        applier.apply(full(1, s1), "full")
    assert same(served(m), before) and applier.held()["digest"] == "s0"
    applier.apply(full(1, s1), "full", hold=True)
    applier.rollback()
    assert same(served(m), before) and applier.held()["digest"] == "s0"
    applier.apply(delta(1, s0, s1), "delta")  # the restored shadow is the base a delta needs
    assert same(served(m), {"norm": s1["norm.weight"], "packed": s1["proj.weight"]})


class LocalVerbs(TransferVerbs):
    """vLLM's verbs on in-memory workers, one per rank (as vLLM's worker dispatches them)."""

    def __init__(self, workers: list[TransferWorker]) -> None:
        self.workers, self.where, self.version = workers, "local engine", "default"

    async def init(self, init_info: dict[str, Any]) -> None:
        for w in self.workers:
            w.init(TransferInit(**init_info))

    async def start(self) -> None:
        for w in self.workers:
            w.start()

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        for rank, w in enumerate(self.workers):
            w.step(TransferStep(**(update_info[rank] if isinstance(update_info, list) else update_info)))

    async def finish(self, weight_version: str | None) -> None:
        for w in self.workers:
            w.finish()
        if weight_version is not None:
            self.version = weight_version

    async def weight_version(self) -> str | None:
        return self.version


class LocalServing(Serving):
    where = "local engine"

    def paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def resume(self) -> None:
        """Nothing paused."""

    async def reset_prefix_cache(self) -> bool:
        return True

    async def is_sleeping(self) -> bool:
        return False


async def test_a_rank_that_fails_rolls_every_rank_back_and_the_next_session_lands(tmp_path: Path) -> None:
    s0, s1 = states()
    models = [model(), model()]
    workers = [TransferWorker(lambda m=m: WeightApplier(m, loader(m)), r, 2) for r, m in enumerate(models)]
    verbs = LocalVerbs(workers)

    @contextlib.asynccontextmanager
    async def connect() -> AsyncIterator[tuple[EngineSession, Serving]]:
        yield TransferSession(verbs, tmp_path), LocalServing()

    sink = VLLMSink(VLLMSinkConfig(url="local", update_dir=tmp_path), connect=connect)
    d0, d1 = state_digest(s0), state_digest(s1)
    await sink.deliver(Update(VerifiedState(0, s0, d0, {})))
    assert parse_version(verbs.version) == HeldPolicy(0, d0.root)
    before = [served(m) for m in models]

    stage = workers[1]._stage

    def truncated(path: str | None) -> None:  # rank 1 reads a torn file: nothing changes there
        assert path is not None
        Path(path).write_bytes(Path(path).read_bytes()[:64])
        stage(path)

    workers[1]._stage = truncated  # type: ignore[method-assign]
    with pytest.raises(EngineError, match=r"step 1 failed on rank 1 .*every rank is back on step 0"):
        await sink.deliver(Update(VerifiedState(1, s1, d1, {}), previous_digest=d0))
    assert all(same(served(m), b) for m, b in zip(models, before, strict=True))
    assert parse_version(verbs.version) == HeldPolicy(0, d0.root)  # finished without a version

    workers[1]._stage = stage  # type: ignore[method-assign]
    verbs.version = "someone-else"  # another writer: the state is unknown, so the update is whole
    await sink.deliver(Update(VerifiedState(1, s1, d1, {}), previous_digest=d0))
    assert sink.last_update is not None and sink.last_update.base is None
    assert parse_version(verbs.version) == HeldPolicy(1, d1.root)
    assert all(same(served(m), {"norm": s1["norm.weight"], "packed": s1["proj.weight"]}) for m in models)

    workers[0].start()  # a sidecar died inside a session: the next delivery finishes it first
    await sink.deliver(Update(VerifiedState(1, s1, d1, {}), previous_digest=d0))
    assert not workers[0].open
