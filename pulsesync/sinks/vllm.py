"""The `vllm` sink: the sidecar side of delivering verified states to a vLLM server (0.32 and later).

Engine side (docs/engines.md): start vLLM with the dev-mode endpoints and pulsesync's worker extension,

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --worker-extension-cls pulsesync.sinks.vllm_worker.PulseSyncWorkerExtension

Each delivery asks every worker what it holds (`pulsesync_held`). An engine that already holds
the state gets nothing; one that provably holds the previous state gets a delta (sparse where the
applied patches say which positions changed); any other (launch checkpoint, restart, failure)
gets a full update. Then: pause generation (`POST /pause`), apply on every worker
(`pulsesync_apply`, which validates before it changes anything), reset the prefix cache with
running requests (its reply must say success), and resume, also after a failure.

Under tensor parallelism each worker reports the region of each tensor it holds; a delta is cut
into one file per worker (`WeightUpdate.for_rank`), so each receives about its share of the
patch. A full update is one file for all: vLLM's loader shards whole checkpoint tensors itself.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from safetensors.torch import save_file

from pulsesync.atomic_files import replace_with
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.config import VLLMSinkConfig
from pulsesync.sinks.http import EngineClient, paused, reply_field
from pulsesync.sinks.vllm_worker import PulseSyncWorkerExtension
from pulsesync.sinks.weight_update import Region, WeightUpdate, build_update

__all__ = ["HeldPolicy", "PulseSyncWorkerExtension", "VLLMSink", "VLLMSinkConfig", "collective_rpc", "held_policy"]


class SentUpdate(NamedTuple):
    """What the last delivery sent: its step, base digest (None: full), tensor bytes, and each worker's reply."""

    step: int
    base: str | None
    nbytes: int
    workers: list[dict[str, Any]]  # pulsesync_apply's results: received_bytes, kept_bytes, seconds, ...


class HeldPolicy(NamedTuple):
    """The verified step (and its state digest) that every worker of an engine holds."""

    step: int
    digest: str


async def collective_rpc(engine: EngineClient, method: str, *args: Any, timeout: float) -> list[dict[str, Any]]:
    """A worker-extension method run on every worker; their replies in rank order, each checked to be an object."""
    body = {"method": method, "args": list(args), "kwargs": {}, "timeout": timeout}
    reply = await engine.post("/collective_rpc", body)
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
        raise EngineError(f"vllm: {method} on {engine.url} answered {str(reply)[:300]!r}")
    return results


async def held_policy(engine: EngineClient, timeout: float) -> HeldPolicy | None:
    """What every worker holds; None when a worker does not know (launch checkpoint, failure) or they disagree."""
    held = {(r.get("step"), r.get("digest")) for r in await collective_rpc(engine, "pulsesync_held", timeout=timeout)}
    if len(held) != 1:
        return None
    ((step, digest),) = held
    if type(step) is not int or not isinstance(digest, str):
        return None
    return HeldPolicy(step, digest)


def _save(update: WeightUpdate, path: Path) -> None:
    tensors, meta = update.to_file()
    save_file(tensors, str(path), metadata=meta)


class VLLMSink(Sink):
    """Delivers each verified state to a vLLM server: nothing, a delta or a full update, by what it holds."""

    name = "vllm"

    def __init__(self, config: VLLMSinkConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self.last_update: SentUpdate | None = None  # what the last delivery sent (not its tensors)

    async def _rpc(self, engine: EngineClient, method: str, *args: Any) -> list[dict[str, Any]]:
        return await collective_rpc(engine, method, *args, timeout=self.config.timeout_seconds)

    async def held(self, engine: EngineClient) -> str | None:
        """The state digest every worker holds, None when unknown or when the workers disagree."""
        held = await held_policy(engine, self.config.timeout_seconds)
        return held.digest if held is not None else None

    async def deliver(self, update: Update) -> None:
        """Bring the engine to the update's state; EngineError (naming what it holds) if it cannot."""
        async with EngineClient(self.url, self.config.api_key, self.config.timeout_seconds) as engine:
            held = await self.held(engine)
            if held == update.digest.root:  # a restarted sidecar, or a reset or resume that failed after the apply
                await self._reset_prefix_cache(engine, update)
                await engine.post("/resume", {})  # a no-op unless our own failed delivery left it paused
                return
            if reply_field(await engine.get("/is_sleeping"), "is_sleeping", bool, f"vllm sink: {self.url}/is_sleeping"):
                raise EngineError(f"vllm sink: {self.url} is sleeping; step {update.step} not delivered")
            layouts = await self._rpc(engine, "pulsesync_layout")
            aliases = reply_field(layouts[0], "aliases", dict, f"vllm sink: pulsesync_layout on {self.url}")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
                raise EngineError(f"vllm sink: pulsesync_layout on {self.url} answered aliases {str(aliases)[:300]!r}")
            skip = self._aliases(update, aliases)
            base = update.previous_digest if held is not None and update.previous_digest is not None else None
            if base is not None and base.root != held:
                base = None  # the engine holds neither this state nor the previous one: send everything
            changed = update.changes.positions if base is not None and update.changes is not None else None
            weights = build_update(update.step, update.state, update.digest, base, changed, skip)
            regions = [self._regions(layout, rank, update) for rank, layout in enumerate(layouts)]
            cut = base is not None and any(regions)  # a full update is sharded by vLLM's loader on each worker
            parts = [weights.for_rank(r, g) for r, g in enumerate(regions)] if cut else [weights]
            self.config.update_dir.mkdir(parents=True, exist_ok=True)
            paths = [self.config.update_dir / f"update-{update.step:012d}.{i}.safetensors" for i in range(len(parts))]
            for path, part in zip(paths, parts, strict=True):
                replace_with(path, partial(_save, part))
            try:
                async with paused(engine, f"/pause?mode={self.config.pause_mode}", "/resume"):
                    arg: str | list[str] = str(paths[0]) if len(paths) == 1 else [str(p) for p in paths]
                    replies = await self._rpc(engine, "pulsesync_apply", arg)
                    self.last_update = SentUpdate(weights.step, weights.base, weights.nbytes, replies)
                    await self._reset_prefix_cache(engine, update)
            finally:
                for path in paths:
                    path.unlink(missing_ok=True)  # the workers read them; they can be model-sized

    async def _reset_prefix_cache(self, engine: EngineClient, update: Update) -> None:
        reply = await engine.post("/reset_prefix_cache?reset_running_requests=true", {})
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise EngineError(
                f"vllm sink: {self.url} holds step {update.step} but did not reset its prefix cache ({reply!r})"
            )

    def _regions(self, layout: dict[str, Any], rank: int, update: Update) -> dict[str, Region]:
        """The regions the worker of this rank (the replies come in rank order) holds, checked against the state."""
        where = f"vllm sink: pulsesync_layout on {self.url}"
        if layout.get("rank", rank) != rank:
            raise EngineError(f"{where} answered rank {layout.get('rank')!r} in place {rank}")
        out = {}
        for name, spec in reply_field(layout, "regions", dict, where).items():
            try:
                out[name] = region = Region.from_reply(spec)
            except ValueError as e:
                raise EngineError(f"{where} answered, for {name!r}: {e}") from None
            tensor = update.state.get(name)
            if tensor is not None and tuple(tensor.shape) != region.shape:
                raise EngineError(f"{where} answered region {spec!r} for {name!r}, which is {tuple(tensor.shape)}")
        return out

    def _aliases(self, update: Update, aliases: dict[str, str]) -> set[str]:
        """Names the engine ties to another: sent once, and only when the state agrees they are equal."""
        tensors = update.digest.tensors
        for alias, name in aliases.items():
            if alias in tensors and name in tensors and tensors[alias] != tensors[name]:
                raise EngineError(
                    f"vllm sink: step {update.step} has {alias!r} unlike {name!r}, which the engine ties it to"
                )
        return set(aliases)
