"""FAULT INJECTOR: an in-process HTTP proxy in front of a real S3 server (moto) that fails on cue.

A real server cannot be made to return a 503 SlowDown, reset a connection or cut a body short
on a schedule, so these tests put this proxy between the real aiobotocore client and the real
moto server. Requests are forwarded unchanged; each request consumes the next scheduled action.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

_ERRORS = {
    "500": ("InternalError", "We encountered an internal error. Please try again."),
    "503": ("SlowDown", "Please reduce your request rate."),
    "403": ("AccessDenied", "Access Denied"),
    "404": ("NoSuchKey", "The specified key does not exist."),
}
_HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass
class FaultProxy:
    upstream: str
    schedule: list[str] = field(default_factory=list)  # "ok", "500", "503", "403", "404", "reset", "truncate"
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, action)
    down: bool = False  # while set, every connection is reset: the store is unreachable
    endpoint: str = ""

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    async def stop(self) -> None:
        await self._session.close()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        action = "reset" if self.down else self.schedule.pop(0) if self.schedule else "ok"
        self.seen.append((request.method, request.path, action))
        body = await request.read()
        if action in _ERRORS:
            code, message = _ERRORS[action]
            xml = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
            )
            return web.Response(status=int(action), body=xml.encode(), content_type="application/xml")
        if action == "reset":
            assert request.transport is not None
            request.transport.abort()  # the client sees its connection reset mid-request
            await asyncio.sleep(0.05)
            raise web.HTTPServiceUnavailable()  # never delivered: the socket is gone
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body
        ) as upstream:
            data = await upstream.read()
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            status = upstream.status
        if action == "truncate" and len(data) > 1:
            response = web.StreamResponse(status=status, headers=out_headers)
            response.content_length = len(data)  # promise everything, deliver half, hang up
            await response.prepare(request)
            await response.write(data[: len(data) // 2])
            assert request.transport is not None
            request.transport.close()
            return response
        if request.method == "HEAD":  # the object's size travels only in Content-Length
            out_headers["Content-Length"] = upstream.headers.get("Content-Length", "0")
            return web.Response(status=status, headers=out_headers)
        return web.Response(status=status, headers=out_headers, body=data)
