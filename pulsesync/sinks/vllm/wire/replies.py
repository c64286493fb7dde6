"""The replies of pulsesync's weight-transfer backend: one small JSON file per engine rank (pure but for the files).

vLLM's weight-transfer verbs (`/init_weight_transfer_engine`, `/update_weights`,
`/finish_weight_update`) return nothing to the caller, and a worker that raises leaves the other
workers' answers queued for the next call (vLLM 0.32's multiprocess executor stops reading at
the first error). So the backend never raises from a verb: after each one, every rank writes
what it did and what it holds to `<directory>/rank-<r>.json`, tagged with the caller's session
id, and the sidecar reads them. The directory is the sink's `update_dir`, which the engine
already reads update files from.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pulsesync.atomic_files import write_file
from pulsesync.errors import EngineError

MAX_REPLY_BYTES = 64 << 20  # a layout names every tensor with its region: well under this for any model
MAX_RANKS = 4096
_SESSION = re.compile(r"[0-9a-f]{32}")


def reply_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


def write_reply(directory: Path, rank: int, reply: dict[str, Any]) -> None:
    """Atomically replace this rank's reply."""
    write_file(reply_path(directory, rank), json.dumps(reply).encode())


def check_session(session: object) -> str:
    """A session id as the sink makes them (uuid4 hex); ValueError otherwise (it names files)."""
    if not isinstance(session, str) or not _SESSION.fullmatch(session):
        raise ValueError(f"not a pulsesync session id: {str(session)[:80]!r}")
    return session


def read_replies(directory: Path, session: str, verb: str, where: str) -> list[dict[str, Any]]:
    """Every rank's reply to `verb` tagged with this id, in rank order; EngineError if one is missing or malformed."""
    replies: list[dict[str, Any]] = []
    world = 1
    rank = 0
    while rank < world:
        path = reply_path(directory, rank)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_REPLY_BYTES + 1)
            reply = json.loads(data) if len(data) <= MAX_REPLY_BYTES else None
        except (OSError, ValueError, RecursionError) as e:
            raise EngineError(f"{where}: rank {rank} left no reply to {verb} at {path} ({e})") from None
        if not isinstance(reply, dict) or reply.get("session") != session or reply.get("verb") != verb:
            raise EngineError(f"{where}: rank {rank} did not answer {verb} for id {session} at {path}")
        if rank == 0:
            world = reply.get("world")  # type: ignore[assignment]
            if type(world) is not int or not 1 <= world <= MAX_RANKS:
                raise EngineError(f"{where}: rank 0 answered a world of {str(world)[:40]!r} ranks")
        if reply.get("rank") != rank or reply.get("world") != world:
            raise EngineError(f"{where}: {path} answered rank {reply.get('rank')!r} of {reply.get('world')!r}")
        replies.append(reply)
        rank += 1
    return replies
