"""A verified state kept on local disk, so a restart resumes without downloading an anchor: a base and a journal.

The base: `{cache_dir}/state.safetensors` holds the tensors, `{cache_dir}/files/` the non-weight
files that go with them (config.json, tokenizer files), `{cache_dir}/state.json` the step, state
digest and the files' SHA-256; each is written atomically (temp file, fsync, rename) and the JSON
last, so a crash leaves either the previous set or the new one. Loading re-hashes the tensors: a
base that does not match its own digest is discarded with a warning.

The journal: each verified patch applied since the base, as `journal/{step}.patch` and its signed
manifest `journal/{step}.json` (written second: it commits the entry). A fast-path step thus
writes about the patch's bytes, not the state's; a reader replays the entries whose base steps
link up from the base's step, verifying each (the subscriber does: signature, SHA-256, digests).
`save` writes a new base and clears the journal (compaction).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from pulsesync.atomic_files import replace_with, write_file
from pulsesync.codec.history import ChunkHistory, StepHistory
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import IntegrityError, LocalWriteError
from pulsesync.model_dir import load_owned
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.cache")
STATE_FILE = "state.safetensors"
META_FILE = "state.json"
MARKER_FILE = "ready-marker.json"  # a copy of the signed manifest of the cached step
HISTORY_FILE = "patch-history.safetensors"  # what the cached step's patch changed (format-2 references)
FILES_DIR = "files"
JOURNAL_DIR = "journal"
_ENTRY_RE = re.compile(r"([0-9]{12})\.(json|patch)")


@dataclass(frozen=True)
class JournalEntry:
    """One journaled patch: read it only when replaying (entries add up to more than a state)."""

    step: int
    manifest_path: Path
    patch_path: Path

    def read(self) -> tuple[bytes, bytes]:
        """The signed manifest's bytes and the patch's bytes, untrusted until verified."""
        return self.manifest_path.read_bytes(), self.patch_path.read_bytes()


@dataclass
class CachedState:
    """A state read back from the cache (its digest re-checked), and the signed marker saved with it.

    Self-consistent is not authentic: it becomes a `VerifiedState` only through `verified_by`, once
    a reader verified a manifest for it (`marker` against its trusted keys, or the store's marker
    for `step`).
    """

    step: int
    state: dict[str, torch.Tensor]
    digest: StateDigest
    files: dict[str, bytes] = field(default_factory=dict)
    history: StepHistory | None = None
    marker: bytes | None = None
    journal: list[JournalEntry] = field(default_factory=list)  # patches after `step`, in step order: replay them

    def verified_by(self, step: int, state_digest_root: str, what: str) -> VerifiedState:
        """The cached state as verified by a manifest the caller verified (of this step and state digest)."""
        if step != self.step or state_digest_root != self.digest.root:
            raise IntegrityError(
                f"{what} is step {step} with state digest {state_digest_root}, the cache holds step "
                f"{self.step} with {self.digest.root}"
            )
        return VerifiedState(self.step, self.state, self.digest, self.files, self.history)


def save(cache_dir: Path, verified: VerifiedState, marker: bytes | None = None) -> None:
    """Persist a verified state as the new base (its digest, files, signed marker and patch history); clear the journal.

    LocalWriteError if the disk refuses (full, read-only): the previous set is gone by then, never half-kept.
    """
    step, state, digest, files = verified.step, verified.state, verified.digest, verified.files
    history = verified.history
    meta = cache_dir / META_FILE
    try:
        (cache_dir / FILES_DIR).mkdir(parents=True, exist_ok=True)
        meta.unlink(missing_ok=True)  # the set is valid only once the JSON names the new tensors
        truncate_journal(cache_dir, 0)  # entries after the old base: nothing to apply them to now
        replace_with(cache_dir / STATE_FILE, lambda p: save_file(dict(state), str(p)))
        for name, data in files.items():
            write_file(cache_dir / FILES_DIR / _file_name(name), data)
        if marker is not None:
            write_file(cache_dir / MARKER_FILE, marker)
        else:
            (cache_dir / MARKER_FILE).unlink(missing_ok=True)
        if history is not None:
            replace_with(cache_dir / HISTORY_FILE, lambda p: _save_history(history, p))
        else:
            (cache_dir / HISTORY_FILE).unlink(missing_ok=True)
        shas = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        record = json.dumps({"step": step, "digest": digest.model_dump(mode="json"), "files": shas})
        write_file(meta, record.encode())
    except (OSError, SafetensorError) as e:  # safetensors reports its I/O errors as SafetensorError
        raise LocalWriteError(f"state cache {cache_dir}: cannot save step {step} ({e})") from None


def append(cache_dir: Path, step: int, manifest: bytes, patch: bytes) -> int:
    """Journal one verified patch after the cached state (patch first, its manifest commits it); bytes written."""
    journal = cache_dir / JOURNAL_DIR
    try:
        journal.mkdir(parents=True, exist_ok=True)
        write_file(journal / f"{step:012d}.patch", patch)
        write_file(journal / f"{step:012d}.json", manifest)
    except OSError as e:
        raise LocalWriteError(f"state cache {cache_dir}: cannot journal step {step} ({e})") from None
    return len(patch) + len(manifest)


def journal_entries(cache_dir: Path) -> list[JournalEntry]:
    """The committed journal entries (those with a manifest), in step order."""
    journal = cache_dir / JOURNAL_DIR
    if not journal.is_dir():
        return []
    entries = []
    for path in journal.iterdir():
        match = _ENTRY_RE.fullmatch(path.name)
        if match and match.group(2) == "json" and (patch := path.with_suffix(".patch")).is_file():
            entries.append(JournalEntry(int(match.group(1)), path, patch))
    return sorted(entries, key=lambda e: e.step)


def journal_bytes(cache_dir: Path) -> int:
    """Bytes the journal holds."""
    journal = cache_dir / JOURNAL_DIR
    return sum(p.stat().st_size for p in journal.iterdir()) if journal.is_dir() else 0


def truncate_journal(cache_dir: Path, from_step: int) -> None:
    """Remove the journal's entries from `from_step` on (0: all), manifests first."""
    journal = cache_dir / JOURNAL_DIR
    if not journal.is_dir():
        return
    doomed = [p for p in journal.iterdir() if (m := _ENTRY_RE.fullmatch(p.name)) and int(m.group(1)) >= from_step]
    for path in sorted(doomed, key=lambda p: p.suffix != ".json"):  # an entry without its manifest is no entry
        path.unlink(missing_ok=True)


def _history_sha256(chunks: list[ChunkHistory]) -> str:
    """A hash of a history's contents: a publisher codes against it, so a damaged file must not pass."""
    sha = hashlib.sha256()
    for chunk in chunks:
        sha.update(chunk.positions.tobytes())
        sha.update(chunk.deltas.tobytes())
    return sha.hexdigest()


def _save_history(history: StepHistory, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    patches, chunks = [], []
    for p, patch in enumerate(history.patches.values()):
        for i, chunk in enumerate(patch.chunks.values()):
            tensors[f"{p}.{i}.positions"] = torch.from_numpy(chunk.positions)
            tensors[f"{p}.{i}.deltas"] = torch.from_numpy(chunk.deltas)
            chunks.append(chunk)
        patches.append({"sha256": patch.sha256, "chunks": [list(k) for k in patch.chunks]})
    keys = json.dumps({"patches": patches, "contents": _history_sha256(chunks)})
    save_file(tensors, str(path), metadata={"history": keys})


def _load_history(path: Path) -> StepHistory | None:
    """The cached history, or None (missing, unreadable, or not what was saved: its contents hash differs).

    A history of one patch saved without its step's list of patches (an older cache) is read as it was.
    """
    if not path.is_file():
        return None
    try:
        history, chunks = StepHistory(), []
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {})["history"])
            if "patches" in meta:
                listed = [(f"{p}.", patch) for p, patch in enumerate(meta["patches"])]
            else:
                listed = [("", meta)]
            for prefix, saved in listed:
                patch = history.add(str(saved["sha256"]))
                for i, (name, start, length) in enumerate(saved["chunks"]):
                    at = f"{prefix}{i}"
                    positions, deltas = f.get_tensor(f"{at}.positions").numpy(), f.get_tensor(f"{at}.deltas").numpy()
                    chunks.append(ChunkHistory(positions, deltas))
                    patch.chunks[(str(name), int(start), int(length))] = chunks[-1]
        if _history_sha256(chunks) != meta.get("contents"):
            raise ValueError("its contents do not match the hash saved with them")
        return history
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        log.warning("ignoring the cached patch history %s: unreadable (%s)", path, e)
        return None


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
    history = _load_history(cache_dir / HISTORY_FILE)
    journal = [e for e in journal_entries(cache_dir) if e.step > step]
    return CachedState(step, state, digest, files, history, marker, journal)
