"""Checkpoints a trainer writes to disk: which are complete, and their weights and config files.

A checkpoint is a directory `checkpoint-<step>/` (HF Trainer) or `<step>/` holding
`*.safetensors` files (sharded with `model.safetensors.index.json`, or one file), or a single
`.safetensors` file. It counts as complete only when the configured completion file exists, every
shard the index lists is present, every safetensors file is exactly as long as its header
says, and no file in it changed for `settle_seconds`: a half-written file is never read.
"""

from __future__ import annotations

import json
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pulsesync.errors import IntegrityError, NotFoundError
from pulsesync.model_dir import INDEX_FILE, SHARD_NAME
from pulsesync.publisher.config import WatchConfig

CHECKPOINT_DIR = re.compile(r"^(?:checkpoint-)?(\d+)$")
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header


@dataclass(frozen=True, order=True)
class Checkpoint:
    """A checkpoint directory and the step its name gives."""

    step: int
    path: Path


def find_checkpoints(root: Path) -> list[Checkpoint]:
    """Checkpoint directories directly under root, in step order."""
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = CHECKPOINT_DIR.match(child.name)
        if match and child.is_dir():
            found.append(Checkpoint(int(match.group(1)), child))
    return sorted(found)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (or the file itself)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def safetensors_incomplete(path: Path) -> str | None:
    """Why a safetensors file is not completely written yet (None when its size matches its header)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path.name}: {size} bytes, shorter than a safetensors header"
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _HEADER_LIMIT or 8 + header_len > size:
            return f"{path.name}: header not completely written"
        try:
            header = json.loads(f.read(header_len))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{path.name}: header not valid JSON yet"
    expected = 8 + header_len + end
    return None if size == expected else f"{path.name}: {size} bytes of {expected}"


def incomplete_reason(path: Path, watch: WatchConfig, now: float | None = None) -> str | None:
    """Why a checkpoint is not complete yet, or None when it may be read."""
    if watch.completion_file and not (path / watch.completion_file).exists():
        return f"no {watch.completion_file} yet"
    weights = weight_files(path)
    if not weights:
        return "no *.safetensors file yet"
    index = path / INDEX_FILE
    sharded = [m for w in weights if (m := SHARD_NAME.search(w.name))]
    if sharded and not index.exists():
        return f"{INDEX_FILE} not written yet"
    if sharded and len(weights) < int(sharded[0].group(1)):
        return f"{len(weights)} of {sharded[0].group(1)} shards written"
    if index.exists():
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{INDEX_FILE} not complete yet"
        if missing := listed - {w.name for w in weights}:
            return f"shard {sorted(missing)[0]} not written yet"
    for w in weights:
        if reason := safetensors_incomplete(w):
            return reason
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    newest = max(p.stat().st_mtime for p in files)
    age = (time.time() if now is None else now) - newest
    if age < watch.settle_seconds:
        return f"written {age:.1f}s ago (settle_seconds {watch.settle_seconds})"
    return None


def check_checkpoint(path: Path) -> list[Path]:
    """A checkpoint's weight files; NotFoundError or IntegrityError when there is no checkpoint at `path`."""
    if not path.exists():
        raise NotFoundError(f"checkpoint {path}: no such file or directory")
    if not (weights := weight_files(path)):
        raise IntegrityError(f"checkpoint {path}: no *.safetensors files")
    return weights


def load_checkpoint(path: Path, anchor_files: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """The weights of a checkpoint and its non-weight files that anchors carry (by glob pattern)."""
    state: dict[str, torch.Tensor] = {}
    weights = check_checkpoint(path)
    for w in weights:
        try:
            shard = load_file(w)
        except (SafetensorError, OSError) as e:
            raise IntegrityError(f"checkpoint {w}: cannot be read as safetensors ({e})") from None
        if duplicate := state.keys() & shard.keys():
            raise IntegrityError(f"checkpoint {path}: tensor {sorted(duplicate)[0]!r} is in two files")
        state.update(shard)
    files: dict[str, Path] = {}
    if path.is_dir():
        for pattern in anchor_files:
            files.update({p.name: p for p in sorted(path.glob(pattern)) if p.is_file()})
    return state, files
