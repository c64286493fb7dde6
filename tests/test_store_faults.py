"""Retries against injected faults (see tests/support/fault_proxy.py: a fault injector in front of real moto).

Transient faults (500, 503 SlowDown, connection resets, truncated bodies) are retried to success
with the data intact; 403 and 404 surface at once as the right error; no credential leaks.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pulsesync.errors import AccessDeniedError, NotFoundError, PulseSyncError, StoreError
from pulsesync.store import RetryPolicy, S3Store
from tests.support.fault_proxy import FaultProxy
from tests.support.servers import ACCESS_KEY, BUCKET, SECRET_KEY

pytestmark = pytest.mark.integration
FAST = RetryPolicy(attempts=6, initial_wait=0.01, max_wait=0.05)


@pytest.fixture
async def proxy(moto_endpoint: str) -> AsyncIterator[FaultProxy]:
    proxy = FaultProxy(moto_endpoint)
    await proxy.start()
    yield proxy
    await proxy.stop()


@pytest.fixture
async def store(proxy: FaultProxy) -> AsyncIterator[S3Store]:
    store = S3Store(BUCKET, f"f-{uuid.uuid4().hex[:10]}", endpoint_url=proxy.endpoint, part_size=5 << 20, retry=FAST)
    yield store
    await store.close()


def _actions(proxy: FaultProxy) -> list[str]:
    return [action for _, _, action in proxy.seen]


@pytest.mark.parametrize("fault", ["500", "503", "reset", "truncate"])
async def test_each_transient_fault_is_retried_to_success(store: S3Store, proxy: FaultProxy, fault: str) -> None:
    data = os.urandom(200_000)
    await store.put("obj", data)
    proxy.seen.clear()
    proxy.schedule = [fault, fault]
    assert await store.get("obj") == data
    assert _actions(proxy) == [fault, fault, "ok"]


async def test_mixed_faults_on_every_operation(store: S3Store, proxy: FaultProxy) -> None:
    data = os.urandom(300_000)
    proxy.schedule = ["503", "reset", "ok"]  # put
    await store.put("a/obj", data)
    proxy.schedule = ["truncate", "500", "ok"]  # get_range: one ranged GET, retried twice
    assert await store.get_range("a/obj", 1000, 250_000) == data[1000:250_000]
    proxy.schedule = ["500", "ok"]  # list
    assert [o.key async for o in store.list("a/")] == ["a/obj"]
    proxy.schedule = ["reset", "ok"]  # put_if_absent
    await store.put_if_absent("a/once", b"x")
    assert await store.get("a/once") == b"x"
    proxy.schedule = ["503", "ok"]  # delete
    await store.delete_many(["a/obj", "a/once"])
    assert [o.key async for o in store.list("a/")] == []


async def test_multipart_and_parallel_download_survive_faults(
    store: S3Store, proxy: FaultProxy, tmp_path: Path
) -> None:
    data = os.urandom((23 << 20) + 7)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(data)
    proxy.schedule = ["ok", "503", "ok", "reset", "500", "ok", "ok", "truncate"]  # hits create/parts/complete
    up = await store.upload_file("big", src)
    proxy.schedule = ["ok", "truncate", "reset", "ok", "500"]  # head, then ranged gets
    down = await store.download_file("big", dst, expected_sha256=hashlib.sha256(data).hexdigest())
    assert up.sha256 == down.sha256
    assert dst.read_bytes() == data
    assert {"503", "reset", "500", "truncate"} <= set(_actions(proxy))


@pytest.mark.parametrize(("fault", "error"), [("403", AccessDeniedError), ("404", NotFoundError)])
async def test_permanent_errors_surface_at_once(
    store: S3Store, proxy: FaultProxy, fault: str, error: type[Exception]
) -> None:
    await store.put("obj", b"data")
    proxy.seen.clear()
    proxy.schedule = [fault, "ok", "ok"]
    with pytest.raises(error, match=r"get s3://.*/obj"):
        await store.get("obj")
    assert _actions(proxy) == [fault]  # not retried


async def test_retries_are_bounded(proxy: FaultProxy) -> None:
    store = S3Store(BUCKET, "bounded", endpoint_url=proxy.endpoint, retry=RetryPolicy(attempts=3, initial_wait=0.01))
    proxy.schedule = ["503"] * 10
    with pytest.raises(StoreError, match="SlowDown") as info:
        await store.put("x", b"1")
    assert not isinstance(info.value, (NotFoundError, AccessDeniedError))
    assert _actions(proxy) == ["503"] * 3
    await store.close()


async def test_no_credentials_in_logs_or_errors(
    store: S3Store, proxy: FaultProxy, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, botocore's included
    errors: list[PulseSyncError] = []
    proxy.schedule = ["503", "reset", "ok"]
    await store.put("k", b"v")
    for fault in ("403", "404", "500"):
        proxy.schedule = [fault] * 10
        try:
            await store.get("k")
        except PulseSyncError as e:
            errors.append(e)
    assert len(errors) == 3
    texts = [r.getMessage() for r in caplog.records] + [str(e) for e in errors]
    texts += [str(e.__cause__) for e in errors if e.__cause__ is not None]
    assert any("retrying" in t for t in texts)  # the retries were logged
    assert not [t for t in texts if SECRET_KEY in t]
    # The access key id is not secret (botocore's own debug log prints it in the Authorization
    # header); pulsesync's log lines and errors still never carry it.
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("pulsesync")] + [str(e) for e in errors]
    assert not [t for t in ours if ACCESS_KEY in t]
