"""An engine restarted under a running daemon is brought back to the served step without a publish.

The engine is the vLLM stand-in (tests/support/vllm_standin.py: pulsesync's real weight-transfer
backend behind vLLM's routes); the real servers are restarted in the `-m engine` tests
(tests/test_vllm_engine.py, test_vllm_transfer.py, test_vllm_tp.py, test_vllm_lora.py,
test_grpo_loop.py). The stand-in goes away (the daemon logs once that it does not answer), comes
back on its launch weights ("default"), and within a few poll ticks holds the served state bit
for bit, its version naming it; the restart is counted and logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.digest import state_digest
from pulsesync.protocol import signing
from pulsesync.publisher import AsyncPublisher, PublisherConfig
from pulsesync.sinks import DirectorySinkConfig, Sink, VLLMSinkConfig
from pulsesync.sinks.directory import DirectorySink
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from tests.support.helpers import trainer_states
from tests.support.subscribing import FAST_RETRY, STATES, publish, wait_for
from tests.support.vllm_standin import VLLMStandIn, module_holding


@contextlib.asynccontextmanager
async def daemon_feeding_an_engine(
    tmp_path: Path, key: Ed25519PrivateKey, directory: bool, loading: bool = False, **overrides: float
) -> AsyncIterator[tuple[AsyncPublisher, list[VLLMStandIn], Subscriber]]:
    """Steps 0-3 published, a stand-in started on its launch weights, a daemon (a 0.1 s poll, `overrides`) serving
    it step 3 (through a directory sink too, with `directory`); everything stopped after. A test appends the
    engines it restarts to the list. `loading`: the engine does not answer yet (its port is taken up later)
    and the daemon has served nothing."""
    store = FileStore(tmp_path / "store")
    pub = AsyncPublisher(PublisherConfig(anchor_interval=5, on_backpressure="block"), store=store, signing_key=key)
    await pub.start()
    await publish(pub, range(4))
    engines = [VLLMStandIn(module_holding(trainer_states(STATES)[0]))]
    await engines[0].start()
    if loading:
        await engines[0].stop()
    sinks: list[Sink] = [DirectorySink(DirectorySinkConfig(out_dir=tmp_path / "out"))] if directory else []
    sinks.append(VLLMSink(VLLMSinkConfig(url=engines[0].url, update_dir=tmp_path / "updates", timeout_seconds=10)))
    config = FAST_RETRY.model_copy(update={"poll_seconds": 0.1, "fleet_status": False, **overrides})
    sub = Subscriber(config, store=store, trusted=signing.trusted_keys([key.public_key()]), sinks=sinks)
    stop = asyncio.Event()
    sub.task = asyncio.create_task(sub.run(stop))  # type: ignore[attr-defined]
    try:
        held = lambda: sub.step == 3 and engines[0].weight_version.startswith("pulsesync:3:")  # noqa: E731
        if not loading:
            await wait_for(held, "step 3", sub=sub)
        yield pub, engines, sub
    finally:
        stop.set()
        await sub.task  # type: ignore[attr-defined]
        await sub.close()
        await pub.close()
        await engines[-1].stop()


async def test_a_restarted_engine_gets_the_served_state_at_the_next_poll(
    tmp_path: Path, key: Ed25519PrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    async with daemon_feeding_an_engine(tmp_path, key, True) as (_, engines, sub):
        engine = engines[0]
        served = HeldPolicy(3, state_digest(trainer_states(STATES)[3]).root)
        assert engine.weight_version == served.version and sub.status.engine_restarts == 0

        caplog.set_level(logging.INFO, logger="pulsesync.subscriber")
        await engine.stop()
        await asyncio.sleep(1.0)  # ten poll ticks with no engine
        restarted = VLLMStandIn(module_holding(trainer_states(STATES)[0]), port=engine.port)  # its launch weights
        engines.append(restarted)
        await restarted.start()
        await wait_for(lambda: restarted.weight_version == served.version, "the restarted engine holds step 3", 10)
        assert restarted.held_digests == [(3, served.digest)]  # the module holds step 3's bits
        assert sub.step == 3 and sub.status.engine_restarts == 1
        said = [r.getMessage() for r in caplog.records]
        assert sum("does not answer" in m for m in said) == 1
        assert sum("(restarted); sending it" in m for m in said) == 1
        await asyncio.sleep(0.5)  # later ticks find it holding the step: nothing more is sent
        assert restarted.held_digests == [(3, served.digest)] and sub.status.engine_restarts == 1


@pytest.mark.parametrize("loading", [False, True], ids=["restarted", "cold-start"])
async def test_an_engine_answering_during_a_backoff_ends_it_and_is_served_the_newest_step(
    tmp_path: Path, key: Ed25519PrivateKey, loading: bool
) -> None:
    """Syncs fail while the engine does not answer and back off (1, 2, 4, 8 s). An engine that comes back (restarted
    while newer steps were published) or answers for the first time (still loading at a cold start) is asked on
    every poll tick of the wait, ends it, and holds the newest step within a tick and one delivery; a restart is
    counted once, a first answer not at all."""
    backoff = {"retry_initial_seconds": 1.0, "retry_max_seconds": 60.0}
    async with daemon_feeding_an_engine(tmp_path, key, False, loading, **backoff) as (pub, engines, sub):
        newest = 3 if loading else 5
        if not loading:
            await engines[0].stop()
            await publish(pub, range(4, 6))
        await wait_for(lambda: sub.status.consecutive_failures >= 4, f"four failed syncs to step {newest}", 20)
        answering = VLLMStandIn(module_holding(trainer_states(STATES)[0]), port=engines[0].port)  # launch weights
        engines.append(answering)
        await answering.start()  # the daemon is now in an 8 s backoff
        served = HeldPolicy(newest, state_digest(trainer_states(STATES)[newest]).root)
        await wait_for(lambda: sub.step == newest, f"the engine answering holds step {newest}, served", 2.5, sub=sub)
        assert answering.weight_version == served.version and answering.held_digests == [(newest, served.digest)]
        assert sub.status.engine_restarts == (0 if loading else 1)  # counted (and logged) once, if a restart
