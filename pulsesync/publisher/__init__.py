"""The publisher: patches every step, anchors every k, ready markers last.

`pipeline` runs the steps, the same on one process and on every rank of a multi-rank trainer;
`coordinator` is the publishing world (one process, or a gloo group); `rounds` turn each step into
objects: `whole` the whole model's, `sharded` a rank's part (rank 0 commits); `ownership` keeps a
prefix to one stream; `schedule` decides anchors (pure); `commit` builds manifests and writes ready
markers; `resume` rebuilds the baseline; `host_copy` takes the trainer's state and files; `report`
is what a step did; `sources` and `checkpoints` feed it from a process beside a trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

# Submodules load on first use: the settings (`config` modules) import without torch, numba or aiobotocore.
__getattr__, __dir__, __all__ = lazy_loader.attach(
    __name__,
    submod_attrs={
        "config": ["PublisherConfig", "WatchConfig"],
        "host_copy": ["FileSource", "HostCopy"],
        "pipeline": ["AsyncPublisher", "Publisher"],
        "report": ["StepReport"],
    },
)

if TYPE_CHECKING:
    from pulsesync.publisher.config import PublisherConfig as PublisherConfig
    from pulsesync.publisher.config import WatchConfig as WatchConfig
    from pulsesync.publisher.host_copy import FileSource as FileSource
    from pulsesync.publisher.host_copy import HostCopy as HostCopy
    from pulsesync.publisher.pipeline import AsyncPublisher as AsyncPublisher
    from pulsesync.publisher.pipeline import Publisher as Publisher
    from pulsesync.publisher.report import StepReport as StepReport
