"""JSON POSTs to an inference server's admin endpoints; any failure is an EngineError naming the call."""

from __future__ import annotations

from typing import Any

import aiohttp

from pulsesync.errors import EngineError


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float) -> Any:
    """POST body as JSON; the decoded JSON reply (None if empty). EngineError on non-2xx or no connection."""
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            text = await response.text()
            if response.status >= 300:
                raise EngineError(f"POST {url}: HTTP {response.status}: {text[:300]}")
            if not text.strip():
                return None
            try:
                return await response.json(content_type=None)
            except ValueError:
                return text
    except (aiohttp.ClientError, TimeoutError) as e:
        raise EngineError(f"POST {url}: {type(e).__name__}: {e}") from None
