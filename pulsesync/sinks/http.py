"""HTTP calls to an inference server's admin endpoints; any failure is an EngineError naming the call."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp

from pulsesync.errors import EngineError
from pulsesync.sinks.vllm.wire.weight_version import HeldPolicy, parse_version

T = TypeVar("T")


class EngineClient:
    """One session to a server: JSON in and out, a bearer token when configured, a deadline per call."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        # A new connection per call: vLLM drops the connection after a 500, and a pooled one would
        # then fail the `/resume` that must follow a failed update.
        connector = aiohttp.TCPConnector(force_close=True)
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self.timeout, connector=connector)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, path: str, body: dict[str, Any], *, accept: tuple[int, ...] = ()) -> Any:
        """POST body as JSON; the decoded reply. EngineError on no connection, or a status >= 300 not in accept."""
        return await self._call("POST", path, body, accept)

    async def get(self, path: str, *, accept: tuple[int, ...] = ()) -> Any:
        """GET; the decoded reply (EngineError as for post)."""
        return await self._call("GET", path, None, accept)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None, accept: tuple[int, ...]) -> Any:
        assert self._session is not None, "use EngineClient as an async context manager"
        url = self.url + path
        try:
            async with self._session.request(method, url, json=body) as response:
                text = (await response.read()).decode("utf-8", "replace")  # any bytes: never a decode crash
                if response.status >= 300 and response.status not in accept:
                    raise EngineError(f"{method} {url}: HTTP {response.status}: {text[:300]!r}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise EngineError(f"{method} {url}: {type(e).__name__}: {e}") from None
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            return text


def reply_field(reply: Any, field: str, kind: type[T], what: str) -> T:
    """`reply[field]` checked to be a `kind`; EngineError quoting the reply otherwise (engine replies are validated)."""
    value = reply.get(field) if isinstance(reply, dict) else None
    if not isinstance(value, kind):
        raise EngineError(f"{what}: expected {field!r} of type {kind.__name__} in the reply, got {str(reply)[:300]!r}")
    return value


@contextlib.asynccontextmanager
async def paused(
    engine: EngineClient, pause: str, resume: str, body: dict[str, Any] | None = None
) -> AsyncIterator[None]:
    """Generation paused for the body; resumed after it, also when it failed (that error wins)."""
    await engine.post(pause, body or {})
    try:
        yield
    except BaseException:
        with contextlib.suppress(EngineError):
            await engine.post(resume, {})
        raise
    await engine.post(resume, {})


async def weight_version(engine: EngineClient) -> HeldPolicy | None:
    """What `GET /weight_info` names, when it is a pulsesync version (another writer's string: unknown)."""
    return parse_version((await engine.get("/weight_info") or {}).get("weight_version"))
