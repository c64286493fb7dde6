"""The conformance suite every Store backend passes, shipped in the package (as zarr.testing.store).

A backend's test module subclasses StoreConformance, provides the `store` fixture, and
implements `raw_put`/`raw_get`, which reach the objects without the store under test (the
filesystem directly, a separate S3 client, the dict), so a test can tell a backend that reads its
own writes from one that reads and writes what the storage really holds. Needs pytest.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
from pathlib import Path

import pytest

from pulsesync.errors import ConflictError, IntegrityError, NotFoundError, StoreError
from pulsesync.store import Store, TransferProgress
from pulsesync.store.base import MAX_KEY_BYTES


async def _keys(store: Store, prefix: str = "", start_after: str | None = None) -> list[str]:
    return [o.key async for o in store.list(prefix, start_after)]


class StoreConformance:
    """Behaviour every backend must have. Subclasses define the `store` fixture."""

    multipart_bytes = (64 << 20) + 12345  # above 64 MiB and not a multiple of any part size

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError

    async def raw_put(self, store: Store, key: str, data: bytes) -> None:
        """Write an object without going through `store`."""
        raise NotImplementedError

    async def raw_get(self, store: Store, key: str) -> bytes | None:
        """Read an object without going through `store`; None if absent."""
        raise NotImplementedError

    async def raw_hostile_tree(self, store: Store, folder: str) -> list[str]:
        """Hostile shapes under `folder`, made without the store; returns the keys among them a listing shows.

        The default, for flat key spaces: a key of one-letter segments nearly as deep as keys go (room
        left for the backend's own prefix). Backends with real folders override it with what their
        storage can hold besides.
        """
        deep = folder + "d/" * ((MAX_KEY_BYTES - 256 - len(folder)) // 2) + "x"
        await self.raw_put(store, deep, b"deep")
        return [deep]

    async def test_reads_see_objects_written_around_the_store(self, store: Store) -> None:
        await self.raw_put(store, "raw/a.bin", b"written directly")
        assert await store.get("raw/a.bin") == b"written directly"
        assert await store.get_range("raw/a.bin", 0, 7) == b"written"
        assert (await store.head("raw/a.bin")).size == 16
        assert await _keys(store, "raw/") == ["raw/a.bin"]
        with pytest.raises(ConflictError):
            await store.put_if_absent("raw/a.bin", b"second")
        assert await self.raw_get(store, "raw/a.bin") == b"written directly"

    async def test_writes_land_where_the_storage_holds_them(self, store: Store) -> None:
        await store.put("raw/b.bin", b"through the store")
        await store.put_if_absent("raw/c.bin", b"once")
        assert await self.raw_get(store, "raw/b.bin") == b"through the store"
        assert await self.raw_get(store, "raw/c.bin") == b"once"
        await store.delete_many(["raw/b.bin"])
        assert await self.raw_get(store, "raw/b.bin") is None

    async def test_put_get_head_exists(self, store: Store) -> None:
        await store.put("a/b/c.bin", b"hello")
        assert await store.get("a/b/c.bin") == b"hello"
        info = await store.head("a/b/c.bin")
        assert (info.key, info.size) == ("a/b/c.bin", 5)
        assert await store.exists("a/b/c.bin")
        assert not await store.exists("a/b/d.bin")

    async def test_bounded_reads_stop_past_the_expected_size(self, store: Store, tmp_path: Path) -> None:
        """Issue 14 item 5: an object larger than its reader expects is refused, not read in full."""
        await store.put("big.bin", b"x" * 5000)
        await store.put("empty.bin", b"")
        assert await store.get("big.bin", max_size=5000) == b"x" * 5000
        assert await store.get("empty.bin", max_size=0) == b""
        with pytest.raises(IntegrityError, match="larger than the expected 100 bytes"):
            await store.get("big.bin", max_size=100)
        with pytest.raises(IntegrityError, match="expected 100"):
            await store.download_file("big.bin", tmp_path / "out", expected_size=100)
        assert not (tmp_path / "out").exists()
        assert (await store.download_file("big.bin", tmp_path / "out", expected_size=5000)).size == 5000

    async def test_put_replaces_atomically(self, store: Store) -> None:
        await store.put("k", b"one")
        await store.put("k", b"two!")
        assert await store.get("k") == b"two!"
        assert (await store.head("k")).size == 4

    async def test_conditional_get_answers_only_when_the_object_changed(self, store: Store) -> None:
        with pytest.raises(NotFoundError):
            await store.get_if_changed("pointer", None, 64)
        await store.put("pointer", b"one")
        got = await store.get_if_changed("pointer", None, 64)
        assert got is not None and got[0] == b"one" and got[1]
        assert await store.get_if_changed("pointer", got[1], 64) is None
        await store.put("pointer", b"two!")
        again = await store.get_if_changed("pointer", got[1], 64)
        assert again is not None and again[0] == b"two!" and again[1] != got[1]
        with pytest.raises(IntegrityError):
            await store.get_if_changed("pointer", None, 3)

    async def test_missing_keys(self, store: Store) -> None:
        for call in (store.get("nope"), store.get_range("nope", 0, 5), store.head("nope")):
            with pytest.raises(NotFoundError, match="nope"):
                await call
        with pytest.raises(NotFoundError):
            async for _ in store.stream("nope"):
                pass
        await store.delete_many(["nope", "also/nope"])  # deleting what is gone is fine

    async def test_empty_object(self, store: Store) -> None:
        await store.put("empty", b"")
        assert await store.get("empty") == b""
        assert (await store.head("empty")).size == 0
        assert await store.get_range("empty", 0, 10) == b""
        assert [c async for c in store.stream("empty")] in ([], [b""])
        assert await _keys(store) == ["empty"]

    async def test_ranged_reads_at_boundaries(self, store: Store) -> None:
        data = bytes(range(256)) * 4  # 1024 bytes
        await store.put("r", data)
        for start, end in [(0, 0), (0, 1), (0, 1024), (1, 1023), (1023, 1024), (512, 4096), (1024, 1024), (1024, 2000)]:
            assert await store.get_range("r", start, end) == data[start:end], (start, end)
        with pytest.raises(ValueError):
            await store.get_range("r", 5, 4)

    async def test_stream_in_chunks(self, store: Store) -> None:
        data = os.urandom(3 * (1 << 20) + 17)
        await store.put("s", data)
        chunks = [c async for c in store.stream("s", chunk_size=1 << 20)]
        assert b"".join(chunks) == data
        assert len(chunks) >= 3

    async def test_list_is_lexicographic_with_prefix_and_start_after(self, store: Store) -> None:
        keys = [
            "ready/000000000010.patch.json",
            "ready/000000000002.anchor.json",
            "ready/000000000002.patch.json",
            "patches/000000000002/patch.bin",
            "anchors/000000000000/model.safetensors",
            "readyz",
        ]
        await asyncio.gather(*(store.put(k, k.encode()) for k in keys))
        assert await _keys(store) == sorted(keys)
        assert await _keys(store, "ready/") == sorted(k for k in keys if k.startswith("ready/"))
        assert await _keys(store, "ready") == sorted(k for k in keys if k.startswith("ready"))
        assert await _keys(store, "ready/", "ready/000000000002.patch.json") == ["ready/000000000010.patch.json"]
        assert await _keys(store, "nothing/") == []
        sizes = {o.key: o.size async for o in store.list()}
        assert sizes == {k: len(k) for k in keys}
        # Listings and heads say when each object was written (retention's grace period needs it).
        now = dt.datetime.now(dt.timezone.utc)
        for info in [o async for o in store.list()] + [await store.head(keys[0])]:
            assert info.last_modified is not None and abs((now - info.last_modified).total_seconds()) < 120

    async def test_hostile_tree_shapes_do_not_stop_a_listing(self, store: Store) -> None:
        """Junk shapes under the folders every role lists (deep, looping, not files) leave listings whole."""
        legit = ["ready/000000000001.json", "fleet/sub-a.json", "patches/000000000001/patch-r.bin", "pointer"]
        shown = {}
        for folder in ("ready/", "fleet/", "patches/"):
            shown[folder] = await self.raw_hostile_tree(store, folder)
        for key in legit:
            await store.put(key, key.encode())
        for folder, extra in shown.items():
            assert await _keys(store, folder) == sorted([k for k in legit if k.startswith(folder)] + extra)
            assert await _keys(store, folder, start_after=max(extra)) == [
                k for k in legit if k.startswith(folder) and k > max(extra)
            ]
        everything = await _keys(store)
        assert everything == sorted(legit + [k for extra in shown.values() for k in extra])
        for key in everything:  # every key a listing shows is an object that reads back
            assert await store.get(key) == (key.encode() if key in legit else await self.raw_get(store, key))

    async def test_list_paginates_past_1000(self, store: Store) -> None:
        keys = [f"many/{i:05d}" for i in range(1100)]
        slots = asyncio.Semaphore(32)

        async def put(k: str) -> None:
            async with slots:
                await store.put(k, b"x")

        await asyncio.gather(*(put(k) for k in keys))
        assert await _keys(store, "many/") == keys
        assert await _keys(store, "many/", "many/00499") == keys[500:]

    async def test_delete_many(self, store: Store) -> None:
        keys = [f"d/{i}" for i in range(5)] + ["d/sub/x"]
        await asyncio.gather(*(store.put(k, b"1") for k in keys))
        await store.delete_many([*keys[:3], "d/missing", "d/sub/x"])
        assert await _keys(store, "d/") == keys[3:5]
        await store.delete_many(keys)
        assert await _keys(store) == []

    async def test_put_if_absent(self, store: Store) -> None:
        await store.put_if_absent("once", b"first")
        with pytest.raises(ConflictError, match="once"):
            await store.put_if_absent("once", b"second")
        assert await store.get("once") == b"first"

    async def test_put_if_absent_races_have_exactly_one_winner(self, store: Store) -> None:
        # 20 rounds, each 8 writers racing for one key; the rounds run concurrently too.
        async def attempt(key: str, writer: int) -> int | None:
            try:
                await store.put_if_absent(key, f"writer-{writer}".encode())
                return writer
            except ConflictError:
                return None

        async def race(round_: int) -> None:
            key = f"race/{round_}"
            winners = [w for w in await asyncio.gather(*(attempt(key, w) for w in range(8))) if w is not None]
            assert len(winners) == 1, f"round {round_}: winners {winners}"
            assert await store.get(key) == f"writer-{winners[0]}".encode()

        await asyncio.gather(*(race(r) for r in range(20)))

    async def test_invalid_keys_are_refused(self, store: Store) -> None:
        for key in ["", "/abs", "a//b", "../escape", "a/../b", "./a"]:
            with pytest.raises(StoreError, match="invalid key"):
                await store.put(key, b"x")

    async def test_large_upload_and_download_byte_for_byte(self, store: Store, tmp_path: Path) -> None:
        src = tmp_path / "big.bin"
        data = os.urandom(self.multipart_bytes)
        src.write_bytes(data)
        seen: list[TransferProgress] = []
        up = await store.upload_file("big/object.bin", src, progress=seen.append)
        assert (up.size, up.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert seen and seen[-1].done == len(data) == seen[-1].total
        assert (await store.head("big/object.bin")).size == len(data)
        dst = tmp_path / "out" / "copy.bin"
        down = await store.download_file("big/object.bin", dst, expected_sha256=up.sha256)
        assert down.sha256 == up.sha256
        assert dst.read_bytes() == data
        assert [p.name for p in dst.parent.iterdir()] == ["copy.bin"]  # no temp files left

    async def test_download_with_wrong_hash_leaves_nothing(self, store: Store, tmp_path: Path) -> None:
        await store.put("h", b"payload")
        dst = tmp_path / "downloads" / "h.bin"
        with pytest.raises(IntegrityError, match="SHA-256"):
            await store.download_file("h", dst, expected_sha256="0" * 64)
        assert list(dst.parent.iterdir()) == []  # neither the file nor its temp file
        with pytest.raises(NotFoundError):
            await store.download_file("missing", dst)
