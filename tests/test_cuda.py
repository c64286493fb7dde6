"""The device-agnostic paths on CUDA tensors, checked bit for bit against the CPU.

Skipped where torch sees no CUDA device (CI has none); run on a GPU machine with
`pytest -q tests/test_cuda.py`. Trainer states and engine weights live on the GPU: the encoder
diffs device tensors, the publisher snapshots them to pinned host memory, the decoder patches a
device state, digests hash device tensors in host-sized pieces, and the in-process and vLLM
sinks write into device parameters.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.codec import CodecParams, UndoLog, apply_patch, encode_patch
from pulsesync.digest import state_digest
from pulsesync.dtypes import dtype_info
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.publisher import Publisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.rebuild import reconstruct
from pulsesync.sinks.vllm.engine.applier import WeightApplier
from pulsesync.sinks.vllm.wire.update_file import build_update
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.synthetic import SyntheticTrainer
from tests.support.helpers import assert_states_equal, copying_loader, mutate, random_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool]


def to(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """A copy of every tensor on `device`."""
    return {n: t.to(device, copy=True) for n, t in state.items()}


@pytest.mark.parametrize("density", [0.001, 0.05, 1.0])
def test_encode_and_apply_on_cuda_match_the_cpu_bit_for_bit(density: float) -> None:
    rng = np.random.default_rng(int(density * 1000))
    base = {f"t.{d}".replace("torch.", ""): random_bits(rng, dtype_info(d), (300, 70)) for d in DTYPES}
    new = {n: mutate(rng, t, density) for n, t in base.items()}
    params = CodecParams(chunk_elements=4096)
    patch = encode_patch(base, new, params)
    assert encode_patch(to(base, "cuda"), to(new, "cuda"), params) == patch  # same bytes from device tensors

    assert state_digest(to(base, "cuda")) == state_digest(base)  # digests are device-independent
    work, undo = to(base, "cuda"), UndoLog()
    digest = apply_patch(work, patch, undo=undo)
    assert all(t.device.type == "cuda" for t in work.values())
    assert_states_equal(to(work, "cpu"), new)
    assert digest == state_digest(new)
    cpu_undo = UndoLog()
    apply_patch(to(base, "cpu"), patch, undo=cpu_undo)
    changed, cpu_changed = undo.changed(), cpu_undo.changed()
    assert changed.keys() == cpu_changed.keys()
    for name, positions in changed.items():
        expected = cpu_changed[name]
        assert (positions is None) == (expected is None), name
        if positions is not None and expected is not None:
            assert torch.equal(positions.cpu(), expected), name
    undo.rollback(work)
    assert_states_equal(to(work, "cpu"), base)


def test_a_trainer_on_cuda_publishes_a_chain_a_subscriber_rebuilds_and_applies_to_a_cuda_module(
    tmp_path: Path,
) -> None:
    shapes = {"embed.weight": (512, 64), "layer.weight": (64, 64), "norm.weight": (64,)}
    trainer = SyntheticTrainer(shapes, lr=1e-4, seed=3, device="cuda")
    key = Ed25519PrivateKey.generate()
    states = []
    config = PublisherConfig(anchor_interval=3, on_backpressure="block")
    with Publisher(config, store=FileStore(tmp_path), signing_key=key) as publisher:
        for step in range(6):
            trainer.step()
            state = trainer.state()
            assert all(t.device.type == "cuda" for t in state.values())
            states.append(to(state, "cpu"))
            publisher.publish(step, state)
        publisher.flush()
    trusted = signing.trusted_keys([key.public_key()])

    async def sync_all() -> Subscriber:
        reader = ChainClient(FileStore(tmp_path), trusted)
        rebuilt = await reconstruct(reader, 4)  # anchor 3 + patch 4
        assert rebuilt.anchor_step == 3 and rebuilt.patches_applied == 1
        assert_states_equal(rebuilt.state, states[4])
        subscriber = Subscriber(SubscriberConfig(), store=FileStore(tmp_path), trusted=trusted)
        for step, path in [(1, "slow"), (2, "fast"), (5, "chain")]:
            result = await subscriber.sync(step)
            assert result.path == path
        return subscriber

    subscriber = asyncio.run(sync_all())
    module = torch.nn.Module()
    for name, shape in shapes.items():
        owner, attr = name.split(".")
        if not hasattr(module, owner):
            module.add_module(owner, torch.nn.Module())
        weight = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        setattr(getattr(module, owner), attr, torch.nn.Parameter(weight))
    subscriber.apply_to(module)
    assert all(p.device.type == "cuda" for p in module.parameters())
    assert_states_equal(to(dict(module.state_dict()), "cpu"), states[5])


def test_vllm_worker_extension_applies_sparse_updates_to_cuda_parameters() -> None:
    rng = np.random.default_rng(7)
    old = {"a.weight": random_bits(rng, dtype_info(torch.bfloat16), (128, 32)), "b.bias": torch.zeros(32)}
    new = {"a.weight": mutate(rng, old["a.weight"], 0.02), "b.bias": torch.ones(32)}
    patched, undo = to(old, "cpu"), UndoLog()
    digest = apply_patch(patched, encode_patch(old, new), undo=undo)
    assert digest is not None

    model = torch.nn.Module()
    model.a, model.b = torch.nn.Module(), torch.nn.Module()
    model.a.weight = torch.nn.Parameter(torch.zeros(128, 32, dtype=torch.bfloat16, device="cuda"))
    model.b.bias = torch.nn.Parameter(torch.zeros(32, device="cuda"))
    applier = WeightApplier(model, copying_loader(model))
    applier.apply(build_update(0, old, state_digest(old), None, None), "full")
    assert applier.layout.in_place == {"a", "b"}
    update = build_update(1, patched, digest, state_digest(old), undo.changed())
    assert "a.weight" in update.sparse
    assert applier.apply(update, "delta")["written"] == 2
    assert model.a.weight.device.type == "cuda"
    assert_states_equal(to(dict(model.state_dict()), "cpu"), new)
