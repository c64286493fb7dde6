"""Prometheus metrics of the daemons, defined once per process (prometheus-client's model).

`serve(port)` exposes them on http://0.0.0.0:port/metrics.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from pulsesync.errors import ConfigError

log = logging.getLogger("pulsesync.metrics")

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)

# --- publisher -----------------------------------------------------------------------------------
PUBLISH_STAGE_SECONDS = Histogram(
    "pulsesync_publish_stage_seconds",
    "Seconds per publish stage (snapshot, digest, encode = diff + compress, upload, commit)",
    ["stage"],
    buckets=_SECONDS,
)
PUBLISHED = Counter("pulsesync_published_total", "Steps committed, by kind", ["kind"])
PUBLISH_FAILURES = Counter("pulsesync_publish_failures_total", "Publish attempts that failed, by kind", ["kind"])
SKIPPED_STEPS = Counter("pulsesync_skipped_steps_total", "Snapshots dropped because uploads fell behind")
WIRE_BYTES = Counter("pulsesync_wire_bytes_total", "Bytes uploaded, by kind", ["kind"])
DENSE_BYTES = Counter("pulsesync_dense_bytes_total", "Dense bytes of the published patch steps")
CHANGED_ELEMENTS = Counter("pulsesync_changed_elements_total", "Elements changed in published patches")
LAST_STEP = Gauge("pulsesync_publish_last_step", "Newest committed step")
LAST_DENSITY = Gauge("pulsesync_publish_density", "Changed fraction of the newest patch")
LAST_RATIO = Gauge("pulsesync_publish_ratio", "Dense bytes / wire bytes of the newest patch")

# --- store ---------------------------------------------------------------------------------------
STORE_RETRIES = Counter("pulsesync_store_retries_total", "Store calls retried after a transient error", ["op"])


def serve(port: int | None) -> None:
    """Serve /metrics on port (no-op when None)."""
    if port is None:
        return
    try:
        start_http_server(port)
    except OSError as e:
        raise ConfigError(f"metrics_port {port}: cannot serve /metrics ({e.strerror or e})") from None
    log.info("serving Prometheus metrics on :%d/metrics", port)
