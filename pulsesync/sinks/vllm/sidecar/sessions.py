"""How the vllm sink talks to an engine, by path: the weight-transfer backend or the worker extension.

A delivery needs the same few things of any engine: what it holds, where each rank keeps each
tensor, an apply that leaves every rank on the new state or on the old one, and the serving
controls around it (pause, prefix-cache reset, resume). `EngineSession` is that conversation;
`TransferSession` holds it through vLLM's weight-transfer verbs (`TransferVerbs`: over HTTP
here, or on an in-process `vllm.LLM` in `integrations.vllm_inprocess`), `ExtensionSession`
through `collective_rpc` into the worker extension. `Serving` is the serving side of a server
(HTTP) or of an in-process engine.

Which path a server offers is read from its launch config (`GET /server_info`, a dev-mode route
that changes nothing), never tried: a `collective_rpc` the workers cannot answer leaves vLLM's
executor broken, and the engine dies at its next step (vLLM 0.32, seen at TP=1 and TP=2).
"""

from __future__ import annotations

import contextlib
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pulsesync.errors import EngineError
from pulsesync.sinks.http import EngineClient, paused, reply_field, weight_version
from pulsesync.sinks.vllm.wire.replies import read_replies
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy, parse_version

EXTENSION_CLS = "pulsesync.sinks.vllm.engine.extension.PulseSyncWorkerExtension"
BACKEND = "pulsesync"
LAUNCH_FLAGS = {
    "weight_transfer": f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\'',
    "worker_extension": f"--worker-extension-cls {EXTENSION_CLS}",
}


class Serving(ABC):
    """The engine's serving side around an update."""

    where: str  # the engine, for messages

    @abstractmethod
    def paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Requests held by the engine for the body; released after it, also when it failed."""

    @abstractmethod
    async def resume(self) -> None:
        """Release requests a failed delivery may have left held (a no-op otherwise)."""

    @abstractmethod
    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (running requests' included); whether the engine did."""

    @abstractmethod
    async def is_sleeping(self) -> bool:
        """Whether the engine has released its weights (`/sleep`): nothing can be applied then."""


class EngineSession(ABC):
    """One delivery's conversation with an engine's workers."""

    where: str

    @abstractmethod
    async def held(self) -> HeldPolicy | None:
        """The step and digest every rank holds; None when unknown, or when the ranks disagree."""

    @abstractmethod
    async def version(self) -> HeldPolicy | None:
        """What the engine's weight version names (a cheap read, no worker RPC); None when not pulsesync's."""

    @abstractmethod
    async def layouts(self) -> list[dict[str, Any]]:
        """Each rank's layout (`EngineLayout.describe()` and its rank), in rank order."""

    @abstractmethod
    async def stage(self, paths: list[str], target: HeldPolicy) -> None:
        """Before the pause: hand over the update file(s) (one for all ranks, or one per rank).

        EngineError when a rank refuses; every rank then holds what it held before.
        """

    @abstractmethod
    async def apply(self, target: HeldPolicy) -> list[dict[str, Any]]:
        """Inside the pause: apply what was staged; each rank's result.

        EngineError when it did not land; every rank then holds what it held before.
        """


class HTTPServing(Serving):
    """A vLLM server's dev-mode serving routes."""

    def __init__(self, engine: EngineClient, pause_mode: str) -> None:
        self.engine, self.pause_mode, self.where = engine, pause_mode, engine.url

    def paused(self) -> contextlib.AbstractAsyncContextManager[None]:
        return paused(self.engine, f"/pause?mode={self.pause_mode}", "/resume")

    async def resume(self) -> None:
        await self.engine.post("/resume", {})

    async def reset_prefix_cache(self) -> bool:
        reply = await self.engine.post("/reset_prefix_cache?reset_running_requests=true", {})
        return isinstance(reply, dict) and reply.get("success") is True

    async def is_sleeping(self) -> bool:
        return reply_field(await self.engine.get("/is_sleeping"), "is_sleeping", bool, f"vllm sink: {self.where}")


async def collective_rpc(engine: EngineClient, method: str, *args: Any, timeout: float) -> list[dict[str, Any]]:
    """A worker-extension method run on every worker; their replies in rank order, each checked to be an object."""
    body = {"method": method, "args": list(args), "kwargs": {}, "timeout": timeout}
    reply = await engine.post("/collective_rpc", body)
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
        raise EngineError(f"vllm: {method} on {engine.url} answered {str(reply)[:300]!r}")
    return results


def agreed(helds: list[object]) -> HeldPolicy | None:
    """The step and digest all ranks report holding (`{"step", "digest"}` each); None unless they agree."""
    pairs = {(h.get("step"), h.get("digest")) if isinstance(h, dict) else None for h in helds}
    if len(pairs) != 1:
        return None
    (pair,) = pairs
    if pair is None or type(pair[0]) is not int or not isinstance(pair[1], str):
        return None
    return HeldPolicy(pair[0], pair[1])


async def offered_apis(engine: EngineClient) -> set[str] | None:
    """The pulsesync paths a vLLM server was launched with (`GET /server_info`); None when it does not say.

    `weight_transfer`: `weight_transfer_config.backend` is pulsesync's; `worker_extension`:
    `parallel_config.worker_extension_cls` is pulsesync's extension (or a subclass named so).
    """
    reply = await engine.get("/server_info?config_format=json", accept=(404,))
    config = reply.get("vllm_config") if isinstance(reply, dict) else None
    if not isinstance(config, dict):
        return None
    transfer, parallel = config.get("weight_transfer_config"), config.get("parallel_config")
    offered = set()
    if isinstance(transfer, dict) and transfer.get("backend") == BACKEND:
        offered.add("weight_transfer")
    extension = parallel.get("worker_extension_cls") if isinstance(parallel, dict) else None
    if isinstance(extension, str) and extension.rpartition(".")[2] == EXTENSION_CLS.rpartition(".")[2]:
        offered.add("worker_extension")
    return offered


async def choose_api(engine: EngineClient, configured: str) -> str:
    """The path to talk to a server on: the configured one, checked against its launch config, or (`auto`) the one
    it offers (the weight-transfer backend first). EngineError naming the launch flag or setting that fixes a
    mismatch, before any call that could fail inside vLLM."""
    offered = await offered_apis(engine)
    where = f"vllm sink: {engine.url}"
    if offered is None:
        if configured != "auto":
            return configured  # a server that does not show its config: the setting is taken as it is
        raise EngineError(
            f"{where} does not answer GET /server_info (start it with VLLM_SERVER_DEV_MODE=1, which the weight "
            "routes need too), so which pulsesync path it offers is unknown: set engine_api"
        )
    if configured in offered or (configured == "auto" and offered):
        return configured if configured != "auto" else min(offered, key=["weight_transfer", "worker_extension"].index)
    if not offered:
        raise EngineError(
            f"{where} was launched without pulsesync: add {LAUNCH_FLAGS['weight_transfer']} (or "
            f"{LAUNCH_FLAGS['worker_extension']}) to its launch"
        )
    (other,) = offered
    raise EngineError(
        f"{where} was launched with {LAUNCH_FLAGS[other]}, not {LAUNCH_FLAGS[configured]}: "
        f"set engine_api: {other} (or auto) in the vllm sink, or launch it with {LAUNCH_FLAGS[configured]}"
    )


class ExtensionSession(EngineSession):
    """The worker extension (`--worker-extension-cls`), through `POST /collective_rpc`."""

    def __init__(self, engine: EngineClient, timeout: float) -> None:
        self.engine, self.timeout, self.where = engine, timeout, engine.url
        self._paths: list[str] = []

    async def _rpc(self, method: str, *args: Any) -> list[dict[str, Any]]:
        return await collective_rpc(self.engine, method, *args, timeout=self.timeout)

    async def held(self) -> HeldPolicy | None:
        return agreed(list(await self._rpc("pulsesync_held")))

    async def version(self) -> HeldPolicy | None:
        return await weight_version(self.engine)

    async def layouts(self) -> list[dict[str, Any]]:
        return await self._rpc("pulsesync_layout")

    async def stage(self, paths: list[str], target: HeldPolicy) -> None:
        self._paths = paths  # the extension reads, prepares and applies in one call

    async def apply(self, target: HeldPolicy) -> list[dict[str, Any]]:
        paths = self._paths
        results = await self._rpc("pulsesync_apply", paths[0] if len(paths) == 1 else paths)
        # Readers of /weight_info (the rollout client) see it too; vLLM before 0.32 has no such route.
        await self.engine.post("/update_weight_version", {"new_version": target.version}, accept=(404,))
        return results


class TransferVerbs(ABC):
    """vLLM's weight-transfer verbs on one engine (the HTTP routes, or `vllm.LLM`'s methods)."""

    where: str

    @abstractmethod
    async def init(self, init_info: dict[str, Any]) -> None: ...

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    @abstractmethod
    async def finish(self, weight_version: str | None) -> None: ...

    @abstractmethod
    async def weight_version(self) -> str | None: ...


class HTTPVerbs(TransferVerbs):
    """The verbs as a vLLM server's dev-mode routes."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine, self.where = engine, engine.url

    async def init(self, init_info: dict[str, Any]) -> None:
        await self.engine.post("/init_weight_transfer_engine", {"init_info": init_info})

    async def start(self) -> None:
        await self.engine.post("/start_weight_update", {})

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        await self.engine.post("/update_weights", {"update_info": update_info})

    async def finish(self, weight_version: str | None) -> None:
        await self.engine.post("/finish_weight_update", {"weight_version": weight_version})

    async def weight_version(self) -> str | None:
        version = (await self.engine.get("/weight_info") or {}).get("weight_version")
        return version if isinstance(version, str) else None


class TransferSession(EngineSession):
    """pulsesync's weight-transfer backend (`engine.backend`) through vLLM's own verbs; replies come as files."""

    def __init__(self, verbs: TransferVerbs, directory: Path, options: dict[str, Any] | None = None) -> None:
        self.verbs, self.directory, self.where = verbs, directory, f"vllm sink: {verbs.where}"
        self.session = uuid.uuid4().hex
        # Init options (`TransferInit`): {"drill_rank", "drill_after"} makes a rank's next apply fail
        # (rollback drills); {"state_digest": True} has each rank hash what it holds (audits).
        self.options = options or {}
        self._init: list[dict[str, Any]] | None = None

    async def _ranks(self) -> list[dict[str, Any]]:
        """Every rank's answer to init: layout, held state, open session; a session left open is closed first."""
        if self._init is not None:
            return self._init
        info: dict[str, Any] = {"directory": str(self.directory), "session": self.session} | self.options
        self.directory.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            await self.verbs.init(info)
            replies = read_replies(self.directory, self.session, "init", self.where)
            if not any(r.get("open") for r in replies):
                self._init = replies
                return replies
            await self.verbs.finish(None)  # a sidecar died inside a session: end it (it rolls back)
        raise EngineError(f"{self.where}: a weight update session stays open after finish_weight_update")

    async def ranks(self) -> list[dict[str, Any]]:
        """Every rank's answer to init (`TransferWorker.init`), in rank order."""
        return await self._ranks()

    async def held(self) -> HeldPolicy | None:
        held = agreed([r.get("held") for r in await self._ranks()])
        if held is None or parse_version(await self.verbs.weight_version()) != held:
            return None  # the ranks disagree, or the engine's version is not theirs: never trusted
        return held

    async def version(self) -> HeldPolicy | None:
        return parse_version(await self.verbs.weight_version())

    async def layouts(self) -> list[dict[str, Any]]:
        return [dict(r.get("layout") or {}, rank=r["rank"]) for r in await self._ranks()]

    async def stage(self, paths: list[str], target: HeldPolicy) -> None:
        world = len(await self._ranks())
        per_rank = paths if len(paths) == world else paths[:1] * world
        await self.verbs.start()
        try:
            await self.verbs.update([{"session": self.session, "action": "stage", "path": p} for p in per_rank])
            failed = [r for r in read_replies(self.directory, self.session, "stage", self.where) if "error" in r]
        except BaseException:
            await self.verbs.finish(None)  # every rank drops what it staged
            raise
        if failed:
            await self.verbs.finish(None)
            self._raise(failed, target)

    async def apply(self, target: HeldPolicy) -> list[dict[str, Any]]:
        session, committed, failed = self.session, False, []
        try:
            await self.verbs.update({"session": session, "action": "apply"})
            applied = read_replies(self.directory, session, "apply", self.where)
            failed = [r for r in applied if "error" in r]
            if not failed:
                await self.verbs.update({"session": session, "action": "commit"})
                commits = read_replies(self.directory, session, "commit", self.where)
                committed = agreed([r.get("held") for r in commits]) == target
        finally:
            await self.verbs.finish(target.version if committed else None)  # uncommitted: every rank rolls back
        if not committed:
            self._raise(failed, target)
        return [r.get("result") or {} for r in applied]

    def _raise(self, failed: list[dict[str, Any]], target: HeldPolicy) -> None:
        """EngineError naming the first rank that failed and what every rank holds once the session finished."""
        finals = read_replies(self.directory, self.session, "finish", self.where)
        now = agreed([r.get("held") for r in finals])
        holds = f"step {now.step}" if now is not None else "an unknown state"
        rank, error = (failed[0]["rank"], failed[0]["error"]) if failed else (0, "the ranks did not all commit")
        raise EngineError(
            f"{self.where}: step {target.step} failed on rank {rank} ({error}); every rank is back on {holds}"
        )


@contextlib.asynccontextmanager
async def http_engine(
    url: str, api_key: str | None, timeout: float, pause_mode: str, api: str, directory: Path
) -> AsyncIterator[tuple[EngineSession, Serving]]:
    """A session with a vLLM server over HTTP on the path `choose_api` found, and its serving routes."""
    async with EngineClient(url, api_key, timeout) as engine:
        chosen = await choose_api(engine, api)
        session: EngineSession = (
            TransferSession(HTTPVerbs(engine), directory)
            if chosen == "weight_transfer"
            else ExtensionSession(engine, timeout)
        )
        yield session, HTTPServing(engine, pause_mode)
