"""A verified state kept on local disk, so a restart resumes without downloading an anchor.

`{cache_dir}/state.safetensors` holds the tensors, `{cache_dir}/files/` the non-weight files that
go with them (config.json, tokenizer files), `{cache_dir}/state.json` the step, state digest and
the files' SHA-256; each is written atomically (temp file, fsync, rename) and the JSON last, so a
crash leaves either the previous set or the new one. Loading re-hashes the tensors: a cache that does
not match its own digest is discarded with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import save_file

from pulsesync.digest import StateDigest, state_digest
from pulsesync.dtypes import State
from pulsesync.model_dir import load_owned
from pulsesync.store.base import fsync_dir, temp_path

log = logging.getLogger("pulsesync.cache")
STATE_FILE = "state.safetensors"
META_FILE = "state.json"
FILES_DIR = "files"


@dataclass
class CachedState:
    """A state read back from the cache, its digest re-checked."""

    step: int
    state: dict[str, torch.Tensor]
    digest: StateDigest
    files: dict[str, bytes]


def _replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    tmp = temp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def save(
    cache_dir: Path, step: int, state: State, digest: StateDigest, files: Mapping[str, bytes] | None = None
) -> None:
    """Persist a verified state, its digest and its files atomically."""
    (cache_dir / FILES_DIR).mkdir(parents=True, exist_ok=True)
    meta = cache_dir / META_FILE
    meta.unlink(missing_ok=True)  # the set is valid only once the JSON names the new tensors
    _replace_atomically(cache_dir / STATE_FILE, lambda p: save_file(dict(state), str(p)))
    for name, data in (files or {}).items():
        _replace_atomically(cache_dir / FILES_DIR / name, functools.partial(Path.write_bytes, data=data))
    shas = {name: hashlib.sha256(data).hexdigest() for name, data in (files or {}).items()}
    record = json.dumps({"step": step, "digest": digest.model_dump(mode="json"), "files": shas})
    _replace_atomically(meta, lambda p: p.write_text(record))


def load(cache_dir: Path, threads: int | None = None) -> CachedState | None:
    """The cached state if present and intact; None (with a warning if it was damaged) otherwise."""
    meta, tensors = cache_dir / META_FILE, cache_dir / STATE_FILE
    if not meta.exists() or not tensors.exists():
        return None
    try:
        record = json.loads(meta.read_text())
        step, expected = int(record["step"]), StateDigest.model_validate(record["digest"])
        files = {name: (cache_dir / FILES_DIR / name).read_bytes() for name in record.get("files", {})}
        if bad := [n for n, sha in record.get("files", {}).items() if hashlib.sha256(files[n]).hexdigest() != sha]:
            raise ValueError(f"file {bad[0]} does not match its SHA-256")
        state = load_owned(tensors)
    except (OSError, ValueError, KeyError, TypeError, ValidationError, SafetensorError) as e:
        log.warning("discarding the state cache in %s: unreadable (%s)", cache_dir, e)
        return None
    digest = state_digest(state, expected.algorithm, threads)
    if digest.root != expected.root:
        log.warning("discarding the state cache in %s: %s", cache_dir, digest.describe_mismatch(expected))
        return None
    return CachedState(step, state, digest, files)
