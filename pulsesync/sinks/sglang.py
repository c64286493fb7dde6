"""The `sglang` sink: load each verified step's directory into an SGLang server.

After the directory sink wrote the step: `POST /pause_generation {"mode": "retract"}`, then
`POST /update_weights_from_disk {"model_path": DIR, "weight_version": "step-N", "flush_cache": true}`,
then `POST /continue_generation` (also when the update failed: SGLang keeps its old weights and
must not stay paused). The update's reply must say `"success": true`, else EngineError.
See SGLang's "SGLang for RL Systems" guide for these endpoints.
"""

from __future__ import annotations

from typing import Literal

import aiohttp
from pydantic import BaseModel, ConfigDict, Field

from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.http import post_json


class SGLangSinkConfig(BaseModel):
    """Tell an SGLang server to load each step's directory: pause, update_weights_from_disk, continue."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["sglang"] = "sglang"
    url: str = Field(description="the SGLang server, e.g. http://127.0.0.1:30000")
    pause_mode: Literal["retract", "in_place", "abort"] = Field("retract", description="how generation pauses")
    timeout_seconds: float = Field(600.0, gt=0, description="per request")


class SGLangSink(Sink):
    """Hot-reloads an SGLang server from the step directory."""

    name = "sglang"

    def __init__(self, config: SGLangSinkConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")

    async def deliver(self, update: Update) -> None:
        """Pause, update from disk, continue; EngineError unless SGLang reports success."""
        if update.directory is None:
            raise EngineError("sglang sink: needs a directory sink (out_dir) to write the step first")
        timeout = self.config.timeout_seconds
        body = {"model_path": str(update.directory), "weight_version": f"step-{update.step}", "flush_cache": True}
        async with aiohttp.ClientSession() as session:
            await post_json(session, f"{self.url}/pause_generation", {"mode": self.config.pause_mode}, timeout)
            try:
                reply = await post_json(session, f"{self.url}/update_weights_from_disk", body, timeout)
            finally:
                await post_json(session, f"{self.url}/continue_generation", {}, timeout)
        if not isinstance(reply, dict) or reply.get("success") is not True:
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise EngineError(f"sglang sink: {self.url} refused step {update.step}: {message}")
