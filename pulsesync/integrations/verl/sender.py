"""The actor side of the verl backend: each actor rank publishes its share of the step.

verl's `send_weights` runs on every actor rank with the same stream of full tensors (its engine
gathers one tensor at a time, `get_per_tensor_param`). Each rank keeps only the tensors it owns,
dealt by size so that every rank uploads about 1/N of the model, and publishes them through
pulsesync's sharded publisher (docs/sharding.md: plain tensors owned whole, one signed commit by
rank 0). No rank holds more than its share; a world of one publishes the whole model.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from pulsesync.errors import StoreError
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.coordinator import multi_rank


class TensorShare:
    """Which rank owns each tensor: the next tensor goes to the rank holding the fewest bytes so far.

    Every rank sees the same tensors in the same order, so every rank deals them the same way.
    """

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self._loads = [(0, r) for r in range(world)]  # (bytes held, rank): a heap

    def owns(self, tensor: torch.Tensor) -> bool:
        held, owner = heapq.heappop(self._loads)
        heapq.heappush(self._loads, (held + tensor.nbytes, owner))
        return owner == self.rank

    def keep(self, state: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
        """Copy the tensor to host memory into `state` if this rank owns it (the stream's tensors are transient)."""
        if self.owns(tensor):
            state[name] = tensor.detach().to("cpu", copy=True)


class StepSender:
    """Publishes verl's steps from one actor rank (blocking: verl's async method runs it in a thread)."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._publisher: Any = None

    def share(self) -> TensorShare:
        """How this rank deals the next step's stream of tensors."""
        return TensorShare(*_rank_and_world())

    def publish(self, step: int, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """Publish this rank's share of `step` and wait for the step's commit; what it cost, for verl's metrics."""
        if self._publisher is None:
            from pulsesync.publisher import Publisher

            self._publisher = Publisher(self.config)  # on several ranks: every rank, collectively, here
        self._publisher.publish(step, state)
        self._publisher.flush()
        report = self._publisher.reports[-1] if self._publisher.reports else None
        if report is None or report.step != step or not report.ok:
            raise self._publisher.last_error or StoreError(f"step {step}: not published (the publisher's log says why)")
        return {
            "pulsesync/wire_bytes": float(report.wire_bytes),
            "pulsesync/dense_bytes": float(report.dense_bytes),
            "pulsesync/anchor": float(report.kind == "anchor"),
        }

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None


def _rank_and_world() -> tuple[int, int]:
    if not multi_rank():
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()
