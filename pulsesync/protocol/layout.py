"""Key names in the store and the chain they form (pure): zero-padded, so listing order is step order.

{prefix}/patches/{step:012d}/...        patch payload object(s)
{prefix}/anchors/{step:012d}/...        anchor shards, index, config files
{prefix}/ready/{step:012d}.patch.json   signed patch manifest = its ready marker
{prefix}/ready/{step:012d}.anchor.json  signed anchor manifest = its ready marker
{prefix}/retention/{step:012d}.{kind}.json  a marker retention removed: its payload, due for deletion
{prefix}/pointer                        the newest marker's key, rewritten after each commit: a hint
                                        that lets subscribers poll with a conditional GET, not a LIST

Payload names inside a step's folder carry the writing publisher's run id, so two publishers (or a
crashed attempt and its restart) never write the same payload key: nothing is ever overwritten,
and the ready marker, written last with put-if-absent, decides which object set a step is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["patch", "anchor"]
STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
_RUN_ID_RE = re.compile(r"[0-9a-z]{1,32}")
READY_PREFIX = "ready/"
# [0-9], not \d (which takes any Unicode digit); fullmatch, since $ also matches before a final newline.
_READY_RE = re.compile(r"([0-9]{12})\.(patch|anchor)\.json")
_PAYLOAD_RE = re.compile(r"(?:patches|anchors)/([0-9]{12})/.+", re.DOTALL)
_PATCH_RE = re.compile(r"patches/[0-9]{12}/patch-([0-9a-z]{1,32})\.bin")


def _check_step(step: int) -> int:
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} is outside 0..{MAX_STEP}")
    return step


def step_name(step: int) -> str:
    """Zero-padded step: lexicographic order equals numeric order."""
    return f"{_check_step(step):0{STEP_DIGITS}d}"


def patch_prefix(step: int) -> str:
    """Folder of a step's patch payload objects."""
    return f"patches/{step_name(step)}/"


def _check_run_id(run_id: str) -> str:
    if not _RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-32 lowercase letters or digits")
    return run_id


def patch_key(step: int, run_id: str) -> str:
    """Key of the patch payload object that publisher run `run_id` wrote for a step."""
    return f"{patch_prefix(step)}patch-{_check_run_id(run_id)}.bin"


def next_patch_key(key: str, step: int) -> str | None:
    """The key the run that wrote patch `key` gives its patch of `step`; None if `key` is no patch_key."""
    match = _PATCH_RE.fullmatch(key)
    return patch_key(step, match.group(1)) if match else None


def anchor_prefix(step: int) -> str:
    """Folder of a step's anchor shards and files."""
    return f"anchors/{step_name(step)}/"


def part_key(step: int, run_id: str, rank: int) -> str:
    """Key of one rank's part of a sharded step's patch (docs/sharding.md)."""
    return f"{patch_prefix(step)}part-{rank:05d}-{_check_run_id(run_id)}.bin"


def anchor_dir(step: int, run_id: str) -> str:
    """Folder of the anchor that publisher run `run_id` wrote for a step: an HF model directory."""
    return f"{anchor_prefix(step)}{_check_run_id(run_id)}/"


def ready_key(step: int, kind: Kind) -> str:
    """Key of a step's ready marker (its signed manifest)."""
    return f"{READY_PREFIX}{step_name(step)}.{kind}.json"


@dataclass(frozen=True, order=True)
class ReadyEntry:
    """A parsed ready-marker key."""

    step: int
    kind: Kind


def parse_ready_key(key: str, folder: str = READY_PREFIX) -> ReadyEntry | None:
    """(step, kind) of a ready-marker key (or, with folder=TOMBSTONE_PREFIX, a tombstone key), or None."""
    name = key.removeprefix(folder)
    match = _READY_RE.fullmatch(name) if name != key else None
    if match is None:
        return None
    return ReadyEntry(int(match.group(1)), match.group(2))  # type: ignore[arg-type]


POINTER_KEY = "pointer"
MAX_POINTER_BYTES = 256  # a marker key is 30 bytes; anything larger is not a pointer


def pointer_body(step: int, kind: Kind) -> bytes:
    """What the pointer holds after a commit: the key of the marker just written."""
    return ready_key(step, kind).encode()


def step_of_payload(key: str) -> int | None:
    """The step folder a payload key lies in (patches/ or anchors/), or None for any other key."""
    match = _PAYLOAD_RE.fullmatch(key)
    return int(match.group(1)) if match else None


TOMBSTONE_PREFIX = "retention/"


def tombstone_key(step: int, kind: Kind) -> str:
    """Key of the record retention keeps of a removed ready marker until its payload is deleted."""
    return f"{TOMBSTONE_PREFIX}{step_name(step)}.{kind}.json"


@dataclass(frozen=True)
class Walk:
    """Where following base_step links from a step ended."""

    patches: list[int]  # the patch steps passed through, from the start down
    end: int  # the step the walk stopped at
    complete: bool  # False: `end` has no ready patch, so the chain is broken there


def walk_links(start: int, stop_at: Callable[[int], bool]) -> Generator[int, int | None, Walk]:
    """Follow base_step links from `start` until `stop_at(step)` holds: the one link walker (pure, sans-I/O).

    Yields each step whose base it needs and is sent that step's base_step, or None where the
    step has no ready patch; returns the Walk. Callers that know every link use walk_known; the
    chain client drives it with verified manifests fetched one link at a time.
    """
    patches: list[int] = []
    at = start
    while not stop_at(at):
        base = yield at
        if base is None:
            return Walk(patches, at, complete=False)
        patches.append(at)
        at = base
    return Walk(patches, at, complete=True)


def walk_known(start: int, stop_at: Callable[[int], bool], bases: Mapping[int, int]) -> Walk:
    """walk_links over links already known: `bases` maps each patch's step to its base_step."""
    walker = walk_links(start, stop_at)
    try:
        at = next(walker)
        while True:
            at = walker.send(bases.get(at))
    except StopIteration as done:
        walk: Walk = done.value
        return walk
