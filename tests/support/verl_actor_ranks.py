"""verl's actor ranks under torchrun (gloo, CPU): each publishes its share of every step through the backend.

    torchrun --nproc-per-node N verl_actor_ranks.py SECTION_JSON STEPS SEED

Every rank runs verl's own `ActorRolloutRefWorker.update_weights` with the same per-tensor stream
(what verl's FSDP engine yields on every rank), as tests/test_verl_backend.py checks it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import torch.distributed as dist
from verl.workers.engine_workers import ActorRolloutRefWorker

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.verl_workers import ActorWorker


def main() -> None:
    section, steps, seed = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    worker = ActorWorker(section, seed)
    for step in range(steps):
        worker.train_to(step)
        asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(worker, global_steps=step, mode="auto"))
    worker.checkpoint_engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
