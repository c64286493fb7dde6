"""FAULT INJECTOR: an in-process HTTP proxy in front of a real S3 server (moto) that fails on cue.

A real server cannot be made to return a 503 SlowDown, reset a connection or cut a body short
on a schedule, so these tests put this proxy between the real aiobotocore client and the real
moto server. Requests are forwarded unchanged; each request consumes the next scheduled action.
"""

from __future__ import annotations

import asyncio
import time
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
    hang: bool = False  # while set, requests are read and never answered (an endpoint that went silent)
    hang_paths: tuple[str, ...] = ()  # requests whose path contains one of these are read and never answered
    hang_queries: tuple[str, ...] = ()  # ... or whose query string does (partNumber=2: inside a multipart upload)
    # A replica that copies in any order: a GET or HEAD of a path containing one of these is answered 404 for
    # this many seconds after the first request for it, then served (a payload arriving after its marker).
    late_paths: tuple[str, ...] = ()
    late_seconds: float = 0.0
    late_served: int = 0  # 404s answered for late paths
    hung: int = 0  # requests held unanswered
    trickle_seconds: float | None = None  # while set, GET bodies arrive one byte per this many seconds
    oversize: dict[str, int] = field(default_factory=dict)  # path suffix -> bytes of junk served in its place
    bytes_sent: int = 0  # body bytes delivered to the client
    sent: dict[str, int] = field(default_factory=dict)  # body bytes delivered, by request path (listings: by prefix)
    endpoint: str = ""
    _first_asked: dict[str, float] = field(default_factory=dict)

    async def start(self) -> str:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
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
        if (
            self.hang
            or any(part in request.path for part in self.hang_paths)
            or any(part in request.query_string for part in self.hang_queries)
        ):
            self.hung += 1
            await asyncio.sleep(3600)
        if request.method in ("GET", "HEAD") and any(part in request.path for part in self.late_paths):
            first = self._first_asked.setdefault(request.path, time.monotonic())
            if time.monotonic() - first < self.late_seconds:
                self.late_served += 1
                action = "404"
        if request.method == "GET" and (junk := self._oversized(request.path)) is not None:
            return await self._stream(request, junk, web.StreamResponse(status=200))
        if request.method == "GET" and self.trickle_seconds is not None and "list-type" not in request.query:
            async with self._session.get(self.upstream + request.path_qs, headers=self._forward(request)) as up:
                data = await up.read()
                response = web.StreamResponse(status=up.status, headers=self._forward(up))
            response.content_length = len(data)
            await response.prepare(request)
            for i in range(len(data)):
                await response.write(data[i : i + 1])
                self.bytes_sent += 1
                await asyncio.sleep(self.trickle_seconds)
            return response
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
        headers = self._forward(request)
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
        self.bytes_sent += len(data)
        where = request.path + (f"?prefix={request.query['prefix']}" if "list-type" in request.query else "")
        self.sent[where] = self.sent.get(where, 0) + len(data)
        return web.Response(status=status, headers=out_headers, body=data)

    @staticmethod
    def _forward(message: web.Request | aiohttp.ClientResponse) -> dict[str, str]:
        headers = {k: v for k, v in message.headers.items() if k.lower() not in _HOP_BY_HOP}
        if isinstance(message, web.Request):  # the client signed the Host it sent (SeaweedFS checks it)
            headers["Host"] = message.headers.get("Host", "")
        return headers

    def _oversized(self, path: str) -> int | None:
        return next((size for suffix, size in self.oversize.items() if path.endswith(suffix)), None)

    async def _stream(self, request: web.Request, size: int, response: web.StreamResponse) -> web.StreamResponse:
        """`size` junk bytes, whatever range was asked for: a server that ignores Range, or an object replaced."""
        response.content_length = size
        await response.prepare(request)
        block = b"\x00" * (1 << 20)
        try:
            for start in range(0, size, len(block)):
                await response.write(block[: min(len(block), size - start)])
                self.bytes_sent += min(len(block), size - start)
        except (ConnectionError, RuntimeError):  # the client hung up: what a bounded reader does
            pass
        return response
