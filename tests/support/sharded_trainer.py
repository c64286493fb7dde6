"""A tiny Llama trained with AdamW under torchrun (gloo, CPU), published every step from every rank.

    torchrun --nproc-per-node N tests/support/sharded_trainer.py OUT --key KEY --layouts fsdp2,uneven,...

Per layout, each rank publishes its own `state_dict()` to file://OUT/<layout>/store through
`pulsesync.publisher.Publisher` (its sharded rounds on several ranks); rank 0 also saves the
whole model of every step to OUT/<layout>/full-<step>.safetensors, for the test to compare with
(the gather there is the test's, never the publisher's). Layouts:

  fsdp2     FSDP2 `fully_shard` on every decoder layer and the root: DTensors, Shard(0)
  uneven    the same with dimensions no world size divides (vocab 101, intermediate 97)
  tp        a tensor-parallel DTensor layout: q/k/v, gate/up, embeddings and head Shard(0)
            (column-wise), o_proj and down_proj Shard(1) (row-wise), norms Replicate
  pipeline  plain tensors, disjoint: rank r holds the layers i with i % world == r (embeddings on
            rank 0, the head and final norm on the last rank), as pipeline stages do
  experts   plain tensors: each rank owns the MLPs ("experts") of its layers whole; attention and
            embeddings are held by every rank and declared owned by rank 0 (None elsewhere)
  grows     pipeline, and from step GROWS_AT on rank 0 also publishes a tensor it did not have (a new
            buffer): rank 0's pieces move, the others' do not, and that step is an anchor on every rank
  moe       a tiny Qwen3-MoE (tests/support/vllm_workload.py TINY_QWEN3_MOE) in checkpoint naming
            (transformers' `revert_weight_conversion`: `...mlp.experts.<e>.gate_proj.weight`): rank r
            owns the experts vLLM's linear expert map gives EP rank r, whole; the rest is rank 0's.
            Rank 0 also saves each step as a model directory, OUT/moe/hf-<step>/ (step 0: the launch)

With --kill-step K, rank 1 dies in the middle of step K (its publish queued, then os._exit) and
the job fails. With --first-step S, a restarted job trains again from the seed and publishes from
step S on (a scheduler's relaunch of the job; torchrun's in-place --max-restarts could not
re-create gloo's process group on this machine, docs/sharding.md).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pulsesync.publisher import Publisher, PublisherConfig
from pulsesync.sharding import Rows
from pulsesync.store import FileStore


def tiny_llama(uneven: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=101 if uneven else 128,
        hidden_size=64,
        intermediate_size=97 if uneven else 128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def tiny_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.support.vllm_workload import TINY_QWEN3_MOE

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE)).to(torch.bfloat16)


def batches(steps: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(steps)]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model (test only: FSDP2's DTensors gathered)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = t.detach().clone().contiguous()
    return out


@functools.cache
def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def published_view(layout: str, model: torch.nn.Module, rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """What this rank hands the publisher for a layout, and the declarations of plain tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    state = model.state_dict()
    if layout in ("fsdp2", "uneven"):
        return state, {}
    if layout == "moe":
        from transformers.core_model_loading import revert_weight_conversion

        from pulsesync.sinks.vllm.engine.layout import expert_map

        experts = model.config.num_experts
        owner = {e: r for r in range(world) for e, local in enumerate(expert_map(experts, world, r)) if local >= 0}
        named = revert_weight_conversion(model, dict(state))
        mine: dict[str, Rows | None] = {}
        for name in named:
            expert = int(name.split(".experts.")[1].split(".")[0]) if ".experts." in name else None
            if (owner[expert] if expert is not None else 0) != rank:
                mine[name] = None
        return named, mine
    if layout == "tp":
        mesh = _mesh(world)

        def placement(name: str, t: torch.Tensor) -> Any:
            if t.dim() == 1:
                return Replicate()
            return Shard(1) if name.endswith(("o_proj.weight", "down_proj.weight")) else Shard(0)

        return {n: distribute_tensor(t.detach(), mesh, [placement(n, t)]) for n, t in state.items()}, {}

    def layer_of(name: str) -> int | None:
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") else None

    if layout in ("pipeline", "grows"):
        mine = {}
        for name, t in state.items():
            i = layer_of(name)
            owner = (i % world) if i is not None else 0 if "embed_tokens" in name else world - 1
            if owner == rank:
                mine[name] = t
        return mine, {}
    assert layout == "experts"
    declared: dict[str, Rows | None] = {}
    for name in state:
        i = layer_of(name)
        expert = i is not None and ".mlp." in name
        owner = (i % world) if expert and i is not None else 0
        if owner != rank:
            declared[name] = None
    return state, declared


GROWS_AT = 2  # the step from which the `grows` layout's rank 0 publishes GROWN too
GROWN = "model.grown.weight"


def grown() -> torch.Tensor:
    """The tensor the `grows` layout adds (the same on every rank: the test's whole model holds it)."""
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


def save_model(model: Any, out: Path) -> None:
    """The model as a directory vLLM serves (save_pretrained: checkpoint naming), with the test tokenizer."""
    from tests.support.vllm_workload import save_tokenizer

    model.save_pretrained(out)
    save_tokenizer(out, model.config.vocab_size)


def train_and_publish(
    layout: str, out: Path, key: Path, steps: int, kill_step: int | None, first: int, resume: bool, cached: bool
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_moe() if layout == "moe" else tiny_llama(layout == "uneven")
    if layout in ("fsdp2", "uneven"):
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh(world)
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = out / layout
    cache_dir = root / "cache" if cached else None  # each rank's under rank-NNNNN/
    config = PublisherConfig(
        signing_key=key, anchor_interval=3, on_backpressure="block", resume=resume, cache_dir=cache_dir
    )
    publisher = None
    for step, ids in enumerate(batches(steps, model.config.vocab_size)):
        if step:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if step < first:
            continue
        if publisher is None:
            publisher = Publisher(
                config, store=FileStore(root / "store"), declared=published_view(layout, model, rank, world)[1]
            )
        state, _ = published_view(layout, model, rank, world)
        full = full_state(model)  # a collective for FSDP2: every rank takes part
        if layout == "grows" and step >= GROWS_AT:
            full[GROWN] = grown()
            if rank == 0:
                state[GROWN] = full[GROWN]
        if rank == 0:
            save_file(full, str(root / f"full-{step}.safetensors"))
            if layout == "moe":
                save_model(model, root / f"hf-{step}")
        files = {"config.json": model.config.to_json_string().encode()} if rank == 0 else None
        publisher.publish(step, state, files)
        if step == kill_step and rank == 1:
            os._exit(1)  # mid-step: the part may or may not be uploaded, the gather never happens
        publisher.flush()
        # No rank holds another rank's shard: its host copies are its own pieces, twice at most
        # (the baseline, and the buffers recycled for the next copy).
        owned, held = publisher.rounds.owned_bytes, publisher.rounds.host_bytes
        assert 0 < held <= 2 * owned or owned == 0, (layout, rank, held, owned)
        assert owned < sum(t.numel() * t.element_size() for t in full.values()) or world == 1
    assert publisher is not None
    publisher.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--key", type=Path, required=True)
    parser.add_argument("--layouts", default="fsdp2,uneven,tp,pipeline,experts")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-step", type=int)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="a relaunch takes up the chain (PublisherConfig.resume)")
    parser.add_argument("--cache", action="store_true", help="each rank keeps its objects (PublisherConfig.cache_dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("pulsesync.publisher").setLevel(logging.INFO)  # what a resume did, for the tests to read
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        for layout in args.layouts.split(","):
            if dist.get_rank() == 0:
                (args.out / layout).mkdir(parents=True, exist_ok=True)
            dist.barrier()
            train_and_publish(
                layout, args.out, args.key, args.steps, args.kill_step, args.first_step, args.resume, args.cache
            )
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
