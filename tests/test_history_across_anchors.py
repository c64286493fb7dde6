"""The patch after an anchor is history-coded: the anchor carries its step's patch history (codec/history_file.py).

Judged on bytes: every patch of a run with an anchor every 3 steps, and of a run whose publisher is
restarted before every step (resuming from the store, and from its cache), is byte-identical to the
same step's patch in an uninterrupted run without anchors; a cold subscriber that starts from an
anchor takes the fast path through the next patch. A history object that is not one is refused with
an IntegrityError naming it, before any chunk of it is used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.numpy import save

from pulsesync.codec import ChunkHistory, PatchHistory, StepHistory
from pulsesync.codec.history_file import history_bytes, read_history
from pulsesync.errors import IntegrityError
from pulsesync.protocol import signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import AnchorManifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.store import FileStore
from pulsesync.subscriber.paths import SyncPath
from tests.support.helpers import publisher_config
from tests.support.subscribing import assert_serving, publish, subscriber

STEPS = 10


async def _patches(store: FileStore, key: Ed25519PrivateKey) -> dict[int, bytes]:
    """Each committed patch step's patch bytes."""
    chain = ChainClient(store, signing.trusted_keys([key.public_key()]), 1)
    found = {}
    for step in await chain.ready():
        manifest = await chain.commit_manifest(step)
        if manifest.kind == "patch":
            found[step] = await store.get(manifest.objects[0].key)
    return found


async def _run(store: FileStore, key: Ed25519PrivateKey, restarts: bool, **config: object) -> None:
    pub = AsyncPublisher(publisher_config(**config), store=store, signing_key=key)
    await pub.start()
    for step in range(STEPS):
        if restarts and step:
            await pub.close()
            pub = AsyncPublisher(publisher_config(**config), store=store, signing_key=key)
            await pub.start()
        await publish(pub, range(step, step + 1))
    await pub.close()


@pytest.mark.parametrize("restarts", ["none", "from the store", "from the cache"])
async def test_every_patch_is_coded_as_an_uninterrupted_run_without_anchors_codes_it(
    tmp_path: Path, key: Ed25519PrivateKey, restarts: str
) -> None:
    plain = FileStore(tmp_path / "plain")
    await _run(plain, key, False, anchor_interval=1000)
    anchored = FileStore(tmp_path / "anchored")
    resume = {"resume": True, "cache_dir": tmp_path / "cache"} if restarts == "from the cache" else {"resume": True}
    await _run(anchored, key, restarts != "none", anchor_interval=3, **resume)

    expected, got = await _patches(plain, key), await _patches(anchored, key)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS))
    assert all(got[step] == expected[step] for step in got)
    chain = ChainClient(anchored, signing.trusted_keys([key.public_key()]), 1)
    anchors = [s for s, kinds in (await chain.ready()).items() if "anchor" in kinds]
    assert anchors == [3, 6, 9]  # anchors added to patch steps, each carrying its patch's history
    for step in anchors:
        anchor = await chain.manifest(step, "anchor")
        assert isinstance(anchor, AnchorManifest) and len(anchor.histories) == 1
        if step + 1 < STEPS:
            after = await chain.commit_manifest(step + 1)
            assert after.reference is not None and any(c.startswith("HISTORY/") for c in after.codec.records or {})


async def test_a_cold_subscriber_from_an_anchor_takes_the_fast_path_through_the_next_patch(
    tmp_path: Path, key: Ed25519PrivateKey
) -> None:
    store = FileStore(tmp_path / "store")
    pub = AsyncPublisher(publisher_config(anchor_interval=3), store=store, signing_key=key)
    await pub.start()
    await publish(pub, range(5))
    await pub.close()
    chain = ChainClient(store, signing.trusted_keys([key.public_key()]), 1)
    anchor = max(s for s, kinds in (await chain.ready()).items() if "anchor" in kinds and s < 4)
    sub = subscriber(store, key)
    try:
        assert (await sub.sync(anchor)).path == SyncPath.SLOW
        assert (await sub.sync(anchor + 1)).path == SyncPath.FAST
        assert_serving(sub, anchor + 1)
    finally:
        await sub.close()


def _raw(arrays: dict[str, np.ndarray], chunks: list[list[object]]) -> bytes:
    meta = json.dumps({"patches": [{"sha256": "ab", "chunks": chunks}]})
    return zstandard.ZstdCompressor().compress(save(arrays, metadata={"pulsesync.history": meta}))


TENSORS = {"w": (100, 2)}


def test_a_history_reads_back_as_written() -> None:
    chunk = ChunkHistory(np.array([0, 5, 99]), np.array([1, -2, 3], np.int16))
    history = StepHistory.of(PatchHistory("ab", {("w", 0, 100): chunk}))
    back = read_history(history_bytes(history), "h", 1 << 20, TENSORS).patches["ab"].chunks[("w", 0, 100)]
    assert back.positions.tolist() == [0, 5, 99] and back.deltas.tolist() == [1, -2, 3]
    assert back.deltas.dtype == np.int16


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "not a zstd frame"),
        (zstandard.ZstdCompressor().compress(b"\x00" * 64), "not a patch history"),
        (zstandard.ZstdCompressor().compress(b"\x00" * (2 << 20)), "over"),
        (
            _raw({"0.0.gaps": np.array([0, 5, 95], np.uint32), "0.0.deltas": np.zeros(3, np.int16)}, [["w", 0, 100]]),
            "not increasing inside it",
        ),
        (
            _raw({"0.0.gaps": np.array([3, 0], np.uint32), "0.0.deltas": np.zeros(2, np.int16)}, [["w", 0, 100]]),
            "not increasing inside it",
        ),
        (
            _raw({"0.0.gaps": np.array([1], np.uint32), "0.0.deltas": np.zeros(1, np.int32)}, [["w", 0, 100]]),
            "elements are 2 bytes",
        ),
        (
            _raw({"0.0.gaps": np.array([1], np.uint32), "0.0.deltas": np.zeros(1, np.int16)}, [["w", 50, 100]]),
            "past its 100 elements",
        ),
        (
            _raw({"0.0.gaps": np.array([1], np.uint32), "0.0.deltas": np.zeros(1, np.int16)}, [["v", 0, 100]]),
            "KeyError",
        ),
        (
            _raw({"0.0.gaps": np.array([1], np.uint32), "0.0.deltas": np.zeros(1, np.float16)}, [["w", 0, 100]]),
            "signed integer width",
        ),
        (
            _raw(
                {"0.0.gaps": np.array([1], np.uint32), "0.0.deltas": np.zeros(1, np.int16), "x": np.zeros(1)},
                [["w", 0, 100]],
            ),
            "in no chunk",
        ),
    ],
)
def test_a_malformed_history_is_refused_naming_it(data: bytes, problem: str) -> None:
    with pytest.raises(IntegrityError, match=f"anchor 6: h: .*{problem}"):
        read_history(data, "anchor 6: h", 1 << 20, TENSORS)
