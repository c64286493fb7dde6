"""Retention settings: what the worker keeps, its grace period and schedule."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pulsesync.config import Config


class RetentionPolicy(BaseModel):
    """What the retention worker keeps (PULSE's defaults: the newest 100 patches and 10 anchors)."""

    model_config = ConfigDict(extra="forbid")

    keep_patches: int = Field(
        100, ge=0, description="newest patches kept, with every patch and anchor on their chains back to an anchor"
    )
    keep_anchors: int = Field(10, ge=0, description="newest anchors kept")
    grace_seconds: float = Field(
        600.0,
        ge=0,
        description="payloads are deleted this long after their ready marker; longer than the slowest reader's "
        "download, and unreferenced payloads must be this old (a publish may still be uploading them)",
    )
    fleet_ttl_seconds: float = Field(
        3600.0,
        ge=0,
        description="also keep the patches a subscriber needs to catch up when its fleet status is this recent "
        "(0: ignore the fleet)",
    )
    fleet_max_lag: int = Field(
        500, ge=0, description="...but only for a subscriber at most this many steps behind (it takes the slow path)"
    )
    interval_seconds: float = Field(3600.0, gt=0, description="time between runs of the retention daemon")
    dry_run: bool = Field(False, description="print the plan, delete nothing")


class RetentionConfig(Config, RetentionPolicy):
    """`pulsesync retain`: the retention worker."""

    trusted_keys: list[Path] = Field(
        default_factory=list, description="the publisher's public keys: only markers they sign are read"
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics on this port")
