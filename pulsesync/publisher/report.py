"""What publishing one object set did: the step report behind the publisher's log line, metrics and manifest sizes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

from pulsesync import metrics
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import Sizes

log = logging.getLogger("pulsesync.publisher.steps")  # one line per object set: `pulsesync publish` prints them


class StepTiming(NamedTuple):
    """What a step took before its objects were made: the host copy, then the state digest."""

    snapshot_s: float
    digest_s: float


@dataclass
class StepReport:
    """What publishing one object set (a step's patch or anchor) did, for logs, metrics and callers."""

    step: int
    kind: layout.Kind
    ok: bool = False
    started: float = 0.0  # wall clock (time.time()) when making its objects began
    snapshot_s: float = 0.0
    digest_s: float = 0.0
    encode_s: float = 0.0  # patches: diff + compress; anchors: writing the shards
    upload_s: float = 0.0
    commit_s: float = 0.0
    dense_bytes: int = 0
    wire_bytes: int = 0
    changed_elements: int = 0
    elements: int = 0
    skipped_total: int = 0
    error: str | None = None

    @property
    def density(self) -> float:
        """Changed fraction of the elements."""
        return self.changed_elements / max(self.elements, 1)

    @property
    def ratio(self) -> float:
        """Dense bytes per wire byte."""
        return self.dense_bytes / max(self.wire_bytes, 1)

    def sizes(self) -> Sizes:
        """The sizes its manifest records."""
        return Sizes(dense_bytes=self.dense_bytes, wire_bytes=self.wire_bytes, changed_elements=self.changed_elements)

    def log_line(self) -> str:
        """One logfmt line."""
        fields: dict[str, Any] = {
            "step": self.step,
            "kind": self.kind,
            "ok": str(self.ok).lower(),
            "snapshot_s": f"{self.snapshot_s:.3f}",
            "digest_s": f"{self.digest_s:.3f}",
            "encode_s": f"{self.encode_s:.3f}",
            "upload_s": f"{self.upload_s:.3f}",
            "commit_s": f"{self.commit_s:.3f}",
            "changed": self.changed_elements,
            "density": f"{self.density:.5f}",
            "dense_bytes": self.dense_bytes,
            "wire_bytes": self.wire_bytes,
            "ratio": f"{self.ratio:.1f}",
            "skipped_total": self.skipped_total,
        }
        if self.error:
            fields["error"] = '"' + self.error.replace('"', "'") + '"'
        return "published " + " ".join(f"{k}={v}" for k, v in fields.items())

    def record(self) -> None:
        """Log the report and update the Prometheus metrics."""
        (log.info if self.ok else log.warning)("%s", self.log_line())
        if not self.ok:
            metrics.PUBLISH_FAILURES.labels(self.kind).inc()
            return
        for stage in ("snapshot", "digest", "encode", "upload", "commit"):
            metrics.PUBLISH_STAGE_SECONDS.labels(stage).observe(getattr(self, f"{stage}_s"))
        metrics.PUBLISHED.labels(self.kind).inc()
        metrics.WIRE_BYTES.labels(self.kind).inc(self.wire_bytes)
        metrics.LAST_STEP.set(self.step)
        if self.kind == "patch":
            metrics.DENSE_BYTES.inc(self.dense_bytes)
            metrics.CHANGED_ELEMENTS.inc(self.changed_elements)
            metrics.LAST_DENSITY.set(self.density)
            metrics.LAST_RATIO.set(self.ratio)
