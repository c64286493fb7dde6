"""The filesystem and in-memory backends against the conformance suite, plus the filesystem's on-disk guarantees."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pulsesync import metrics
from pulsesync.errors import IntegrityError, StoreError
from pulsesync.store import FileStore, Store
from pulsesync.store.memory import MemoryStore
from pulsesync.store.testing import StoreConformance
from tests.support.hostile import deep_folder, remove_deep_folder


class TestFileStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        self.deep: list[Path] = []
        yield FileStore(tmp_path / "store")
        for top in self.deep:  # pytest's own cleanup recurses once per level on Python 3.11
            remove_deep_folder(top)

    async def raw_hostile_tree(self, store: Store, folder: str) -> list[str]:
        """Past the recursion limit, a symlink loop, a FIFO, symlinks to files and nowhere, an unreadable folder."""
        assert isinstance(store, FileStore)
        base = store.root / folder
        bottom = deep_folder(base / "d", 1100)
        self.deep.append(base / "d")
        (base / "d" / "d" / "x").write_bytes(b"shallow enough to be a key")
        (bottom / "x").write_bytes(b"no key is this long")
        (base / "loop").mkdir()
        os.symlink("..", base / "loop" / "up")
        os.mkfifo(base / "fifo")
        os.symlink(base / "d" / "d" / "x", base / "link")
        os.symlink(base / "nowhere", base / "dangling")
        (base / "locked").mkdir()
        (base / "locked" / "x").write_bytes(b"behind a folder mode 000")
        os.chmod(base / "locked", 0)
        readable = os.access(base / "locked", os.R_OK | os.X_OK)  # root reads it anyway
        return [f"{folder}d/d/x", *([f"{folder}locked/x"] if readable else [])]

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


async def test_a_folder_the_listing_cannot_read_is_skipped_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root reads a folder of mode 000 anyway, so the refusal an ordinary user gets is injected.
    store = FileStore(tmp_path)
    await store.put("fleet/a.json", b"a")
    await store.put("fleet/locked/b.json", b"b")
    scandir = os.scandir

    def refusing(path: Any) -> Any:
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    before = metrics.STORE_FOLDERS_SKIPPED._value.get()
    assert [o.key async for o in store.list("fleet/")] == ["fleet/a.json"]
    assert metrics.STORE_FOLDERS_SKIPPED._value.get() == before + 1


async def test_a_listing_past_its_entry_bound_is_a_store_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_list_entries=50)
    for i in range(30):
        await store.put(f"fleet/{i:02d}.json", b"x")
    assert len([o async for o in store.list("fleet/")]) == 30
    for i in range(30):
        await store.put(f"fleet/more/{i:02d}.json", b"x")
    with pytest.raises(StoreError, match="more than 50 entries"):
        _ = [o async for o in store.list("fleet/")]


async def test_an_unexpected_exception_in_a_file_store_call_is_a_counted_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FileStore(tmp_path)

    def broken(*args: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(store, "_list_sync", broken)
    before = metrics.STORE_UNEXPECTED_ERRORS.labels("list")._value.get()
    with pytest.raises(StoreError, match="RecursionError"):
        _ = [o async for o in store.list("ready/")]
    assert metrics.STORE_UNEXPECTED_ERRORS.labels("list")._value.get() == before + 1
