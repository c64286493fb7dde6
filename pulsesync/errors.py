"""Every failure pulsesync reports, one class per kind, each with its own CLI exit code.

Messages name the object (key, step, tensor) and the expectation that failed, so one
stderr line is enough to act on.
"""

from __future__ import annotations

from typing import ClassVar


class PulseSyncError(Exception):
    """Base class of every error pulsesync raises on purpose."""

    exit_code: ClassVar[int] = 1


class ConfigError(PulseSyncError):
    """A configuration file, flag or argument is invalid."""

    exit_code = 3


class StoreError(PulseSyncError):
    """The object store failed or refused a request."""

    exit_code = 4


class AccessDeniedError(StoreError):
    """The store refused a request for lack of permission (403): never retried."""

    exit_code = 16


class NotFoundError(StoreError):
    """A key that must exist does not (e.g. pruned by retention)."""

    exit_code = 5


class NothingPublishedError(NotFoundError):
    """The prefix holds no ready step yet: the normal start of a run (a daemon waits; `--once` exits with it)."""

    exit_code = 22


class BucketNotFoundError(NotFoundError):
    """The store's bucket does not exist: create it first (pulsesync never creates buckets)."""

    exit_code = 23


class ConflictError(StoreError):
    """A key that must not exist does (put-if-absent lost, step already published)."""

    exit_code = 6


class IntegrityError(PulseSyncError):
    """Data does not match what was promised (hash, size or state digest mismatch)."""

    exit_code = 7


class CorruptPatchError(IntegrityError):
    """A patch is malformed: truncated, flipped bytes, lying sizes, out-of-bounds positions."""

    exit_code = 8


class ManifestError(IntegrityError):
    """A manifest is not valid JSON or does not match the manifest schema."""

    exit_code = 9


class UnsupportedVersionError(IntegrityError):
    """A patch or manifest has a format version this pulsesync cannot read."""

    exit_code = 10


class SignatureError(IntegrityError):
    """A manifest's Ed25519 signature does not verify (tampered or signed by another key)."""

    exit_code = 11


class UnknownKeyError(SignatureError):
    """A manifest is signed by a key id that is not among the trusted keys."""

    exit_code = 12


class ReplayError(IntegrityError):
    """A manifest's step is not newer than the state already held (replayed or stale)."""

    exit_code = 13


class UnsupportedDtypeError(PulseSyncError):
    """A tensor has a dtype pulsesync does not encode (complex, sub-byte, ...)."""

    exit_code = 15


class EngineError(PulseSyncError):
    """An inference engine refused or failed a weight update (what it then holds: docs/engines.md)."""

    exit_code = 14


class DeadlineError(PulseSyncError):
    """A sync did not finish within its deadline (a store or an engine that stopped answering)."""

    exit_code = 17


class LocalWriteError(PulseSyncError):
    """Writing to local disk failed (disk full, permissions): the state served stays the last good one."""

    exit_code = 18


class ForeignStreamError(IntegrityError):
    """A validly signed manifest belongs to another publishing stream (another run or prefix)."""

    exit_code = 19


class MissingReferenceError(IntegrityError):
    """A history-coded patch needs the reference patch's history, and the one held is absent or another."""

    exit_code = 20


class PolicyLagError(EngineError):
    """A rollout engine did not reach a policy step recent enough (`max_lag`) in time, or holds a newer one."""

    exit_code = 21


class StaleStoreError(StoreError):
    """A store of a subscriber's list lags: the next store named a newer step `max_lag_seconds` ago (the step is
    then taken from the next store; it never ends a sync)."""

    exit_code = 24


ALL_ERRORS: tuple[type[PulseSyncError], ...] = (
    PulseSyncError,
    ConfigError,
    StoreError,
    AccessDeniedError,
    NotFoundError,
    NothingPublishedError,
    BucketNotFoundError,
    ConflictError,
    IntegrityError,
    CorruptPatchError,
    ManifestError,
    UnsupportedVersionError,
    SignatureError,
    UnknownKeyError,
    ReplayError,
    UnsupportedDtypeError,
    EngineError,
    DeadlineError,
    LocalWriteError,
    ForeignStreamError,
    MissingReferenceError,
    PolicyLagError,
    StaleStoreError,
)
