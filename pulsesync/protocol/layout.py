"""Key names in the store and the chain they form (pure): zero-padded, so listing order is step order.

{prefix}/patches/{step:012d}/...        patch payload object(s)
{prefix}/anchors/{step:012d}/...        anchor shards, index, config files
{prefix}/ready/{step:012d}.json         the step's commit: its signed manifest (a patch or an anchor)
{prefix}/ready-anchors/{step:012d}.json the signed manifest of an anchor of a step committed as a patch
{prefix}/retention/{step:012d}.{kind}.json  a marker retention removed: its payload, due for deletion
{prefix}/pointer                        the newest commit's key, rewritten after each commit: a hint
                                        that lets subscribers poll with a conditional GET, not a LIST

Payload names inside a step's folder carry the writing publisher's run id, so two publishers (or a
crashed attempt and its restart) never write the same payload key: nothing is ever overwritten.
A step has one commit key whatever its kind, written last with put-if-absent: of two publishers
racing for a step, exactly one commits it. An anchor uploaded after its step's patch committed is
an extra, signed representation of the same state (ready-anchors/), written only by the
publisher that committed the step.

Older prefixes hold `ready/{step:012d}.patch.json` and `ready/{step:012d}.anchor.json` (one key per
kind, `LEGACY_KINDS`); they are still read, never written.
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
ANCHOR_READY_PREFIX = "ready-anchors/"
# [0-9], not \d (which takes any Unicode digit); fullmatch, since $ also matches before a final newline.
_COMMIT_RE = re.compile(r"([0-9]{12})\.json")
_KIND_RE = re.compile(r"([0-9]{12})\.(patch|anchor)\.json")  # legacy markers; tombstones
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


def commit_key(step: int) -> str:
    """Key of a step's commit: the one ready marker put-if-absent decides, whatever the step's kind."""
    return f"{READY_PREFIX}{step_name(step)}.json"


def anchor_ready_key(step: int) -> str:
    """Key of the signed manifest of an anchor added to a step its publisher committed as a patch."""
    return f"{ANCHOR_READY_PREFIX}{step_name(step)}.json"


def legacy_ready_key(step: int, kind: Kind) -> str:
    """Key of a step's patch or anchor marker in older prefixes (read, never written)."""
    return f"{READY_PREFIX}{step_name(step)}.{kind}.json"


@dataclass(frozen=True, order=True)
class ReadyEntry:
    """A parsed ready-marker key: its step, and its kind where the key says it (None: a commit key)."""

    step: int
    kind: Kind | None


def parse_ready_key(key: str) -> ReadyEntry | None:
    """The entry a key under ready/ names: a commit key (kind None) or a legacy marker key; None otherwise."""
    name = key.removeprefix(READY_PREFIX)
    if name == key:
        return None
    if match := _COMMIT_RE.fullmatch(name):
        return ReadyEntry(int(match.group(1)), None)
    if match := _KIND_RE.fullmatch(name):
        return ReadyEntry(int(match.group(1)), match.group(2))  # type: ignore[arg-type]
    return None


def parse_anchor_ready_key(key: str) -> int | None:
    """The step an anchor marker key under ready-anchors/ names, or None."""
    name = key.removeprefix(ANCHOR_READY_PREFIX)
    match = _COMMIT_RE.fullmatch(name) if name != key else None
    return int(match.group(1)) if match else None


POINTER_KEY = "pointer"
MAX_POINTER_BYTES = 256  # a marker key is 30 bytes; anything larger is not a pointer


def pointer_body(step: int) -> bytes:
    """What the pointer holds after a commit: the key of the commit just written."""
    return commit_key(step).encode()


def step_of_payload(key: str) -> int | None:
    """The step folder a payload key lies in (patches/ or anchors/), or None for any other key."""
    match = _PAYLOAD_RE.fullmatch(key)
    return int(match.group(1)) if match else None


TOMBSTONE_PREFIX = "retention/"


def tombstone_key(step: int, kind: Kind) -> str:
    """Key of the record retention keeps of a removed ready marker until its payload is deleted."""
    return f"{TOMBSTONE_PREFIX}{step_name(step)}.{kind}.json"


def parse_tombstone_key(key: str) -> tuple[int, Kind] | None:
    """(step, kind) of a tombstone key, or None."""
    name = key.removeprefix(TOMBSTONE_PREFIX)
    match = _KIND_RE.fullmatch(name) if name != key else None
    return (int(match.group(1)), match.group(2)) if match else None  # type: ignore[return-value]


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
