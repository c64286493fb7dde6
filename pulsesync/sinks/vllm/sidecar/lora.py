"""The `vllm_lora` sink: serve each verified step of a LoRA adapter from a vLLM server under one name.

The state is a PEFT adapter (`adapter_model.safetensors`'s tensors; `adapter_config.json` among
the anchor's files), published like any model; the base model is the server's own and changes
rarely or never. Each step is written as an adapter directory named for its step and digest
(`weight_version.adapter_dir_name`), then, while generation is paused (a running request would
otherwise finish under the next step's adapter), `POST /v1/load_lora_adapter {"lora_name",
"lora_path", "load_inplace": true}`. Each step has a path of its own, and vLLM keys cached prefix
blocks by the adapter's path (v1/core/kv_cache_utils.py), so no block computed under the previous
step is reused.

What the server holds is what `GET /v1/models` answers for the adapter: the path it was loaded
from, so its step and digest (`adapter_version`); the rollout client reads the same. vLLM 0.32
(entrypoints/openai/models/serving.py, lora/worker_manager.py) loads and validates the new
adapter before it evicts the old one and records the new path only after a load succeeded: a
refused load keeps the previous adapter served, and this sink then raises EngineError naming both.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from pulsesync.atomic_files import publish_dir
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.config import VLLMLoRASinkConfig
from pulsesync.sinks.http import EngineClient, reply_field
from pulsesync.sinks.vllm.sidecar.sessions import HTTPServing
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy, adapter_dir_name, parse_adapter_dir
from pulsesync.threads import in_thread_to_completion
from pulsesync.verified import VerifiedState

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


async def adapter_version(engine: EngineClient, name: str) -> HeldPolicy | None:
    """The step and digest of the adapter `name` a vLLM server serves (None: not loaded, or not pulsesync's)."""
    cards = reply_field(await engine.get("/v1/models"), "data", list, f"vllm lora: {engine.url}/v1/models")
    roots = [c.get("root") for c in cards if isinstance(c, dict) and c.get("id") == name]
    return parse_adapter_dir(roots[0]) if len(roots) == 1 else None


def write_adapter_dir(update: Update, out: Path) -> Path:
    """The step's adapter directory under `out` (written once; an existing one is what this step wrote)."""
    final = out / adapter_dir_name(HeldPolicy(update.step, update.digest.root))
    if ADAPTER_CONFIG not in update.files:
        raise EngineError(
            f"vllm lora sink: step {update.step} has no {ADAPTER_CONFIG} (publish the PEFT adapter's directory)"
        )
    if final.is_dir():
        return final
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({n: t.contiguous() for n, t in update.state.items()}, str(tmp / ADAPTER_WEIGHTS))
    for name, data in sorted(update.files.items()):
        (tmp / name).write_bytes(data)
    for child in tmp.iterdir():
        os.chmod(child, 0o644)  # engines in other containers often run as another user
    publish_dir(tmp, final)
    return final


class VLLMLoRASink(Sink):
    """Loads each step's adapter into a vLLM server in place, under the configured name."""

    name = "vllm_lora"

    def __init__(self, config: VLLMLoRASinkConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self.serving: Path | None = None  # the directory the server loaded last (it may read it again)

    def pinned(self) -> set[Path]:
        """The adapter directory the server serves from."""
        return {self.serving} if self.serving is not None else set()

    async def holds(self, state: VerifiedState | None) -> bool:
        """Whether the server serves this step's adapter under the name (`GET /v1/models`; a restart loses it)."""
        c = self.config
        async with EngineClient(self.url, c.api_key, c.timeout_seconds) as engine:
            version = await adapter_version(engine, c.adapter_name)
        return state is not None and version == HeldPolicy(state.step, state.digest.root)

    async def deliver(self, update: Update) -> None:
        """Serve the update's adapter; EngineError naming what the server still serves if it refused it."""
        c = self.config
        target = HeldPolicy(update.step, update.digest.root)
        directory = await in_thread_to_completion(write_adapter_dir, update, c.adapter_dir)
        async with EngineClient(self.url, c.api_key, c.timeout_seconds) as engine:
            held = await adapter_version(engine, c.adapter_name)
            if held != target:
                serving = HTTPServing(engine, c.pause_mode)
                body = {"lora_name": c.adapter_name, "lora_path": str(directory), "load_inplace": True}
                async with serving.paused():
                    reply = await engine.post("/v1/load_lora_adapter", body, accept=(400, 404, 500))
                    now = await adapter_version(engine, c.adapter_name)
                    if now != target:
                        what = f"step {now.step}" if now is not None else "no pulsesync step"
                        raise EngineError(
                            f"vllm lora sink: {self.url} refused step {update.step} of adapter {c.adapter_name!r} "
                            f"({str(reply)[:300]}); it still serves {what}"
                        )
        self.serving = directory
        self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` adapter directories, and the served one."""
        out = self.config.adapter_dir
        steps = sorted(p for p in out.iterdir() if parse_adapter_dir(p.name) is not None and p.is_dir())
        for old in steps[: -self.config.keep]:
            if old != self.serving:
                shutil.rmtree(old, ignore_errors=True)
