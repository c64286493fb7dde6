"""What a publishing rank does with each host copy the pipeline hands it: one ABC, two shapes of a step's objects.

A world of one publishes the whole model: a patch, or an anchor as an HF directory
(`publisher/whole.py`); the ranks of a sharded job each publish their part, rank 0 committing
for all (`publisher/sharded.py`). The pipeline around them (`publisher/pipeline.py`: lifecycle,
queue, backpressure, flush and close) is the same for both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pulsesync.dtypes import State
from pulsesync.publisher.host_copy import HostCopy, HostCopyPool
from pulsesync.publisher.report import StepReport

Record = Callable[[StepReport], None]  # the pipeline's: keeps a report and counts it in the metrics


class Rounds(ABC):
    """Turns host copies into committed object sets, in the order the pipeline hands them over."""

    run_id: str  # part of every object key this run writes: nothing is ever overwritten
    stream_id: str  # signed into every manifest; a restart adopts the prefix's
    # Every rank must publish the same steps: a failure stops the publisher instead of skipping a step.
    stops_on_failure = False
    # A host copy is made only once the steps before are committed: a rank holds its baseline and
    # one copy (2x its shard), never a queue of copies.
    copies_when_idle = False
    pool: HostCopyPool  # the host copies' buffers, recycled: the baseline's and those queued
    fatal: BaseException | None = None  # found after `publish` returned (a conflict met by a background anchor)

    @abstractmethod
    async def scan(self) -> int:
        """Read the prefix's markers (the stream to continue); returns the newest step there (-1: none)."""

    async def resume(self) -> None:  # noqa: B027 - a shape without a baseline to rebuild has nothing to do
        """Take up the baseline of the newest step (from cache_dir or rebuilt from the store), if configured."""

    @abstractmethod
    def copy(self, step: int, state: State, files: dict[str, bytes]) -> HostCopy:
        """What this rank publishes of `state`, copied to host memory (blocking; the trainer's thread)."""

    @abstractmethod
    async def publish(self, snap: HostCopy) -> None:
        """Publish one step: its objects uploaded, then its signed marker, then the baseline moved to it."""

    @abstractmethod
    def holds(self, snap: HostCopy) -> bool:
        """Whether the baseline holds this copy's buffers (else the pipeline returns them to the pool)."""

    @property
    @abstractmethod
    def owned_bytes(self) -> int:
        """Bytes of what this rank publishes of each step (its shard; a world of one: the model)."""

    @property
    def host_bytes(self) -> int:
        """Bytes of host copies held between steps: the baseline and the buffers kept for the next copy."""
        base = self.baseline()
        return sum(t.numel() * t.element_size() for t in base.values()) + self.pool.free_bytes

    @abstractmethod
    def baseline(self) -> State:
        """This rank's part of the last committed state, as held in host memory (empty before the first)."""

    @abstractmethod
    async def drain(self) -> None:
        """Wait for work that goes on after `publish` returned (a background anchor)."""

    @abstractmethod
    async def close(self) -> None:
        """Persist what a restart resumes from (cache_dir)."""
