"""The filesystem and in-memory backends against the conformance suite, plus the filesystem's on-disk guarantees."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from pulsesync.errors import IntegrityError
from pulsesync.store import FileStore, Store
from pulsesync.store.memory import MemoryStore
from pulsesync.store.testing import StoreConformance


class TestFileStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return FileStore(tmp_path / "store")

    async def raw_put(self, store: Store, key: str, data: bytes) -> None:
        assert isinstance(store, FileStore)
        (store.root / key).parent.mkdir(parents=True, exist_ok=True)
        (store.root / key).write_bytes(data)

    async def raw_get(self, store: Store, key: str) -> bytes | None:
        assert isinstance(store, FileStore)
        return (store.root / key).read_bytes() if (store.root / key).is_file() else None


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Store:
        return MemoryStore()

    async def raw_put(self, store: Store, key: str, data: bytes) -> None:
        assert isinstance(store, MemoryStore)
        store.objects[key] = (data, dt.datetime.now(dt.timezone.utc))

    async def raw_get(self, store: Store, key: str) -> bytes | None:
        assert isinstance(store, MemoryStore)
        return store.objects[key][0] if key in store.objects else None


async def test_no_temp_files_remain_and_listing_skips_them(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    await store.put("a/x", b"1")
    (tmp_path / "a" / ".x.pulsesync-tmp-deadbeef").write_bytes(b"half-written")
    assert [o.key async for o in store.list()] == ["a/x"]
    await store.put_if_absent("a/y", b"2")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".x.pulsesync-tmp-deadbeef", "x", "y"]


async def test_delete_prunes_empty_directories(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "root")
    await store.put("patches/000000000001/patch.bin", b"p")
    await store.delete_many(["patches/000000000001/patch.bin"])
    assert list((tmp_path / "root").iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux's /proc")
async def test_a_bounded_get_reads_past_the_size_fstat_gave_up_to_its_bound() -> None:
    # A bounded get reads the size fstat gives, +1 to see the file grew since, and then on up to the
    # bound. A file that grows between fstat and read is a race; /proc files are regular files that
    # fstat sizes at 0 and that read as their whole content, the same branch, deterministically.
    proc = FileStore("/proc/self")
    cmdline = Path("/proc/self/cmdline").read_bytes()
    assert Path("/proc/self/cmdline").stat().st_size == 0 and len(cmdline) > 16
    assert await proc.get("cmdline", max_size=len(cmdline)) == cmdline
    assert await proc.get("cmdline", max_size=1 << 20) == cmdline
    with pytest.raises(IntegrityError, match=f"larger than the expected {len(cmdline) - 1} bytes"):
        await proc.get("cmdline", max_size=len(cmdline) - 1)
