"""Sharded publishing settings: the deadline of a step's collectives."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ShardingConfig(BaseModel):
    """`sharding:` in a publisher config; used only when the trainer runs on more than one rank."""

    model_config = ConfigDict(extra="forbid")

    timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="a rank that does not reach a step's gather within this long (failed, hung, killed) fails the "
        "step on every rank: no marker is written, and the job's restart publishes an anchor",
    )
