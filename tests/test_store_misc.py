"""Store plumbing: opening stores from config, key checks, progress reporting, a call's deadline."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest

from pulsesync.config import Config, load_config
from pulsesync.errors import ConfigError, IntegrityError, StoreError
from pulsesync.store import FileStore, RetryPolicy, S3Store, open_store, retry
from pulsesync.store.base import check_key
from pulsesync.store.config import StoreConfig


def test_open_store_from_urls(tmp_path: Path) -> None:
    fs = open_store(StoreConfig(url=f"file://{tmp_path}/pulse"))
    assert isinstance(fs, FileStore) and fs.root == tmp_path / "pulse"
    s3 = open_store(StoreConfig(url="s3://bucket/run/1/", endpoint_url="http://127.0.0.1:9000", part_size=8 << 20))
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix, s3.url, s3.part_size) == ("bucket", "run/1/", "s3://bucket/run/1/", 8 << 20)
    assert open_store(StoreConfig(url="s3://bucket")).prefix == ""
    with pytest.raises(ConfigError, match="no store configured"):
        open_store(StoreConfig())


def test_store_options_validate(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  url: s3://b/p\n  part_size: 1024\n")
    with pytest.raises(ConfigError, match=r"store\.part_size"):
        load_config(Config, path)
    path.write_text("store:\n  url: s3://b/p\n  retry:\n    attempts: 3\n    jitter: 1\n")
    with pytest.raises(ConfigError, match=r"store\.retry\.jitter"):
        load_config(Config, path)


def test_check_key() -> None:
    assert check_key("ready/000000000001.patch.json") == "ready/000000000001.patch.json"
    for bad in ["", "/a", "a/", "a//b", "..", "a/../b", "./a", "a/."]:
        with pytest.raises(StoreError, match="invalid key"):
            check_key(bad)


async def test_a_store_call_cancelled_as_its_request_fails_loses_no_exception() -> None:
    """The request's own error reaches the caller; none is left in a task nobody awaits.

    The race the soak's log showed ("Task exception was never retrieved": an IntegrityError of a
    body larger than its manifest said, as the sync's deadline cancelled the call): asyncio.wait_for
    ran the request in a task of its own, and on 3.11 drops what that task raised while cancelled.
    """
    unretrieved: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
    started = asyncio.Event()

    async def request() -> bytes:
        started.set()
        try:
            await asyncio.sleep(60)
        finally:  # the body's size check fails just as the call is cancelled
            raise IntegrityError("get s3://b/k: larger than the expected 5 bytes (read stopped there)")

    call = asyncio.create_task(retry.call(request, "get", "s3://b/k", RetryPolicy()))
    await started.wait()
    call.cancel()
    with pytest.raises(IntegrityError, match="larger than the expected"):
        await call
    gc.collect()  # an unretrieved task exception is reported when the task is freed
    await asyncio.sleep(0)
    assert unretrieved == []
