"""Prometheus metrics of the daemons, defined once per process (prometheus-client's model).

`serve(port)` exposes them on http://0.0.0.0:port/metrics; `serve_with_health` adds /healthz.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest, start_http_server

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

# --- subscriber ----------------------------------------------------------------------------------
SYNC_SECONDS = Histogram("pulsesync_sync_seconds", "Seconds per successful sync, by path", ["path"], buckets=_SECONDS)
SYNC_FAILURES = Counter("pulsesync_sync_failures_total", "Syncs that ended without a new verified state")
FALLBACKS = Counter("pulsesync_fallbacks_total", "Falls back to the slow path, by reason (error class)", ["reason"])
VERIFICATION_FAILURES = Counter(
    "pulsesync_verification_failures_total", "Signature, SHA-256, digest or patch checks that failed", ["error"]
)
STORE_SYNCS = Counter("pulsesync_store_syncs_total", "Syncs whose state came through a store, by store", ["store"])
STORE_FALLBACKS = Counter(
    "pulsesync_store_fallbacks_total",
    "Steps a store of the subscriber's list did not deliver (taken from the next), by store and reason",
    ["store", "reason"],
)
STORE_MARKERS_REJECTED = Counter(
    "pulsesync_store_markers_rejected_total",
    "Ready markers a store of the subscriber's list offered that did not verify (another stream's, forged, "
    "replayed), by store and reason",
    ["store", "reason"],
)
ENGINE_RESTARTS = Counter(
    "pulsesync_engine_restarts_total",
    "Engines found holding something other than the served state (restarted) and sent it again, by sink",
    ["sink"],
)
BYTES_DOWNLOADED = Counter("pulsesync_bytes_downloaded_total", "Bytes read from the store")
SUBSCRIBER_STEP = Gauge("pulsesync_subscriber_step", "Step of the state being served")
LAG_STEPS = Gauge("pulsesync_lag_steps", "Newest ready step minus the served step")
LAG_SECONDS = Gauge("pulsesync_lag_seconds", "Seconds from publishing the served step to serving it")
CACHE_BYTES_WRITTEN = Counter(
    "pulsesync_cache_bytes_written_total", "Bytes written to cache_dir: journaled patches, whole base states", ["kind"]
)
HEALTHY = Gauge("pulsesync_healthy", "1 while the subscriber is healthy")
RETENTION_DELETED_OBJECTS = Counter(
    "pulsesync_retention_deleted_objects_total",
    "Objects retention deleted, by kind (marker, payload, tombstone, orphan)",
    ["kind"],
)
RETENTION_DELETED_BYTES = Counter(
    "pulsesync_retention_deleted_bytes_total",
    "Bytes retention deleted, by kind (payload: sizes from the signed manifests; orphan: as listed)",
    ["kind"],
)
RETENTION_SKIPPED = Counter(
    "pulsesync_retention_skipped_total", "Markers, tombstones and keys retention did not trust and left alone"
)
PAYLOAD_WAITS = Counter(
    "pulsesync_payload_waits_total",
    "Payloads a verified marker lists that were not there yet and were read again (a replica that keeps no order)",
)
MARKERS_REJECTED = Counter(
    "pulsesync_markers_rejected_total", "Ready markers skipped because they do not verify (forged, malformed, replayed)"
)

# --- mirror --------------------------------------------------------------------------------------
MIRROR_STEPS = Counter("pulsesync_mirror_steps_total", "Steps the mirror copied (their commit marker written)")
MIRROR_BYTES = Counter(
    "pulsesync_mirror_bytes_total",
    "Bytes the mirror read from the origin (in) and wrote to the target (out)",
    ["direction"],
)
MIRROR_LAG_STEPS = Gauge("pulsesync_mirror_lag_steps", "Steps committed at the origin that the target does not hold")
MIRROR_LAG_SECONDS = Gauge(
    "pulsesync_mirror_lag_seconds",
    "Seconds since the oldest step the target does not hold was published (0: caught up)",
)
MIRROR_SKIPPED = Counter(
    "pulsesync_mirror_skipped_total", "Origin markers the mirror did not copy: they or their objects do not verify"
)

SCRUBS = Counter(
    "pulsesync_scrubs_total",
    "Full state digests compared with the incrementally kept one, by role and result (ok, mismatch)",
    ["role", "result"],
)
SCRUBBED_BYTES = Counter("pulsesync_scrubbed_bytes_total", "Bytes of held state the scrub re-hashed", ["role"])

# --- rollouts (pulsesync.integrations.rollout, in the trainer's process) ------------------------------
ROLLOUT_POLICY_LAG = Gauge(
    "pulsesync_rollout_policy_lag_steps", "Trainer step minus the policy step that generated the newest batch"
)
ROLLOUT_LAG_WAIT_SECONDS = Histogram(
    "pulsesync_rollout_lag_wait_seconds",
    "Seconds a batch waited for the engine to come within max_lag",
    buckets=_SECONDS,
)
ROLLOUT_RETRIES = Counter(
    "pulsesync_rollout_retries_total", "Batches generated again because the engine's policy changed while they ran"
)

# --- store ---------------------------------------------------------------------------------------
STORE_RETRIES = Counter("pulsesync_store_retries_total", "Store calls retried after a transient error", ["op"])
STORE_FOLDERS_SKIPPED = Counter(
    "pulsesync_store_folders_skipped_total", "Folders a file store listing could not read and passed over"
)
STORE_UNEXPECTED_ERRORS = Counter(
    "pulsesync_store_unexpected_errors_total", "Store calls that raised an exception of no known kind (logged)", ["op"]
)
STORE_DELETES_REFUSED = Counter(
    "pulsesync_store_deletes_refused_total", "Keys a file store would not delete: their folder leads outside its root"
)


async def serve_with_health(port: int, health: Callable[[], tuple[bool, dict[str, Any]]]) -> web.AppRunner:
    """Serve /metrics and /healthz (200 or 503 with a JSON body) on port; returns the runner to clean up."""

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        ok, body = health()
        return web.json_response(body, status=200 if ok else 503)

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics_page), web.get("/healthz", healthz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "0.0.0.0", port).start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"metrics_port {port}: cannot serve /metrics ({e.strerror or e})") from None
    log.info("serving /metrics and /healthz on :%d", port)
    return runner


def serve(port: int | None) -> None:
    """Serve /metrics on port (no-op when None)."""
    if port is None:
        return
    try:
        start_http_server(port)
    except OSError as e:
        raise ConfigError(f"metrics_port {port}: cannot serve /metrics ({e.strerror or e})") from None
    log.info("serving Prometheus metrics on :%d/metrics", port)
