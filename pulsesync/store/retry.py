"""One retry wrapper for every store call, and one translation of backend errors to pulsesync's.

Transient failures (5xx, throttling, timeouts, connection resets, truncated bodies) are retried
with exponential backoff and jitter; permanent ones (403, 404, 412) surface at once as
AccessDeniedError, NotFoundError, ConflictError. Modelled on s3fs's _call_s3/translate_boto_error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import botocore.exceptions
from pydantic import BaseModel, ConfigDict, Field
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, stop_after_delay
from tenacity.wait import wait_exponential_jitter

from pulsesync.deadlines import within
from pulsesync.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    ConflictError,
    NotFoundError,
    PulseSyncError,
    StoreError,
)
from pulsesync.metrics import STORE_RETRIES, STORE_UNEXPECTED_ERRORS

log = logging.getLogger("pulsesync.store")
T = TypeVar("T")

_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchUpload"}
_DENIED = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"}
_CONFLICT = {"PreconditionFailed", "412"}
_TRANSIENT = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestLimitExceeded",
    "TooManyRequests",
    "ConditionalRequestConflict",  # 409 from concurrent conditional writes: retry, then 412 decides
    "500",
    "502",
    "503",
    "504",
}


class TruncatedBodyError(Exception):
    """A response body was shorter than its Content-Length (retried)."""


class RetryPolicy(BaseModel):
    """How transient store errors are retried."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(8, ge=1, description="tries per call, the first included")
    initial_wait: float = Field(0.2, gt=0, description="seconds before the first retry; doubles each time")
    max_wait: float = Field(10.0, gt=0, description="longest single wait between tries")
    max_total: float = Field(120.0, gt=0, description="deadline of a whole call, every try and wait included")
    attempt_timeout: float = Field(
        60.0, gt=0, description="deadline of one try, its whole body included (a body that trickles is cut off)"
    )


def _code(e: botocore.exceptions.ClientError) -> tuple[str, int]:
    error = e.response.get("Error", {})
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def is_transient(e: BaseException) -> bool:
    """Whether retrying could succeed."""
    if isinstance(e, botocore.exceptions.ClientError):
        code, status = _code(e)
        return code in _TRANSIENT or status >= 500 or status == 429
    return isinstance(
        e,
        (
            TruncatedBodyError,
            botocore.exceptions.HTTPClientError,  # connection errors, read/connect timeouts, closed connections
            botocore.exceptions.ResponseStreamingError,
            botocore.exceptions.IncompleteReadError,
            aiohttp.ClientError,  # payload errors, disconnects, resets
            asyncio.TimeoutError,
            ConnectionError,
        ),
    )


def translate_error(e: BaseException, op: str, target: str) -> PulseSyncError:
    """The pulsesync error for a backend exception; the message names the operation and the object."""
    if isinstance(e, PulseSyncError):
        return e
    if isinstance(e, botocore.exceptions.ClientError):
        code, status = _code(e)
        what = f"{op} {target}: {code or status}"
        if code == "NoSuchBucket":
            return BucketNotFoundError(f"{op} {target}: the bucket does not exist; create it first")
        if code in _NOT_FOUND or status == 404:
            return NotFoundError(f"{what}: no such object")
        if code in _CONFLICT or status == 412:
            return ConflictError(f"{what}: the object already exists (conditional write refused)")
        if code in _DENIED or status == 403:
            return AccessDeniedError(f"{what}: access denied (check credentials and bucket policy)")
        return StoreError(f"{what}: {e.response.get('Error', {}).get('Message', 'request failed')}")
    if isinstance(e, FileNotFoundError):
        return NotFoundError(f"{op} {target}: no such object")
    if isinstance(e, PermissionError):
        return AccessDeniedError(f"{op} {target}: permission denied")
    if is_transient(e):
        return StoreError(f"{op} {target}: gave up after retries: {type(e).__name__}: {e}")
    if not isinstance(e, OSError):  # a bug or a reply nobody foresaw: counted and logged whole, then a store error
        STORE_UNEXPECTED_ERRORS.labels(op).inc()
        log.error("%s %s: unexpected %s", op, target, type(e).__name__, exc_info=e)
    return StoreError(f"{op} {target}: {type(e).__name__}: {e}")


def _log_retry(op: str, target: str) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        e = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        STORE_RETRIES.labels(op).inc()
        log.warning(
            "%s %s: attempt %d failed (%s); retrying in %.2fs", op, target, state.attempt_number, type(e).__name__, wait
        )

    return before_sleep


async def call(fn: Callable[[], Awaitable[T]], op: str, target: str, policy: RetryPolicy) -> T:
    """Run fn, retrying transient failures per policy; raise the translated pulsesync error."""
    retrying = AsyncRetrying(
        stop=stop_after_attempt(policy.attempts) | stop_after_delay(policy.max_total),
        wait=wait_exponential_jitter(multiplier=policy.initial_wait, max=policy.max_wait, jitter=policy.initial_wait),
        retry=retry_if_exception(is_transient),
        before_sleep=_log_retry(op, target),
        reraise=True,
    )

    async def tries() -> T:
        async for attempt in retrying:
            with attempt:
                return await within(policy.attempt_timeout, fn())
        raise AssertionError("unreachable")  # pragma: no cover

    try:
        return await within(policy.max_total, tries())
    except asyncio.TimeoutError as e:  # the call's deadline, or a last try's
        raise StoreError(
            f"{op} {target}: no success within its deadline ({policy.attempt_timeout:g} s a try, "
            f"{policy.max_total:g} s in all)"
        ) from e
    except Exception as e:
        raise translate_error(e, op, target) from e
