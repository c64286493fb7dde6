"""The verl backend's settings: `rollout.checkpoint_engine.engine_kwargs.pulsesync` in a verl config.

verl hands the same keyword arguments to the backend on both sides: the actor ranks read
`publisher`, the rollout workers `subscriber`; each side needs only its own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pulsesync.publisher.config import PublisherConfig
from pulsesync.subscriber.config import SubscriberConfig

WireFormat = Literal["delta_flush", "named_tensors"]


class VerlBackendConfig(BaseModel):
    """What `CheckpointEngineRegistry.new("pulsesync", bucket_size=..., **engine_kwargs)` is given."""

    model_config = ConfigDict(extra="forbid")

    publisher: PublisherConfig | None = Field(
        None, description="the actor side: the store written, the signing key (read on actor rank 0 only), anchors"
    )
    subscriber: SubscriberConfig | None = Field(
        None, description="the rollout side: the stores read (a regional mirror first), trusted keys, cache_dir"
    )
    wait_seconds: float = Field(
        600.0, gt=0, description="how long a rollout worker waits for the step verl asks for before it fails"
    )
    wire_format: WireFormat = Field(
        "delta_flush",
        description="what the rollout side yields to verl's server adapter: `delta_flush` (changed positions and "
        "values; verl's vLLM and SGLang adapters) or `named_tensors` (every changed tensor whole; any adapter)",
    )
