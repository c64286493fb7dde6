"""The publisher daemon and in-process API: patches every step, anchors every k, ready markers last."""

from pulsesync.publisher.pipeline import AsyncPublisher, FileSource, Publisher, StepReport

__all__ = ["AsyncPublisher", "FileSource", "Publisher", "StepReport"]
