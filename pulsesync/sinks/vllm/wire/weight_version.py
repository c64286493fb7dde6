"""The engine's weight version string: which verified step and state an engine holds, as vLLM reports it (pure).

vLLM keeps one free-form string per engine (`/finish_weight_update {"weight_version"}`, read back
by `GET /weight_info`; `"default"` after a start). pulsesync writes `pulsesync:<step>:<root>`
only once every worker holds that state; anything else (another writer's string, the default
after a restart, a truncated or oversized one) means the state is unknown.

A LoRA adapter has no version string; vLLM reports the path it was loaded from (`GET /v1/models`,
the adapter's `root`), so each step's adapter directory is named for its version:
`pulsesync-<step>-<root>` (`adapter_dir_name`, read back by `parse_adapter_dir`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

PREFIX = "pulsesync"
_VERSION = re.compile(rf"{PREFIX}:(\d{{1,18}}):([0-9A-Za-z_.+-]{{1,200}})")


class HeldPolicy(NamedTuple):
    """The verified step (and its state digest) that every worker of an engine holds."""

    step: int
    digest: str

    @property
    def version(self) -> str:
        """The weight version string that names it."""
        return f"{PREFIX}:{self.step}:{self.digest}"


def parse_version(version: object) -> HeldPolicy | None:
    """The step and digest a version string names; None for anything that is not exactly pulsesync's."""
    if not isinstance(version, str) or len(version) > 256:
        return None
    match = _VERSION.fullmatch(version)
    return HeldPolicy(int(match[1]), match[2]) if match else None


def adapter_dir_name(policy: HeldPolicy) -> str:
    """The directory an adapter's step is loaded from: its name says which step and state it holds."""
    return f"{PREFIX}-{policy.step:012d}-{policy.digest}"


_ADAPTER_DIR = re.compile(rf"{PREFIX}-(\d{{1,18}})-([0-9A-Za-z_.+-]{{1,200}})")


def parse_adapter_dir(path: object) -> HeldPolicy | None:
    """The step and digest an adapter's load path names (its last component); None for any other path."""
    if not isinstance(path, str) or len(path) > 4096:
        return None
    match = _ADAPTER_DIR.fullmatch(path.rstrip("/").rpartition("/")[2])
    return HeldPolicy(int(match[1]), match[2]) if match else None
