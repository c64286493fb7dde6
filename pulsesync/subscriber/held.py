"""The served state: the verified record the sinks took last, and what guards changing it.

The fast and chain paths patch it in place, holding `lock` (a scrub or `apply_to` never reads it
half patched); `version` is bumped whenever it is about to change, so a reader that let go of the
lock knows to start over; `diverged` says a scrub found it differs from its digest.
"""

from __future__ import annotations

import asyncio
import threading

import torch

from pulsesync.errors import EngineError
from pulsesync.verified import VerifiedState


class HeldState:
    """The verified state served now (None before the first), its lock, version and divergence."""

    def __init__(self) -> None:
        self.served: VerifiedState | None = None
        self.lock = threading.Lock()  # held while the state is patched in place, written to the cache or read
        self.version = 0
        self.diverged: str | None = None  # why the state is not what its digest says: the next sync rebuilds it

    @property
    def step(self) -> int:
        """The served step, -1 before the first."""
        return self.served.step if self.served is not None else -1

    def begin_patch(self) -> None:
        """Take the lock to patch the served state in place (released by `end_patch`)."""
        self.lock.acquire()
        self.version += 1

    def end_patch(self) -> None:
        """Release the lock `begin_patch` took."""
        self.lock.release()

    def serve(self, verified: VerifiedState) -> None:
        """Serve this state from now on (it replaced or was patched from the one before)."""
        self.version += 1
        self.diverged = None
        self.served = VerifiedState(verified.step, verified.state, verified.digest, verified.files, verified.history)

    def copy_into(self, module: torch.nn.Module) -> None:
        """Overwrite a module's parameters and buffers in place with the served state, bit-exact.

        From another thread it waits for a sync that is patching the state; on the event loop's
        thread (where waiting would deadlock) it raises EngineError instead.
        """
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        if not self.lock.acquire(blocking=not on_loop):
            raise EngineError(f"apply_to: step {self.step} is being patched; call it after sync() returns")
        try:
            self._copy_into(module)
        finally:
            self.lock.release()

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
