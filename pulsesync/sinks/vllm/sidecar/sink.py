"""The `vllm` sink: the sidecar side of delivering verified states to a vLLM engine.

Engine side (docs/engines.md), either path:

- vLLM 0.32+: the `pulsesync` weight-transfer backend, registered by pulsesync's plugin entry point,
      VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
          --weight-transfer-config '{"backend": "pulsesync"}'
  (`engine_api: weight_transfer`; an in-process `vllm.LLM` takes the same backend through
  `integrations.vllm_inprocess`);
- any vLLM with `collective_rpc`:
  `--worker-extension-cls pulsesync.sinks.vllm.engine.extension.PulseSyncWorkerExtension`
  (`engine_api: worker_extension`).

`engine_api: auto` (the default) takes the path the server was launched with (`sidecar.sessions.choose_api`).

Each delivery asks the engine what it holds (`sidecar.sessions`). An engine that already holds the
state gets nothing; one that provably holds the previous state gets a delta (sparse where the
applied patches say which positions changed); any other (launch checkpoint, restart, another
writer, failure) gets a full update. Everything is decided, written and staged before the
engine is paused (each worker reads its file, validates it and prepares the modules it rebuilds);
inside the pause only the engine's own writes run: apply on every worker (rolled back on every
rank if any rank fails), reset the prefix cache with running requests (its reply must say
success), resume, also after a failure.

Under tensor parallelism each worker reports the region of each tensor it holds; a delta is cut
into one file per worker (`WeightUpdate.for_rank`), so each receives about its share of the
patch. A full update is one file for all: vLLM's loader shards whole checkpoint tensors itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from safetensors.torch import save_file

from pulsesync.atomic_files import replace_with
from pulsesync.errors import EngineError
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.config import VLLMSinkConfig
from pulsesync.sinks.http import EngineClient, reply_field, weight_version
from pulsesync.sinks.vllm.sidecar.sessions import EngineSession, Serving, http_engine
from pulsesync.sinks.vllm.wire.update_file import Region, WeightUpdate, build_update
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy
from pulsesync.verified import VerifiedState

__all__ = ["HeldPolicy", "SentUpdate", "VLLMSink", "VLLMSinkConfig"]

Connect = Callable[[], contextlib.AbstractAsyncContextManager[tuple[EngineSession, Serving]]]


class SentUpdate(NamedTuple):
    """What the last delivery sent: its step, base digest (None: full), tensor bytes, each worker's reply, timings."""

    step: int
    base: str | None
    nbytes: int
    workers: list[dict[str, Any]]  # each rank's apply result: received_bytes, kept_bytes, seconds, ...
    seconds: dict[str, float]  # prepare (before the pause: update files, the workers' staging); pause (requests
    # held) = apply + reset + round trips; paused_at: the wall-clock time the pause was asked for


def _save(update: WeightUpdate, path: Path) -> None:
    tensors, meta = update.to_file()
    save_file(tensors, str(path), metadata=meta)


class VLLMSink(Sink):
    """Delivers each verified state to a vLLM engine: nothing, a delta or a full update, by what it holds."""

    name = "vllm"

    def __init__(self, config: VLLMSinkConfig, connect: Connect | None = None) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        self._connect = connect  # an in-process engine's session; None: the server at `url`
        self.last_update: SentUpdate | None = None  # what the last delivery sent (not its tensors)

    def _engine(self) -> contextlib.AbstractAsyncContextManager[tuple[EngineSession, Serving]]:
        if self._connect is not None:
            return self._connect()
        c = self.config
        return http_engine(self.url, c.api_key, c.timeout_seconds, c.pause_mode, c.engine_api, c.update_dir)

    async def holds(self, state: VerifiedState | None) -> bool:
        """Whether the engine's weight version names this state (`GET /weight_info`; a restart reports "default")."""
        if self._connect is not None:
            async with self._connect() as (session, _):
                version = await session.version()
        else:
            async with EngineClient(self.url, self.config.api_key, self.config.timeout_seconds) as engine:
                version = await weight_version(engine)
        return state is not None and version == HeldPolicy(state.step, state.digest.root)

    async def deliver(self, update: Update) -> None:
        """Bring the engine to the update's state; EngineError (naming what it holds) if it cannot."""
        async with self._engine() as (session, serving):
            held = await session.held()
            if held is not None and held.digest == update.digest.root:  # a restarted sidecar, or a failed reset
                await self._reset_prefix_cache(serving, update.step)
                await serving.resume()  # a no-op unless our own failed delivery left it paused
                return
            if await serving.is_sleeping():
                raise EngineError(f"vllm sink: {serving.where} is sleeping; step {update.step} not delivered")
            started = time.perf_counter()
            layouts = await session.layouts()
            skip = self._aliases(update, self._aliases_of(layouts[0], session.where))
            base = update.previous_digest if held is not None and update.previous_digest is not None else None
            if base is not None and held is not None and base.root != held.digest:
                base = None  # the engine holds neither this state nor the previous one: send everything
            changed = update.changes.positions if base is not None and update.changes is not None else None
            weights = build_update(update.step, update.state, update.digest, base, changed, skip)
            shapes = {name: tuple(tensor.shape) for name, tensor in update.state.items()}
            await self._send(session, serving, layouts, weights, shapes, started)

    async def send(self, weights: WeightUpdate, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Hand the engine an update made elsewhere (verl's flushes, decoded): its base must be what it holds.

        The names the engine ties to another are left out, as a delivery leaves them out.
        """
        async with self._engine() as (session, serving):
            started = time.perf_counter()
            layouts = await session.layouts()
            for alias in self._aliases_of(layouts[0], session.where):
                weights.whole.pop(alias, None)
                weights.sparse.pop(alias, None)
            await self._send(session, serving, layouts, weights, shapes, started)

    async def _send(
        self,
        session: EngineSession,
        serving: Serving,
        layouts: list[dict[str, Any]],
        weights: WeightUpdate,
        shapes: Mapping[str, tuple[int, ...]],
        started: float,
    ) -> None:
        """Cut the update per worker (a delta), write, stage, then apply and reset inside the pause."""
        step = weights.step
        regions = [self._regions(layout, rank, shapes, session.where) for rank, layout in enumerate(layouts)]
        elsewhere = [self._elsewhere(layout, session.where) for layout in layouts]
        cut = weights.base is not None and (any(regions) or any(elsewhere))  # a full update: vLLM's loader shards it
        cuts = enumerate(zip(regions, elsewhere, strict=True))
        parts = [weights.for_rank(rank, g, e) for rank, (g, e) in cuts] if cut else [weights]
        self.config.update_dir.mkdir(parents=True, exist_ok=True)
        paths = [self.config.update_dir / f"update-{step:012d}.{i}.safetensors" for i in range(len(parts))]
        for path, part in zip(paths, parts, strict=True):
            replace_with(path, partial(_save, part))
        target = HeldPolicy(step, weights.digest)
        try:
            await session.stage([str(p) for p in paths], target)  # read, validated, prepared: still serving
            pausing = time.perf_counter()
            seconds = {"prepare": pausing - started, "paused_at": time.time()}
            async with serving.paused():
                applying = time.perf_counter()
                replies = await session.apply(target)
                resetting = time.perf_counter()
                await self._reset_prefix_cache(serving, step)
                seconds |= {"apply": resetting - applying, "reset": time.perf_counter() - resetting}
            seconds["pause"] = time.perf_counter() - pausing  # from asking for the pause to the resume's reply
            self.last_update = SentUpdate(weights.step, weights.base, weights.nbytes, replies, seconds)
        finally:
            for path in paths:
                path.unlink(missing_ok=True)  # the workers read them; they can be model-sized

    async def _reset_prefix_cache(self, serving: Serving, step: int) -> None:
        if not await serving.reset_prefix_cache():
            raise EngineError(f"vllm sink: {serving.where} holds step {step} but did not reset its prefix cache")

    def _regions(
        self, layout: dict[str, Any], rank: int, shapes: Mapping[str, tuple[int, ...]], where: str
    ) -> dict[str, Region]:
        """The regions the worker of this rank (the replies come in rank order) holds, checked against the state."""
        where = f"vllm sink: the layout of {where}"
        if layout.get("rank", rank) != rank:
            raise EngineError(f"{where} answered rank {layout.get('rank')!r} in place {rank}")
        out = {}
        for name, spec in reply_field(layout, "regions", dict, where).items():
            try:
                out[name] = region = Region.from_reply(spec)
            except ValueError as e:
                raise EngineError(f"{where} answered, for {name!r}: {e}") from None
            shape = shapes.get(name)
            if shape is not None and shape != region.shape:
                raise EngineError(f"{where} answered region {spec!r} for {name!r}, which is {shape}")
        return out

    def _elsewhere(self, layout: dict[str, Any], where: str) -> set[str]:
        """The names a rank's layout says other ranks hold (its experts, under expert parallelism)."""
        names = layout.get("elsewhere", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise EngineError(f"vllm sink: the layout of {where} answered elsewhere {str(names)[:300]!r}")
        return set(names)

    def _aliases_of(self, layout: dict[str, Any], where: str) -> dict[str, str]:
        """The names the engine ties to another (`{alias: name}`), from a worker's layout."""
        aliases = reply_field(layout, "aliases", dict, f"vllm sink: the layout of {where}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise EngineError(f"vllm sink: {where} answered aliases {str(aliases)[:300]!r}")
        return aliases

    def _aliases(self, update: Update, aliases: dict[str, str]) -> set[str]:
        """Names the engine ties to another: sent once, and only when the state agrees they are equal."""
        tensors = update.digest.tensors
        for alias, name in aliases.items():
            if alias in tensors and name in tensors and tensors[alias] != tensors[name]:
                raise EngineError(
                    f"vllm sink: step {update.step} has {alias!r} unlike {name!r}, which the engine ties it to"
                )
        return set(aliases)
