"""verl's actor ranks under torchrun (gloo, CPU): each publishes its share of every step through the backend.

    torchrun --nproc-per-node N verl_actor_ranks.py ENGINE_KWARGS_JSON STEPS SEED

Every rank runs verl's own `ActorRolloutRefWorker.update_weights` with the same per-tensor stream
(what verl's FSDP engine yields on every rank), as tests/test_verl_backend.py checks it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from verl.workers.engine_workers import ActorRolloutRefWorker

from pulsesync.synthetic import real_like_trainer


class TrainerEngine:
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def get_per_tensor_param(self) -> tuple[Any, None]:
        return iter(self.state.items()), None


def main() -> None:
    kwargs, steps, seed = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    section = SimpleNamespace(backend="pulsesync", custom_backend_module="pulsesync.integrations.verl")
    import_external_libs(section.custom_backend_module)
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=section))
    worker.checkpoint_engine = CheckpointEngineRegistry.new(
        "pulsesync", is_master=dist.get_rank() == 0, bucket_size=1 << 16, **kwargs
    )
    worker.actor = SimpleNamespace(engine=TrainerEngine())
    trainer = real_like_trainer(hidden=64, layers=2, seed=seed)
    for step in range(steps):
        if step:
            trainer.step()
        worker.actor.engine.state = trainer.state()
        asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(worker, global_steps=step, mode="auto"))
    worker.checkpoint_engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
