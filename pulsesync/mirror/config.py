"""Mirror settings: the origin it follows (`store`), the store it copies to (`target`), its schedule and retention."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from pulsesync.config import Config
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.store.config import StoreConfig


class MirrorConfig(Config):
    """`pulsesync mirror`: copies each committed step of `store` (the origin, or another mirror) to `target`."""

    target: StoreConfig = Field(default_factory=StoreConfig, description="the store the mirror copies to")
    trusted_keys: list[Path] = Field(
        default_factory=list, description="the publisher's public keys: only steps whose markers they sign are copied"
    )
    stream_id: str | None = Field(
        None,
        description="copy only this publishing stream (a run's stream id, as `pulsesync inspect` shows it); null: "
        "the stream of the target's newest step, else of the origin's newest anchor when the target is empty",
    )
    interval_seconds: float = Field(1.0, gt=0, description="how often the daemon lists the origin for new steps")
    payload_wait_seconds: float = Field(
        30.0,
        ge=0,
        description="an object a verified marker lists that the origin does not hold yet (a replica that copies in "
        "any order) is read again for this long before the step is skipped this pass",
    )
    retention: RetentionPolicy | None = Field(
        None, description="prune the target by this policy after copying (null: the target keeps every step copied)"
    )
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics on this port")
