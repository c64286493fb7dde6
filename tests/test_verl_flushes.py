"""An update as verl's `delta_flush` flushes: one encoding per update, buckets by dtype and size, the last marked.

Applied with bench/verl_sync.py's consumer, which writes what verl's vLLM and SGLang consumers write
(tests/test_verl_backend.py applies them with verl's own, in verl's venv).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pulsesync.digest import state_digest
from pulsesync.integrations.verl.flushes import checksum, delta_flushes
from pulsesync.sinks.vllm.wire.update_file import build_update

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from verl_sync import apply_flush


def states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    before = {
        "embed.weight": torch.randn(300, 64, generator=gen).bfloat16(),
        "layer.0.weight": torch.randn(64, 64, generator=gen).bfloat16(),
        "norm.weight": torch.ones(64, dtype=torch.float32),
    }
    after = {name: t.clone() for name, t in before.items()}
    after["embed.weight"].view(-1)[::97] += 1  # sparse
    after["norm.weight"] += 0.5  # every element: changed whole
    return before, after


def spec(named: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    return dict(json.loads(named[0][1].numpy().tobytes()))


def test_against_a_held_base_every_flush_lists_positions_and_rebuilds_the_state() -> None:
    before, after = states()
    base, digest = state_digest(before), state_digest(after)
    changed = {"embed.weight": torch.arange(0, 300 * 64, 97)}
    update = build_update(1, after, digest, base, changed)
    assert set(update.sparse) == {"embed.weight"} and set(update.whole) == {"norm.weight"}
    flushes = list(delta_flushes(update, after, digest.tensors, bucket_bytes=1 << 10))
    assert [last for _, last in flushes] == [False] * (len(flushes) - 1) + [True]
    assert {spec(named)["encoding"] for named, _ in flushes} == {"indices"}  # verl's vLLM consumer refuses a mix
    held = {name: t.clone() for name, t in before.items()}
    for named, _ in flushes:
        tensors = dict(named)
        assert spec(named)["checksum"] == checksum(tensors["__positions__"], tensors["__values__"])
        assert len({t.dtype for n, t in named if n == "__values__"}) == 1
        apply_flush(held, named)
    for name, tensor in after.items():
        assert torch.equal(held[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_without_a_base_every_tensor_goes_dense() -> None:
    _, after = states()
    digest = state_digest(after)
    flushes = list(delta_flushes(build_update(0, after, digest, None, None), after, digest.tensors, 1 << 20))
    names = [p["name"] for named, _ in flushes for p in spec(named)["params"]]  # type: ignore[attr-defined]
    assert sorted(names) == sorted(after) and {spec(named)["encoding"] for named, _ in flushes} == {"dense"}
    held = {name: torch.zeros_like(t) for name, t in after.items()}
    for named, _ in flushes:
        apply_flush(held, named)
    assert all(torch.equal(held[n].view(torch.uint8), t.view(torch.uint8)) for n, t in after.items())


def test_nothing_changed_yields_nothing() -> None:
    _, after = states()
    digest = state_digest(after)
    assert list(delta_flushes(build_update(2, after, digest, digest, None), after, digest.tensors, 1 << 20)) == []


def test_tied_tensors_travel_in_one_flush() -> None:
    """vLLM's loader refuses `lm_head.weight` (tied) in a load without `model.embed_tokens.weight`."""
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(256, 64, generator=gen).bfloat16()
    layer = torch.randn(64, 64, generator=gen).bfloat16()
    state = {"model.embed_tokens.weight": embed, "layer.weight": layer, "lm_head.weight": embed}
    digest = state_digest(state)
    flushes = list(delta_flushes(build_update(0, state, digest, None, None), state, digest.tensors, 1 << 10))
    assert len(flushes) == 2  # each over the bucket: the tied pair together, the layer apart
    together = [{p["name"] for p in spec(named)["params"]} for named, _ in flushes]  # type: ignore[attr-defined]
    assert {"model.embed_tokens.weight", "lm_head.weight"} in together
