"""Atomic local files: every local writer (file store, state cache, keys, sinks) goes through here.

A file is written under a unique hidden temporary name beside its destination, fsynced, then
renamed over it (or linked to it, for an exclusive create), and the directory is fsynced: a
reader or a crash sees the old file or the new one, never a torn one. Temporary names carry
TEMP_MARK, so listings can skip what a crashed writer left behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_MARK = ".pulsesync-tmp-"


def temp_path(path: Path) -> Path:
    """A unique hidden sibling of path."""
    return path.with_name(f".{path.name}{TEMP_MARK}{uuid.uuid4().hex}")


def fsync_dir(path: Path) -> None:
    """Make a rename, link or unlink in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else (a library that takes a path) to disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


class AtomicFile:
    """A temporary file that becomes `path` on commit; with `mode`, it has that mode from its creation.

    Write to `file`, then call `commit` (replace), `commit_exclusive` (create only) or `discard`;
    each may run on a worker thread.
    """

    def __init__(self, path: Path, mode: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.temp = temp_path(self.path)
        fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        self.file: BinaryIO = os.fdopen(fd, "wb")
        self._mode = mode

    def _seal(self) -> None:
        self.file.flush()
        if self._mode is not None:  # O_CREAT's mode is masked by the umask
            os.fchmod(self.file.fileno(), self._mode)
        os.fsync(self.file.fileno())
        self.file.close()

    def commit(self) -> None:
        """Make the written bytes `path`, replacing what was there."""
        try:
            self._seal()
            os.replace(self.temp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_dir(self.path.parent)

    def commit_exclusive(self) -> None:
        """Make the written bytes `path` only if nothing has that name; FileExistsError otherwise."""
        try:
            self._seal()
            os.link(self.temp, self.path)  # fails if the name exists, also on NFS
        finally:
            self.discard()
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Drop the temporary file."""
        self.file.close()
        self.temp.unlink(missing_ok=True)


def write_file(path: Path, data: bytes, *, exclusive: bool = False, mode: int | None = None) -> None:
    """Write bytes to path atomically; with exclusive, FileExistsError if path exists (nothing written)."""
    f = AtomicFile(path, mode)
    try:
        f.file.write(data)
    except BaseException:
        f.discard()
        raise
    f.commit_exclusive() if exclusive else f.commit()


def replace_with(path: Path, write: Callable[[Path], object]) -> None:
    """Atomically replace path with what `write` writes to the path it is given (for libraries that take paths)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a fully written directory into place: fsync its files, rename, fsync the parent."""
    for child in tmp.iterdir():
        if child.is_file():
            fsync_file(child)
    fsync_dir(tmp)
    os.replace(tmp, final)
    fsync_dir(final.parent)


def replace_symlink(link: Path, target: str) -> None:
    """Point `link` at `target` atomically (a new link renamed over the old)."""
    tmp = temp_path(link)
    tmp.symlink_to(target)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(link.parent)
