"""Bench contracts: each bench states its bounds once, prints every verdict, and exits 1 if one is broken."""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Contract:
    """One bound on one measured number: `value <= bound` (at_most) or `value >= bound`."""

    name: str
    value: float
    bound: float
    at_most: bool = True

    @property
    def holds(self) -> bool:
        """Whether the measured value is within its bound."""
        return self.value <= self.bound if self.at_most else self.value >= self.bound

    def line(self) -> str:
        """`name: value (contract <= bound): ok|BROKEN`."""
        op = "<=" if self.at_most else ">="
        return f"{self.name}: {self.value:.4g} (contract {op} {self.bound:g}): {'ok' if self.holds else 'BROKEN'}"


def enforce(contracts: list[Contract]) -> None:
    """Print each contract's verdict; exit 1 naming the broken ones, if any."""
    for contract in contracts:
        print(contract.line())
    if broken := [c.name for c in contracts if not c.holds]:
        sys.exit(f"contract broken: {', '.join(broken)}")
