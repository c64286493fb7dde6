"""verl's workers with light constructors, in process, under torchrun or as ray actors (tests/test_verl_backend.py).

The actor worker is verl's `ActorRolloutRefWorker` and the rollout worker verl's
`CheckpointEngineWorker`, each with a light constructor (verl's build FSDP engines and inference
servers): every verb verl calls on them is verl's own code. The trainer is the real-like
synthetic trainer; the rollout's server adapter applies flushes with verl's SGLang delta consumer
onto a stand-in model (SGLang has no CPU kernels here).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.sglang_rollout.delta_loader import apply_delta

from pulsesync.synthetic import real_like_trainer

BUCKET = 1 << 16


def checkpoint_engine(section: dict[str, Any], **extra: Any) -> Any:
    """The backend as verl's workers build it: import the custom module, then `CheckpointEngineRegistry.new`."""
    import_external_libs(section["custom_backend_module"])
    kwargs = section["engine_kwargs"][section["backend"]]
    return CheckpointEngineRegistry.new(section["backend"], bucket_size=BUCKET, **extra, **kwargs)


def trainer(seed: int) -> Any:
    """The model every test trains: the real-like synthetic trainer, small."""
    return real_like_trainer(hidden=64, layers=2, seed=seed)


class Trainer:
    """verl's training engine as the actor worker asks it; `train_to(step)` stands for verl's update_actor."""

    def __init__(self, seed: int) -> None:
        self.trainer = trainer(seed)

    def train_to(self, step: int) -> None:
        while self.trainer.steps < step:
            self.trainer.step()

    def get_per_tensor_param(self) -> tuple[Any, None]:
        return iter(self.trainer.state().items()), None


class ActorWorker(ActorRolloutRefWorker):  # type: ignore[misc]
    def __init__(self, section: dict[str, Any], seed: int) -> None:  # verl's: FSDP engines, optimizer, ...
        self.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=CheckpointEngineConfig(**section)))
        self.actor = SimpleNamespace(engine=Trainer(seed))
        master = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0  # as verl passes it
        self.checkpoint_engine = checkpoint_engine(section, is_master=master)

    def train_to(self, step: int) -> None:
        self.actor.engine.train_to(step)


class StandInModel:
    """What SGLang's `model.load_weights` does at the end of its mapping: copy each tensor into its parameter."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.params = {name: tensor.clone() for name, tensor in state.items()}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)


class Adapter:
    """A server adapter as verl's take them: `update_weights(weights, global_steps, wire_format)`."""

    def __init__(self, model: StandInModel) -> None:
        self.model = model
        self.global_steps: int | None = None
        self.encodings: set[str] = set()  # of the last update's flushes

    async def update_weights(self, weights: Any, global_steps: int | None = None, wire_format: str = "") -> None:
        self.encodings = set()
        async for item in weights:
            if wire_format == "delta_flush":
                named, _is_last = item
                self.encodings.add(json.loads(named[0][1].numpy().tobytes())["encoding"])
                apply_delta(self.model, named)
            else:
                name, tensor = item
                self.model.params[name].copy_(tensor)
        self.global_steps = global_steps


class RolloutWorker(CheckpointEngineWorker):  # type: ignore[misc]
    def __init__(self, section: dict[str, Any], launch_seed: int) -> None:  # verl's: a vLLM or SGLang server
        self.checkpoint_engine = checkpoint_engine(section)
        self.server_adapter = Adapter(StandInModel(trainer(launch_seed).state()))

    def held(self) -> tuple[int | None, dict[str, torch.Tensor]]:
        """The step verl's adapter was told and the weights the stand-in model holds."""
        return self.server_adapter.global_steps, self.server_adapter.model.params


class Replica:
    """A rollout replica as `CheckpointEngineManager` drives it: its workers, and generation paused around a sync."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        """No requests run here."""

    async def release_kv_cache(self) -> None:
        """No KV cache here."""

    async def resume_kv_cache(self) -> None:
        """No KV cache here."""

    async def resume_generation(self) -> None:
        """No requests run here."""
