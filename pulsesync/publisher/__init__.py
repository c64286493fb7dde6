"""The publisher: patches every step, anchors every k, ready markers last.

`pipeline` runs the steps, the same on one process and on every rank of a multi-rank trainer;
`coordinator` is the publishing world (one process, or a gloo group); `rounds` turn each step into
objects: `whole` the whole model's, `sharded` a rank's part (rank 0 commits); `ownership` keeps a
prefix to one stream; `schedule` decides anchors (pure); `commit` builds manifests and writes ready
markers; `resume` rebuilds the baseline; `host_copy` takes the trainer's state and files; `report`
is what a step did; `sources` and `checkpoints` feed it from a process beside a trainer.
"""

from pulsesync.publisher.config import PublisherConfig, WatchConfig
from pulsesync.publisher.host_copy import FileSource, HostCopy
from pulsesync.publisher.pipeline import AsyncPublisher, Publisher
from pulsesync.publisher.report import StepReport

__all__ = ["AsyncPublisher", "FileSource", "HostCopy", "Publisher", "PublisherConfig", "StepReport", "WatchConfig"]
