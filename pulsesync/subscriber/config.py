"""Subscriber settings: trusted keys, local cache, polling and backoff, sinks."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from pulsesync.config import Config
from pulsesync.protocol.fleet import SUBSCRIBER_ID
from pulsesync.sinks import SinkConfig
from pulsesync.store.config import StoreConfig


class SubscriberConfig(Config):
    """`pulsesync subscribe` and the in-process Subscriber."""

    trusted_keys: list[Path] = Field(default_factory=list, description="public keys whose manifests are accepted")
    stores: list[StoreConfig] = Field(
        default_factory=list,
        description="the stores to read, in order of preference: a regional mirror first, the origin last; each "
        "verified end to end, a step one does not deliver is taken from the next (empty: `store` alone)",
    )
    max_lag_seconds: float = Field(
        30.0,
        gt=0,
        description="with several stores: a store lags once the next store's pointer has named a newer step for this "
        "long (read only while the store's newest step is older than this): the step is taken from the next store",
    )
    payload_wait_seconds: float = Field(
        20.0,
        ge=0,
        description="a payload a verified marker lists that is not there yet (a replica that copies in any order) is "
        "read again for this long before the step counts as withheld",
    )
    cache_dir: Path | None = Field(None, description="the verified state persists here; a restart resumes from it")
    cache_journal_ratio: float = Field(
        2.0,
        ge=0,
        description="cache_dir keeps a base state and journals each fast-path patch after it; past this many times "
        "the state's bytes of journal, the state is written as the new base (amortized: the patch plus half of it "
        "per step at 2.0; a restart replays at most this much); 0: always write the whole state",
    )
    out_dir: Path | None = Field(None, description="shorthand for a `directory` sink writing here")
    step: int | None = Field(None, ge=0, description="sync to this step instead of the newest")
    poll_seconds: float = Field(2.0, gt=0, description="how often the daemon polls for new ready markers")
    poll_pointer: bool = Field(
        True,
        description="poll the publisher's pointer object with a conditional GET and list ready markers only when it "
        "changed (a 304 costs a GET, 12.5x less than a LIST on S3 and R2); false: list every poll",
    )
    list_every_seconds: float = Field(
        60.0, gt=0, description="with poll_pointer, list at least this often anyway (a pointer that stopped changing)"
    )
    advisory_deadline_seconds: float = Field(
        5.0,
        gt=0,
        description="the longest a daemon waits on an advisory object (the pointer read, its fleet status write); "
        "past it the pointer counts as unreadable (a LIST instead) and the status write is skipped",
    )
    fleet_status: bool = Field(
        True, description="the daemon writes fleet/{subscriber_id}.json: what it serves, for inspect and retention"
    )
    subscriber_id: str | None = Field(
        None,
        pattern=SUBSCRIBER_ID,
        description="this subscriber's name in the fleet; default: the host name and a hash of cache_dir (or the pid)",
    )
    fleet_status_seconds: float = Field(60.0, gt=0, description="rewrite the fleet status at least this often")
    retry_initial_seconds: float = Field(1.0, gt=0, description="first wait after a failed sync; doubles each time")
    retry_max_seconds: float = Field(60.0, gt=0, description="longest wait between failed syncs")
    unhealthy_after: int = Field(5, ge=1, description="consecutive failed syncs before /healthz reports unhealthy")
    once_attempts: int = Field(
        3, ge=1, description="syncs --once tries before giving up (one for errors a retry meets again)"
    )
    stream_id: str | None = Field(
        None,
        pattern=r"^[0-9a-z]{1,32}$",
        description="accept only manifests of this publishing stream; default: the stream of the first verified "
        "state, kept across restarts in cache_dir",
    )
    reset_stream: bool = Field(
        False,
        description="at start, follow the store's newest publishing stream instead of the one cache_dir learned "
        "(a cache of another stream is then discarded); for a deliberate switch to a new run, not for a daemon's "
        "standing config",
    )
    sync_deadline_seconds: float = Field(
        1800.0, gt=0, description="a sync running longer is cut off (DeadlineError); /healthz reports one that is not"
    )
    scrub_interval_seconds: float | None = Field(
        3600.0,
        gt=0,
        description="the daemon re-hashes the whole served state this often, against the digest kept incrementally "
        "(catches memory corruption; a mismatch rebuilds from an anchor); null: never",
    )
    scrub_bytes_per_second: float = Field(
        256 << 20, gt=0, description="how fast a scrub reads the state: it shares the cores with the engine"
    )
    sinks: list[SinkConfig] = Field(default_factory=list, description="where verified states go, in order")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve /metrics and /healthz on this port")

    @model_validator(mode="after")
    def _one_store_list(self) -> SubscriberConfig:
        if self.stores and self.store.url is not None:
            raise ValueError("give `store` (one store) or `stores` (a list, the origin last), not both")
        return self

    @property
    def store_list(self) -> list[StoreConfig]:
        """The stores to read, in order: `stores`, or `store` alone."""
        return list(self.stores) or [self.store]
