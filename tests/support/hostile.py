"""Hostile tree shapes an attacker with write access to a file store's directory can create."""

from __future__ import annotations

import os
from pathlib import Path


def deep_folder(parent: Path, levels: int, name: str = "d") -> Path:
    """A chain of `levels` nested folders under parent (created one level at a time, no recursion); the deepest."""
    parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):  # descend by file descriptor: the path itself may pass PATH_MAX
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    return parent / name


def remove_deep_folder(top: Path, name: str = "d") -> None:
    """Remove a chain made by deep_folder without recursion (Python 3.11's shutil.rmtree recurses per level)."""
    if not top.exists():
        return
    fds = [os.open(top, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        while True:  # walk down to the deepest folder, keeping each level open
            try:
                fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
            except FileNotFoundError:
                break
        for entry in os.listdir(fds[-1]):
            os.unlink(entry, dir_fd=fds[-1])
        while len(fds) > 1:  # then back up, removing each level's only folder and any files beside it
            os.close(fds.pop())
            os.rmdir(name, dir_fd=fds[-1])
            for entry in os.listdir(fds[-1]):
                os.unlink(entry, dir_fd=fds[-1])
    finally:
        for fd in fds:
            os.close(fd)
    top.rmdir()
