"""The served state: the verified record the sinks took last, and what guards changing it.

The fast and chain paths patch it in place inside `patching()`, which waits until no reader holds
it; a reader (the scrub, the cache's base write, `apply_to`) holds it inside `reading()`, which
waits while it is patched. Both are scopes on the event loop: a lease is given back by the
function that took it, work in a thread runs while its coroutine holds the lease, and nothing
ever blocks the loop to wait for one. `version` is bumped whenever the state is about to change,
so a reader that let go knows to start over; `diverged` says a scrub found it differs from its
digest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch

from pulsesync.errors import EngineError
from pulsesync.threads import in_thread_to_completion
from pulsesync.verified import VerifiedState


class HeldState:
    """The verified state served now (None before the first), its patch and read scopes, version and divergence."""

    def __init__(self) -> None:
        self.served: VerifiedState | None = None
        self.version = 0
        self.diverged: str | None = None  # why the state is not what its digest says: the next sync rebuilds it
        self.patched = False  # a sync is changing the state in place
        self._readers = 0
        self._changed: asyncio.Condition | None = None  # made on the loop that first uses a scope
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def step(self) -> int:
        """The served step, -1 before the first."""
        return self.served.step if self.served is not None else -1

    def _condition(self) -> asyncio.Condition:
        loop = asyncio.get_running_loop()
        if self._changed is None or self._loop is not loop:  # a scope is never open across two loops
            self._changed, self._loop = asyncio.Condition(), loop
        return self._changed

    @contextlib.asynccontextmanager
    async def patching(self) -> AsyncIterator[None]:
        """The scope in which the served state may be changed in place: it waits until no reader holds it."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self._readers == 0 and not self.patched)
            self.patched = True
            self.version += 1
        try:
            yield
        finally:
            async with changed:
                self.patched = False
                changed.notify_all()

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """The scope in which the served state is read whole: it waits while a sync patches it."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: not self.patched)
            self._readers += 1
        try:
            yield
        finally:
            async with changed:
                self._readers -= 1
                changed.notify_all()

    def serve(self, verified: VerifiedState) -> None:
        """Serve this state from now on (it replaced or was patched from the one before)."""
        self.version += 1
        self.diverged = None
        self.served = verified

    def copy_into(self, module: torch.nn.Module) -> None:
        """Overwrite a module's parameters and buffers in place with the served state, bit-exact.

        From another thread it waits for a sync that is patching the state; on the event loop's
        thread (where waiting would deadlock) it raises EngineError instead.
        """
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = self._loop
        if loop is None or running is loop or not loop.is_running():
            if self.patched:
                raise EngineError(f"apply_to: step {self.step} is being patched; call it after sync() returns")
            return self._copy_into(module)
        asyncio.run_coroutine_threadsafe(self._read_into(module), loop).result()

    async def _read_into(self, module: torch.nn.Module) -> None:
        async with self.reading():
            await in_thread_to_completion(self._copy_into, module)

    def _copy_into(self, module: torch.nn.Module) -> None:
        served = self.served
        if served is None:
            raise EngineError("apply_to: the subscriber holds no verified state yet")
        targets = dict(module.named_parameters()) | dict(module.named_buffers())
        missing = sorted(set(targets) - set(served.state))
        if missing:
            raise EngineError(f"apply_to: step {served.step} has no tensor {missing[0]!r} the module needs")
        with torch.no_grad():
            for name, target in targets.items():
                source = served.state[name]
                if source.dtype != target.dtype or source.shape != target.shape:
                    raise EngineError(
                        f"apply_to: {name!r} is {source.dtype} {tuple(source.shape)} at step {served.step}, "
                        f"the module's is {target.dtype} {tuple(target.shape)}"
                    )
                target.data.copy_(source)
