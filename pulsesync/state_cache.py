"""A verified state kept on local disk, so a restart resumes without downloading an anchor.

`{cache_dir}/state.safetensors` holds the tensors, `{cache_dir}/files/` the non-weight files that
go with them (config.json, tokenizer files), `{cache_dir}/state.json` the step, state digest and
the files' SHA-256; each is written atomically (temp file, fsync, rename) and the JSON last, so a
crash leaves either the previous set or the new one. Loading re-hashes the tensors: a cache that does
not match its own digest is discarded with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import save_file

from pulsesync.atomic_files import replace_with, write_file
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import LocalWriteError
from pulsesync.model_dir import load_owned
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.cache")
STATE_FILE = "state.safetensors"
META_FILE = "state.json"
MARKER_FILE = "ready-marker.json"  # a copy of the signed manifest of the cached step
FILES_DIR = "files"


@dataclass
class CachedState(VerifiedState):
    """A state read back from the cache (its digest re-checked), and the signed marker saved with it.

    Self-consistent is not authentic: a reader verifies `marker` against its trusted keys (or the
    store's marker for `step`) before it serves the state.
    """

    marker: bytes | None = None


def save(cache_dir: Path, verified: VerifiedState, marker: bytes | None = None) -> None:
    """Persist a verified state, its digest, its files and its signed marker atomically.

    LocalWriteError if the disk refuses (full, read-only): the previous set is gone by then, never half-kept.
    """
    step, state, digest, files = verified.step, verified.state, verified.digest, verified.files
    meta = cache_dir / META_FILE
    try:
        (cache_dir / FILES_DIR).mkdir(parents=True, exist_ok=True)
        meta.unlink(missing_ok=True)  # the set is valid only once the JSON names the new tensors
        replace_with(cache_dir / STATE_FILE, lambda p: save_file(dict(state), str(p)))
        for name, data in files.items():
            write_file(cache_dir / FILES_DIR / _file_name(name), data)
        if marker is not None:
            write_file(cache_dir / MARKER_FILE, marker)
        else:
            (cache_dir / MARKER_FILE).unlink(missing_ok=True)
        shas = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        record = json.dumps({"step": step, "digest": digest.model_dump(mode="json"), "files": shas})
        write_file(meta, record.encode())
    except (OSError, SafetensorError) as e:  # safetensors reports its I/O errors as SafetensorError
        raise LocalWriteError(f"state cache {cache_dir}: cannot save step {step} ({e})") from None


def _file_name(name: str) -> str:
    if not name or name != Path(name).name or name in (".", ".."):  # never a path out of files/
        raise ValueError(f"file name {name!r} is not a plain file name")
    return name


def load(cache_dir: Path, threads: int | None = None) -> CachedState | None:
    """The cached state if present and intact; None (with a warning if it was damaged) otherwise."""
    meta, tensors = cache_dir / META_FILE, cache_dir / STATE_FILE
    if not meta.exists() or not tensors.exists():
        return None
    try:
        record = json.loads(meta.read_text())
        step, expected = int(record["step"]), StateDigest.model_validate(record["digest"])
        names = dict(record.get("files", {}))
        files = {name: (cache_dir / FILES_DIR / _file_name(name)).read_bytes() for name in names}
        if bad := [n for n, sha in names.items() if hashlib.sha256(files[n]).hexdigest() != sha]:
            raise ValueError(f"file {bad[0]} does not match its SHA-256")
        marker_path = cache_dir / MARKER_FILE
        marker = marker_path.read_bytes() if marker_path.is_file() else None
        state = load_owned(tensors)
    except (OSError, ValueError, KeyError, TypeError, RecursionError, ValidationError, SafetensorError) as e:
        log.warning("discarding the state cache in %s: unreadable (%s)", cache_dir, e)
        return None
    digest = state_digest(state, expected.algorithm, threads)
    if digest.root != expected.root:
        log.warning("discarding the state cache in %s: %s", cache_dir, digest.describe_mismatch(expected))
        return None
    return CachedState(step, state, digest, files, marker)
