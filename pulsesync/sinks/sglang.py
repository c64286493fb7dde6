"""The `sglang` sink: load each verified step's directory into an SGLang server (replies as of 0.5.23).

After the directory sink wrote the step: `GET /model_info` (an engine whose `weight_version`
already names this step and digest gets nothing), `POST /pause_generation`, `POST
/update_weights_from_disk {"model_path": DIR, "weight_version": "pulsesync:N:DIGEST",
"flush_cache": true}`, then `POST /continue_generation`, also after a failure. SGLang answers a
failed load with HTTP 400 `{"success": false, "message": ...}` and sets `weight_version` only
after a load succeeded. A failure leaves weights pulsesync cannot name: SGLang's rollback reloads
the new path, and a cache flush blocked by running requests reports failure after the weights
changed; so the next delivery reloads the whole step. Generation pauses in `retract` or `abort`
mode only: `in_place` keeps requests whose cache blocks the flush (docs/engines.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.config import SGLangSinkConfig
from pulsesync.sinks.http import EngineClient, paused
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy
from pulsesync.verified import VerifiedState


def weight_version(state: VerifiedState) -> str:
    """The weight_version an SGLang server reports once it holds this state (the one format every engine path uses)."""
    return HeldPolicy(state.step, state.digest.root).version


class SGLangSink(Sink):
    """Hot-reloads an SGLang server from the step directory."""

    name = "sglang"

    def __init__(self, config: SGLangSinkConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self.serving: Path | None = None  # the directory the server loaded last: kept by the directory sink

    def pinned(self) -> set[Path]:
        """Directories the server reads from."""
        return {self.serving} if self.serving is not None else set()

    async def deliver(self, update: Update) -> None:
        """Bring the server to the update's state; EngineError naming what it then holds unless it succeeded."""
        if update.directory is None:
            raise EngineError("sglang sink: needs a directory sink (out_dir) to write the step first")
        version = weight_version(update.verified)
        async with EngineClient(self.url, self.config.api_key, self.config.timeout_seconds) as engine:
            if await self._version(engine) == version:
                self.serving = update.directory
                return
            body = {"model_path": str(update.directory), "weight_version": version, "flush_cache": True}
            async with paused(engine, "/pause_generation", "/continue_generation", {"mode": self.config.pause_mode}):
                reply = await engine.post("/update_weights_from_disk", body, accept=(400,))
                if _succeeded(reply):
                    self.serving = update.directory
                    return
                message = reply.get("message") if isinstance(reply, dict) else reply
                self.serving = None  # SGLang's rollback reloads the new path: its weights are unknown
                raise EngineError(
                    f"sglang sink: {self.url} failed step {update.step}: {message} "
                    "(its weights are unknown until a load succeeds)"
                )

    async def holds(self, state: VerifiedState | None) -> bool:
        """Whether `GET /model_info` names this state (a restarted server names its launch weights)."""
        async with EngineClient(self.url, self.config.api_key, self.config.timeout_seconds) as engine:
            version = await self._version(engine)
        return state is not None and version == weight_version(state)

    async def _version(self, engine: EngineClient) -> str | None:
        info = await engine.get("/model_info")
        version = info.get("weight_version") if isinstance(info, dict) else None
        return version if isinstance(version, str) else None


def _succeeded(reply: Any) -> bool:
    return isinstance(reply, dict) and reply.get("success") is True
