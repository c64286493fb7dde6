"""The `directory` sink: `out_dir/step-<N>/` in HF layout and an atomically swapped `current` symlink.

Each step is written into a hidden temporary directory, fsynced and renamed into place, then
`current` is re-pointed with a rename (atomic on POSIX): an engine loading `out_dir/current`
sees a complete step, old or new. Each step directory records its step and state digest in
`pulsesync.json` and is reused only when both match (an out_dir may hold another run's step-N).
Older step directories beyond `keep` are removed, except those an engine still reads (`pinned`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pulsesync.atomic_files import publish_dir, replace_symlink
from pulsesync.model_dir import write_model_dir
from pulsesync.sinks.base import Sink, Update
from pulsesync.sinks.config import DirectorySinkConfig
from pulsesync.threads import in_thread_to_completion

CURRENT = "current"
RECORD = "pulsesync.json"  # {"step": N, "digest": ROOT}: what the directory holds


def step_dir_name(step: int) -> str:
    """Name of a step's directory (zero-padded: name order is step order)."""
    return f"step-{step:012d}"


class DirectorySink(Sink):
    """Writes each verified state as a loadable HF model directory."""

    name = "directory"

    writes_first = True  # engine sinks (SGLang's) load the directory it writes

    @classmethod
    def build(cls, config: Any, pinned: Callable[[], set[Path]]) -> Sink:
        """A directory sink that never prunes what another sink's engine reads."""
        return cls(config, pinned)

    def __init__(self, config: DirectorySinkConfig, pinned: Callable[[], set[Path]] = set) -> None:
        self.config = config
        self._pinned = pinned  # directories an engine reads from: never pruned

    async def deliver(self, update: Update) -> None:
        """Write step-<N>/, swap `current` to it, prune old steps; sets update.directory."""
        # Reads update.state, which the subscriber may roll back on failure: never leave it running.
        update.directory = await in_thread_to_completion(self._write, update)

    def _write(self, update: Update) -> Path:
        out = self.config.out_dir
        out.mkdir(parents=True, exist_ok=True)
        final = out / step_dir_name(update.step)
        record = {"step": update.step, "digest": update.digest.root}
        if recorded(final) != record:
            tmp = out / f".{final.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            for name in write_model_dir(update.state, tmp, self.config.shard_size, update.files):
                os.chmod(tmp / name, 0o644)  # engines in other containers often run as another user
            (tmp / RECORD).write_text(json.dumps(record))
            if final.exists():  # another run's step, or an unfinished one: set aside, never served
                stale = out / f".{final.name}.stale-{os.getpid()}"
                os.replace(final, stale)
                shutil.rmtree(stale, ignore_errors=True)
            publish_dir(tmp, final)
        replace_symlink(out / CURRENT, final.name)  # relative: the directory can be mounted elsewhere
        keep = {final, *(p.resolve() for p in self._pinned())}
        steps = sorted(p for p in out.iterdir() if p.name.startswith("step-") and p.is_dir())
        for old in steps[: -self.config.keep]:
            if old.resolve() not in keep:
                shutil.rmtree(old, ignore_errors=True)
        return final


def recorded(directory: Path) -> dict[str, object] | None:
    """The step and digest a step directory records, None when it records none."""
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
