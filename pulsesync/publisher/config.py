"""Publisher settings: anchors, backpressure, resume, the files anchors carry, the watch source."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pulsesync.config import Config
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.sharding.config import ShardingConfig

# Non-weight files of a checkpoint directory that anchors carry, so an anchor opens with
# transformers' from_pretrained, vLLM and SGLang as is (config, generation config, tokenizer, a
# LoRA adapter's config).
DEFAULT_ANCHOR_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "*.tiktoken",
    "adapter_config.json",  # a PEFT adapter's (the vllm_lora sink loads its directory)
]


class WatchConfig(BaseModel):
    """How `pulsesync publish --watch DIR` finds complete checkpoints."""

    model_config = ConfigDict(extra="forbid")

    poll_seconds: float = Field(2.0, gt=0, description="how often DIR is scanned for new checkpoints")
    settle_seconds: float = Field(
        2.0, ge=0, description="a checkpoint is read only after none of its files changed for this long"
    )
    completion_file: str | None = Field(
        None, description="file name whose presence marks a checkpoint complete (e.g. trainer_state.json)"
    )
    delete_consumed: bool = Field(False, description="delete each checkpoint directory once it is read")


class PublisherConfig(Config):
    """`pulsesync publish` and the in-process Publisher."""

    signing_key: Path | None = Field(None, description="Ed25519 private key (pulsesync keygen)")
    anchor_interval: int = Field(50, ge=1, description="an anchor every K published steps (PULSE's k)")
    anchor_bytes_budget: int | None = Field(
        None, ge=1, description="also anchor once patch bytes since the last anchor exceed this"
    )
    shard_size: int = Field(5 * 10**9, ge=1 << 16, description="largest anchor shard in bytes (HF default 5 GB)")
    anchor_files: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ANCHOR_FILES),
        description="glob patterns of checkpoint files (non-weights) copied into anchors",
    )
    extra_files: list[Path] = Field(default_factory=list, description="more files every anchor carries")
    on_backpressure: Literal["skip", "block"] = Field(
        "skip", description="when uploads fall behind: publish the newest state (skip) or make publish() wait"
    )
    max_pending: int = Field(1, ge=1, description="snapshots queued behind the one being published")
    resume: bool = Field(False, description="rebuild the baseline from the store at start instead of anchoring")
    cache_dir: Path | None = Field(
        None,
        description="keeps the last committed state for a fast restart (sharded: each rank's objects since its "
        "last anchor, under rank-NNNNN/)",
    )
    take_over_prefix: bool = Field(
        False,
        description="publish into a prefix that holds another stream's markers (another key or job) instead of "
        "refusing it: a new stream starts with an anchor, after the newest marker there (logged)",
    )
    spool_dir: Path | None = Field(None, description="where anchor shards are written before upload (default: tmp)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics on this port")
    watch: WatchConfig = Field(default_factory=WatchConfig)
    retention: RetentionPolicy | None = Field(None, description="run the retention worker inside the publisher")
    sharding: ShardingConfig = Field(
        default_factory=ShardingConfig, description="a trainer on several ranks: each publishes what it owns"
    )
