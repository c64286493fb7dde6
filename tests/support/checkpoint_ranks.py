"""Checkpoints published from every rank under torchrun (gloo, CPU), each rank its FSDP2 rows of every tensor.

    torchrun --nproc-per-node N tests/support/checkpoint_ranks.py STORE KEY CKPT [CKPT ...]

Each CKPT is a safetensors file of the whole model at one step (steps 1, 2, ... in order); every
rank reads it and publishes the rows FSDP2's dim-0 split gives it (`Rows`, ceil-sized, the last
ones shorter or none) through `pulsesync.publisher.Publisher` into file://STORE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from real_llm import rank_rows  # bench/real_llm.py: the FSDP2 row split its parts column uses

from pulsesync.publisher import Publisher, PublisherConfig
from pulsesync.store import FileStore


def main() -> None:
    store, key, *checkpoints = sys.argv[1:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    states = [load_file(path) for path in checkpoints]
    declared = rank_rows(states[0], world)[rank]
    config = PublisherConfig(signing_key=Path(key), anchor_interval=1000, on_backpressure="block")
    with Publisher(config, store=FileStore(Path(store)), declared=declared) as publisher:
        for step, whole in enumerate(states, start=1):
            rows = {n: whole[n][r.start : r.stop] for n, r in declared.items() if r is not None}
            publisher.publish(step, rows)
            publisher.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
