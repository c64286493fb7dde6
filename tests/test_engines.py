"""Sinks and the subscribe CLI, fed by the real publisher.

vLLM and SGLang are not installable here. Their HTTP calls go to a local stand-in server (aiohttp on
127.0.0.1) that records every request; the vLLM stand-in runs pulsesync's real worker extension
on a real `transformers` model, so the apply logic is tested on real parameters.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.cli import main
from pulsesync.errors import EngineError
from pulsesync.protocol import signing
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.sinks import CommandSinkConfig, SGLangSinkConfig, VLLMSinkConfig
from pulsesync.sinks.vllm import INDEX_SUFFIX, PulseSyncWorkerExtension, apply_update, build_update
from pulsesync.store import FileStore
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from tests.support.helpers import assert_states_equal

transformers = pytest.importorskip("transformers")


def tiny_qwen2(seed: int = 0) -> Any:
    from tests.support.hf_trainer_proc import TINY_QWEN2

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**TINY_QWEN2)).to(torch.bfloat16)


def trained_states(steps: int) -> list[dict[str, torch.Tensor]]:
    """bf16 weights of a tiny Qwen2 trained in fp32 with AdamW, one state per step."""
    model = tiny_qwen2().float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    states = []
    for _ in range(steps):
        ids = torch.randint(0, 512, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append({n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()})
    return states


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    return trained_states(4)


@pytest.fixture
async def published(tmp_path: Path, states: list[dict[str, torch.Tensor]]) -> AsyncIterator[tuple[FileStore, Any]]:
    """Steps 0..3 of the tiny Qwen2 in a filesystem store, anchors every 2, with its config.json."""
    key = Ed25519PrivateKey.generate()
    store = FileStore(tmp_path / "store")
    config_json = tiny_qwen2().config.to_json_string().encode()
    pub = AsyncPublisher(PublisherConfig(anchor_interval=2, on_backpressure="block"), store=store, signing_key=key)
    async with pub:
        for step, state in enumerate(states):
            await pub.publish(step, state, {"config.json": config_json})
    yield store, signing.trusted_keys([key.public_key()])


class StandIn:
    """A local HTTP server standing in for an inference engine; records (path, body) of each request."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies  # path -> JSON reply, or a callable(body) -> reply
        self.requests: list[tuple[str, dict[str, Any]]] = []

    async def __aenter__(self) -> str:
        async def handle(request: web.Request) -> web.Response:
            body = await request.json() if request.can_read_body else {}
            self.requests.append((request.path, body))
            reply = self.replies.get(request.path)
            if reply is None:
                return web.Response(status=404)
            return web.json_response(reply(body) if callable(reply) else reply)

        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(16).reshape(1, 16)).logits


async def test_directory_sink_output_opens_with_from_pretrained_and_gives_the_publishers_logits(
    published: tuple[FileStore, Any], states: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    store, trusted = published
    sub = Subscriber(SubscriberConfig(out_dir=tmp_path / "out"), store=store, trusted=trusted)
    await sub.sync(2)
    await sub.sync()
    current = tmp_path / "out" / "current"
    assert current.is_symlink() and current.resolve().name == "step-000000000003"
    assert [p.name for p in sorted((tmp_path / "out").glob("step-*"))] == ["step-000000000002", "step-000000000003"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(current, dtype=torch.bfloat16)
    assert_states_equal(dict(loaded.state_dict()), states[3])
    # The publisher's model, saved and loaded the same way (from_pretrained keeps rotary buffers in
    # fp32, a model cast with .to(bf16) does not, so both sides must be loaded alike to compare).
    trainer_model = tiny_qwen2()
    trainer_model.load_state_dict(states[3])
    trainer_model.save_pretrained(tmp_path / "trainer")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trainer", dtype=torch.bfloat16)
    assert torch.equal(logits(loaded).view(torch.int16), logits(reference).view(torch.int16))


async def test_sglang_sink_pauses_updates_from_disk_and_continues(
    published: tuple[FileStore, Any], tmp_path: Path
) -> None:
    store, trusted = published
    replies: dict[str, Any] = {
        "/pause_generation": {},
        "/update_weights_from_disk": {"success": True, "message": "ok"},
        "/continue_generation": {},
    }
    stand_in = StandIn(replies)
    async with stand_in as url:
        config = SubscriberConfig(out_dir=tmp_path / "out", sinks=[SGLangSinkConfig(url=url)])
        sub = Subscriber(config, store=store, trusted=trusted)
        await sub.sync(2)
        assert stand_in.requests == [
            ("/pause_generation", {"mode": "retract"}),
            (
                "/update_weights_from_disk",
                {
                    "model_path": str(tmp_path / "out" / "step-000000000002"),
                    "weight_version": "step-2",
                    "flush_cache": True,
                },
            ),
            ("/continue_generation", {}),
        ]
        replies["/update_weights_from_disk"] = {"success": False, "message": "out of memory"}
        with pytest.raises(EngineError, match="refused step 3: out of memory"):
            await sub.sync()
        assert stand_in.requests[-1][0] == "/continue_generation"  # never left paused
        assert sub.step == 2  # the engine kept its weights; so does the subscriber
        replies["/update_weights_from_disk"] = {"success": True}
        assert (await sub.sync()).step == 3
        assert stand_in.requests[-2][1]["weight_version"] == "step-3"


class _Worker(PulseSyncWorkerExtension):
    """A vLLM worker stand-in: the extension's methods on a real transformers model."""

    def __init__(self, model: Any) -> None:
        self.model_runner = type("ModelRunner", (), {"model": model})()


async def test_vllm_sink_applies_sparse_updates_through_the_worker_extension(
    published: tuple[FileStore, Any], states: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    store, trusted = published
    engine = tiny_qwen2(seed=1)  # starts from other weights, like a server that loaded an old checkpoint
    worker = _Worker(engine)

    def collective_rpc(body: dict[str, Any]) -> dict[str, Any]:
        return {"results": [getattr(worker, body["method"])(*body["args"])]}

    stand_in = StandIn({"/collective_rpc": collective_rpc, "/reset_prefix_cache": {}})
    async with stand_in as url:
        sink = VLLMSinkConfig(url=url, update_dir=tmp_path / "updates")
        sub = Subscriber(SubscriberConfig(sinks=[sink]), store=store, trusted=trusted)
        for step in range(4):
            await sub.sync(step)
            assert_states_equal(dict(engine.state_dict()), states[step])
    calls = [(p, b.get("method")) for p, b in stand_in.requests]
    assert calls[:3] == [
        ("/collective_rpc", "pulsesync_param_shapes"),
        ("/collective_rpc", "pulsesync_apply"),
        ("/reset_prefix_cache", None),
    ]
    assert calls.count(("/collective_rpc", "pulsesync_apply")) == 4
    last = json.loads(json.dumps(stand_in.requests[-2][1]))["args"][0]
    assert Path(last).name == "update-000000000003.safetensors" and len(list((tmp_path / "updates").iterdir())) == 1


def test_update_files_are_sparse_where_the_engine_holds_whole_tensors(states: list[dict[str, torch.Tensor]]) -> None:
    from pulsesync.codec import UndoLog, apply_patch, encode_patch
    from pulsesync.digest import state_digest

    old, new = states[0], states[1]
    undo = UndoLog()  # the changed positions come from applying the real patch, as in the subscriber
    patched = {n: t.clone() for n, t in old.items()}
    digest = apply_patch(patched, encode_patch(old, new), undo=undo)
    assert digest is not None
    whole_names = {n: tuple(t.shape) for n, t in old.items() if "mlp" not in n}
    update = build_update(patched, digest, state_digest(old), undo.changed(), whole_names)
    assert any(k.endswith(INDEX_SUFFIX) for k in update) and any("mlp" in k and "::" not in k for k in update)
    engine = tiny_qwen2()
    engine.load_state_dict(old)
    counts = apply_update(engine, update)
    assert counts["sparse"] > 0 and counts["whole"] > 0
    assert_states_equal(dict(engine.state_dict()), new)

    class Fused(torch.nn.Module):  # vLLM-style: checkpoint names differ; load_weights maps them
        def __init__(self) -> None:
            super().__init__()
            self.fused = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
            self.loaded: list[str] = []

        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
            self.loaded += [name for name, _ in weights]

    fused = Fused()
    apply_update(fused, {"a.weight": torch.ones(2, 3, dtype=torch.bfloat16)})
    assert fused.loaded == ["a.weight"]
    with pytest.raises(EngineError, match="does not hold"):
        apply_update(fused, {"x" + INDEX_SUFFIX: torch.tensor([0]), "x::pulsesync_values": torch.ones(1)})


async def test_command_sink_gets_step_and_directory(published: tuple[FileStore, Any], tmp_path: Path) -> None:
    store, trusted = published
    record = tmp_path / "record.txt"
    env = "os.environ['PULSESYNC_STEP'] + ' ' + os.environ['PULSESYNC_DIR']"
    script = f"import os; open({str(record)!r}, 'a').write({env} + '\\n')"
    command = CommandSinkConfig(argv=[sys.executable, "-c", script])
    sub = Subscriber(SubscriberConfig(out_dir=tmp_path / "out", sinks=[command]), store=store, trusted=trusted)
    await sub.sync()
    step, directory = record.read_text().split()
    assert step == "3" and Path(directory) == tmp_path / "out" / "step-000000000003"
    failing = CommandSinkConfig(argv=[sys.executable, "-c", "raise SystemExit(3)"])
    sub = Subscriber(SubscriberConfig(sinks=[failing]), store=store, trusted=trusted)
    with pytest.raises(EngineError, match="exited with 3 at step 3"):
        await sub.sync()
    assert sub.state is None


def test_subscribe_cli_once_prints_the_path_and_fails_cleanly(
    published: tuple[FileStore, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, trusted = published
    pub_file = tmp_path / "trusted.pub"
    signing_pub = next(iter(trusted.values()))
    from cryptography.hazmat.primitives import serialization

    pub_file.write_bytes(
        signing_pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    flags = ["subscribe", "--store", store.url, "--trusted-key", str(pub_file), "--cache-dir", str(tmp_path / "c")]
    assert main([*flags, "--once", "--step", "1"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["step"], first["path"]) == (1, "slow") and first["bytes_downloaded"] > 0
    assert main([*flags, "--once"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert (second["step"], second["path"]) == (3, "chain") and set(second) == {
        "step",
        "path",
        "digest",
        "seconds",
        "bytes_downloaded",
    }
    signing.write_keypair(tmp_path / "other")
    stranger = ["subscribe", "--store", store.url, "--trusted-key", str(tmp_path / "other" / "publisher.pub")]
    assert main([*stranger, "--once"]) == 12
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UnknownKeyError" in err
    assert main(["subscribe", "--store", store.url, "--once"]) == 3
    assert "trusted_keys" in capsys.readouterr().err
