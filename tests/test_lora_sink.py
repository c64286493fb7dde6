"""The vllm_lora sink without vLLM: adapter directory names, and a stand-in of vLLM 0.32's LoRA routes.

The stand-in answers as vLLM 0.32's source does (entrypoints/openai/models/serving.py,
entrypoints/serve/lora/api_router.py): `GET /v1/models` lists each loaded adapter as a card
`{"id": name, "root": path, "parent": base}`; `POST /v1/load_lora_adapter` answers 200 with a
text, or an error object (`{"error": {"message", "type", "code"}}`, 400 for a second load of a
name without `load_inplace`, 500 when the engine refuses the adapter), and records the new path
only after the load succeeded. The real server: tests/test_vllm_lora.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from pulsesync.digest import state_digest
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Update
from pulsesync.sinks.config import VLLMLoRASinkConfig
from pulsesync.sinks.vllm.sidecar.lora import VLLMLoRASink
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy, adapter_dir_name, parse_adapter_dir
from pulsesync.verified import VerifiedState
from tests.support.servers import free_port

CONFIG = {"adapter_config.json": json.dumps({"r": 4, "target_modules": ["q_proj"]}).encode()}


def test_adapter_directory_names_say_their_step_and_digest_and_nothing_else_parses() -> None:
    policy = HeldPolicy(12, "ab12cd")
    assert adapter_dir_name(policy) == "pulsesync-000000000012-ab12cd"
    assert parse_adapter_dir(f"/dev/shm/adapters/{adapter_dir_name(policy)}/") == policy
    for other in (None, 3, "", "/a/b", "/a/pulsesync-x-ab", "/a/pulsesync-1-", "/a/pulsesync-1-a b", "x" * 5000):
        assert parse_adapter_dir(other) is None


class StandIn:
    """vLLM 0.32's LoRA routes and pause/resume; `refuse` makes the engine refuse the next adapters."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.refuse = False
        self.calls: list[str] = []
        self.models_reply: Any = None  # a hostile /v1/models reply, when set

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls.append(request.path)
        if request.path == "/v1/models":
            cards = [{"id": n, "root": p, "parent": "tiny"} for n, p in self.loaded.items()]
            return web.json_response(self.models_reply or {"object": "list", "data": [{"id": "tiny"}, *cards]})
        if request.path in ("/pause", "/resume"):
            return web.json_response({})
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        if name in self.loaded and not body.get("load_inplace"):
            return error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if self.refuse or not (Path(path) / "adapter_config.json").is_file():
            return error(500, "LoRA rank 16 is greater than max_lora_rank 8.", "InternalServerError")
        self.loaded[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


def error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def update(step: int, seed: int, files: dict[str, bytes] = CONFIG) -> Update:
    gen = torch.Generator().manual_seed(seed)
    state = {"base_model.model.q_proj.lora_A.weight": torch.randn(4, 8, generator=gen).to(torch.bfloat16)}
    return Update(VerifiedState(step, state, state_digest(state), dict(files)))


async def serve(standin: StandIn) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", standin.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_each_step_is_loaded_in_place_and_a_refused_one_leaves_the_last_served(tmp_path: Path) -> None:
    standin = StandIn()
    runner, url = await serve(standin)
    try:
        sink = VLLMLoRASink(VLLMLoRASinkConfig(url=url, adapter_name="policy", adapter_dir=tmp_path, keep=1))
        first, second = update(1, 0), update(2, 1)
        await sink.deliver(first)
        served = tmp_path / adapter_dir_name(HeldPolicy(1, first.digest.root))
        assert standin.loaded == {"policy": str(served)} and sink.pinned() == {served}
        assert standin.calls == ["/v1/models", "/pause", "/v1/load_lora_adapter", "/v1/models", "/resume"]
        standin.calls.clear()
        await sink.deliver(first)  # the server serves it already: nothing is loaded
        assert standin.calls == ["/v1/models"]

        standin.refuse = True
        refused = r"refused step 2 of adapter 'policy' .*max_lora_rank.*still serves step 1"
        with pytest.raises(EngineError, match=refused):
            await sink.deliver(second)
        assert standin.loaded == {"policy": str(served)} and sink.pinned() == {served}
        assert "/resume" in standin.calls  # generation resumed after the refusal
        assert served.is_dir()  # the served adapter's directory is kept

        standin.refuse = False
        await sink.deliver(second)
        now = tmp_path / adapter_dir_name(HeldPolicy(2, second.digest.root))
        assert standin.loaded == {"policy": str(now)}
        assert sorted(p.name for p in tmp_path.iterdir()) == [now.name]  # keep=1: the older one is gone

        with pytest.raises(EngineError, match=r"step 3 has no adapter_config.json"):
            await sink.deliver(update(3, 2, files={}))
        standin.models_reply = {"data": "not a list"}
        with pytest.raises(EngineError, match=r"expected 'data' of type list"):
            await sink.deliver(update(4, 3))
    finally:
        await runner.cleanup()
