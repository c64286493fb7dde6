"""STAND-IN for a vLLM server in the soak test: the real vLLM takes minutes to start and one CPU core per process.

It serves vLLM 0.32's admin endpoints with the replies the real server gives (read from
vllm/entrypoints/rl/online/api_router.py and vllm/entrypoints/serve/dev, and checked end to end by
tests/test_vllm_engine.py and tests/test_vllm_transfer.py against the real server): POST
/pause?mode=..., POST /resume, GET /is_sleeping -> {"is_sleeping": false}, POST
/reset_prefix_cache -> {"success": true}; the weight-transfer routes (/init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update {"weight_version"}, GET /weight_info
-> {"weight_version": ...}, "default" at start, POST /update_weight_version), which run
pulsesync's real backend (`TransferWorker`) as a TP=1 worker does; and POST /collective_rpc ->
{"results": [...]} (HTTP 500 when the method raises), which runs the worker extension's methods;
GET /server_info?config_format=json -> {"vllm_config": {...}, ...} (vllm/entrypoints/serve/dev/server_info),
whose launch config names both pulsesync paths, as a server launched with both flags does.
Both drive a real `WeightApplier` on a module holding the state. After every update that lands
it records the digest of what the module holds, so a test can compare it with the publisher's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web
from safetensors import safe_open

from pulsesync.digest import state_digest
from pulsesync.sinks.vllm.engine.applier import WeightApplier
from pulsesync.sinks.vllm.engine.transfer_worker import TransferInit, TransferStep, TransferWorker
from pulsesync.sinks.vllm.wire.update_file import WeightUpdate
from tests.support.helpers import copying_loader


def module_holding(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose parameters are exactly `state` (zeros: the engine starts from its own checkpoint)."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(tensor), requires_grad=False))
    return root


@dataclass
class VLLMStandIn:
    """One stand-in server on 127.0.0.1; `held_digests` lists (step, digest of the module) after each apply."""

    model: torch.nn.Module
    held_digests: list[tuple[int, str]] = field(default_factory=list)
    paused: bool = False
    url: str = ""
    weight_version: str = "default"
    port: int = 0  # 0: any free port; a restarted stand-in takes its predecessor's

    async def start(self) -> str:
        self.applier = WeightApplier(self.model, copying_loader(self.model))
        self.worker = TransferWorker(lambda: self.applier, 0, 1)
        app = web.Application()
        for verb in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
            app.router.add_post(f"/{verb}", self._verb)
        app.router.add_get("/weight_info", self._weight_info)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.router.add_post("/reset_prefix_cache", self._reset)
        app.router.add_post("/collective_rpc", self._rpc)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _pause(self, request: web.Request) -> web.Response:
        self.paused = True
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def _reset(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def _verb(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        verb = request.path.strip("/")
        if verb == "init_weight_transfer_engine":
            self.worker.init(TransferInit(**body["init_info"]))
        elif verb == "start_weight_update":
            self.worker.start()
        elif verb == "update_weights":
            info = body["update_info"]
            step = TransferStep(**(info[0] if isinstance(info, list) else info))
            committed = step.action == "commit" and self.applier.pending is not None
            self.worker.step(step)
            if committed:
                self.held_digests.append((int(self.applier.held_step or 0), self._digest()))
        else:
            self.worker.finish()
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
        return web.json_response({"message": "ok"})

    async def _server_info(self, request: web.Request) -> web.Response:
        config = {
            "weight_transfer_config": {"backend": "pulsesync"},
            "parallel_config": {
                "worker_extension_cls": "pulsesync.sinks.vllm.engine.extension.PulseSyncWorkerExtension"
            },
        }
        return web.json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        self.weight_version = json.loads(await request.read())["new_version"]
        return web.json_response({"success": True, "new_version": self.weight_version})

    def _digest(self) -> str:
        return state_digest(dict(self.model.state_dict())).root

    async def _rpc(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        method, args = body["method"], body.get("args", [])
        try:
            result = self._call(method, args)
        except Exception as e:  # vLLM answers a failed collective_rpc with a 500 and the error
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=500)
        return web.json_response({"results": [result]})

    def _call(self, method: str, args: list[Any]) -> dict[str, Any]:
        if method == "pulsesync_layout":
            return self.applier.layout.describe()
        if method == "pulsesync_held":
            return self.applier.held()
        if method == "pulsesync_apply":
            with safe_open(args[0], framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
                meta = f.metadata()
            update = WeightUpdate.from_file(tensors, meta, args[0])
            result = self.applier.apply(update, args[0])
            self.held_digests.append((update.step, self._digest()))
            return result
        raise ValueError(f"no method {method}")
