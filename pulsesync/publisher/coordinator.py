"""Who publishes a step together: a world of one (this process), or the ranks of a gloo process group.

The publisher's rounds exchange small descriptors (never tensors) through `all_gather` and
`broadcast`; on a world of one both are the identity, so one process is the world-of-one case of
the same code. A group is pulsesync's own (never the trainer's collectives), with its own timeout.
"""

from __future__ import annotations

import datetime as dt
from abc import ABC, abstractmethod
from typing import Any


class Coordinator(ABC):
    """This rank's place in the publishing world, and the two collectives a round uses."""

    rank: int
    world: int

    @abstractmethod
    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank (blocking)."""

    @abstractmethod
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (blocking)."""


class WorldOfOne(Coordinator):
    """One process publishing the whole model."""

    rank, world = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj


class GlooGroup(Coordinator):
    """The ranks of a torch.distributed job: a gloo group of pulsesync's own (or `group`, given)."""

    def __init__(self, timeout_seconds: float, group: Any = None) -> None:
        import torch.distributed as dist

        timeout = dt.timedelta(seconds=timeout_seconds)
        self.group = group if group is not None else dist.new_group(backend="gloo", timeout=timeout)
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._root = dist.get_global_rank(self.group, 0)

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]


def multi_rank() -> bool:
    """Whether this process is one rank of a torch.distributed job of several."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
