"""Deadlines on awaits that run the awaited work in the caller's own task.

asyncio.wait_for before Python 3.12 runs what it awaits in a task of its own: cancelled just as
that task ends in an error, it raises CancelledError and the error is dropped ("Task exception
was never retrieved"), e.g. a body's failed size check as a sync's deadline cancels the read.
asyncio.timeout (3.11+) cuts the caller's task off instead, so every error reaches the caller.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(seconds: float, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, cut off after `seconds` (asyncio.TimeoutError), in the caller's task."""
        async with asyncio.timeout(seconds):
            return await awaitable

else:  # (3.10: no asyncio.timeout; wait_for's own task, and its race, remain)

    async def within(seconds: float, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, cut off after `seconds` (asyncio.TimeoutError)."""
        return await asyncio.wait_for(awaitable, seconds)
