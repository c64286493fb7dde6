"""The state cache's patch history: what a restarted subscriber or publisher codes and decodes against."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pulsesync import state_cache
from pulsesync.codec import ChunkHistory, PatchHistory, StepHistory
from pulsesync.digest import state_digest
from pulsesync.verified import VerifiedState


def test_the_cached_history_keeps_every_part_and_reads_the_one_patch_file_of_older_caches(tmp_path: Path) -> None:
    """A sharded step's history is one per part (by SHA-256) through save and load; a cache written before
    parts had histories (one patch's keys at the top of the file's metadata) still loads."""
    state = {"w": torch.arange(16, dtype=torch.float32).bfloat16()}
    chunk = ("w", 0, 16)  # the same key in both parts: a strided split's records share global chunks
    parts = [
        PatchHistory("aa" * 32, {chunk: ChunkHistory(np.array([1, 5], np.int64), np.array([1, -1], np.int16))}),
        PatchHistory("bb" * 32, {chunk: ChunkHistory(np.array([2], np.int64), np.array([3], np.int16))}),
    ]
    state_cache.save(tmp_path, VerifiedState(7, state, state_digest(state), history=StepHistory.of(*parts)))
    loaded = state_cache.load(tmp_path)
    assert loaded is not None and loaded.history is not None
    assert list(loaded.history.patches) == [p.sha256 for p in parts]
    for part in parts:
        got = loaded.history.patches[part.sha256].chunks[chunk]
        assert got.positions.tolist() == part.chunks[chunk].positions.tolist()
        assert got.deltas.tolist() == part.chunks[chunk].deltas.tolist()
    one = parts[0].chunks[chunk]
    contents = state_cache._history_sha256([one])
    meta = {"sha256": parts[0].sha256, "chunks": [list(chunk)], "contents": contents}
    tensors = {"0.positions": torch.from_numpy(one.positions), "0.deltas": torch.from_numpy(one.deltas)}
    save_file(tensors, str(tmp_path / state_cache.HISTORY_FILE), metadata={"history": json.dumps(meta)})
    older = state_cache.load(tmp_path)
    assert older is not None and older.history is not None and list(older.history.patches) == [parts[0].sha256]
    assert older.history.patches[parts[0].sha256].chunks[chunk].positions.tolist() == [1, 5]
