"""Configuration: YAML files validated by pydantic, with command-line flags overriding file values.

Unknown keys and bad values fail at start with a ConfigError naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pulsesync.codec.params import CodecParams
from pulsesync.errors import ConfigError
from pulsesync.store.retry import RetryPolicy

STORE_SCHEMES = ("s3", "file")


class StoreConfig(BaseModel):
    """Where published objects live."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(None, description="s3://bucket/prefix or file:///path/prefix")
    endpoint_url: str | None = Field(None, description="S3 endpoint for R2, MinIO or any S3-compatible server")
    region: str | None = Field(None, description="S3 region; default from the AWS config chain")
    addressing_style: Literal["auto", "path", "virtual"] = Field("auto", description="S3 bucket addressing")
    part_size: int = Field(8 << 20, ge=5 << 20, description="multipart part / ranged GET size in bytes (boto3 default)")
    concurrency: int = Field(8, ge=1, le=256, description="parts or ranges in flight per transfer")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="retries of transient store errors")

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parsed = urlparse(v)
        if parsed.scheme not in STORE_SCHEMES:
            raise ValueError(f"store url {v!r} must start with s3:// or file://")
        if parsed.scheme == "s3" and not parsed.netloc:
            raise ValueError(f"store url {v!r} names no bucket (s3://bucket/prefix)")
        if parsed.scheme == "file" and not parsed.path:
            raise ValueError(f"store url {v!r} names no path (file:///path)")
        return v


class Config(BaseModel):
    """Settings every command shares; each daemon's config extends this."""

    model_config = ConfigDict(extra="forbid")

    store: StoreConfig = Field(default_factory=StoreConfig)
    codec: CodecParams = Field(default_factory=CodecParams)


# Non-weight files of a checkpoint directory that anchors carry, so an anchor opens with
# transformers' from_pretrained, vLLM and SGLang as is (config, generation config, tokenizer).
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


class RetentionPolicy(BaseModel):
    """What the retention worker keeps (PULSE's defaults: the newest 100 patches and 10 anchors)."""

    model_config = ConfigDict(extra="forbid")

    keep_patches: int = Field(
        100, ge=0, description="newest patches kept, with every patch and anchor on their chains back to an anchor"
    )
    keep_anchors: int = Field(10, ge=0, description="newest anchors kept")
    grace_seconds: float = Field(
        600.0,
        ge=0,
        description="payloads are deleted this long after their ready marker; longer than the slowest reader's "
        "download, and unreferenced payloads must be this old (a publish may still be uploading them)",
    )
    interval_seconds: float = Field(3600.0, gt=0, description="time between runs of the retention daemon")
    dry_run: bool = Field(False, description="print the plan, delete nothing")


class RetentionConfig(Config, RetentionPolicy):
    """`pulsesync retain`: the retention worker."""


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
    cache_dir: Path | None = Field(None, description="keeps the last committed state for a fast restart")
    spool_dir: Path | None = Field(None, description="where anchor shards are written before upload (default: tmp)")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus /metrics on this port")
    watch: WatchConfig = Field(default_factory=WatchConfig)
    retention: RetentionPolicy | None = Field(None, description="run the retention worker inside the publisher")


class DirectorySinkConfig(BaseModel):
    """An HF-layout directory per verified step under out_dir, with an atomically swapped `current` link."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["directory"] = "directory"
    out_dir: Path = Field(description="where step-<N>/ directories and the `current` symlink live")
    keep: int = Field(2, ge=1, description="step directories kept (the newest; older ones are removed)")
    shard_size: int = Field(5 * 10**9, ge=1 << 16, description="largest safetensors shard in bytes")


class CommandSinkConfig(BaseModel):
    """Run a command after each update, with PULSESYNC_STEP and PULSESYNC_DIR in its environment."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["command"] = "command"
    argv: list[str] = Field(min_length=1, description="the command and its arguments (no shell)")
    timeout_seconds: float = Field(600.0, gt=0, description="kill the command after this long")


class SGLangSinkConfig(BaseModel):
    """Tell an SGLang server to load each step's directory: pause, update_weights_from_disk, continue."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["sglang"] = "sglang"
    url: str = Field(description="the SGLang server, e.g. http://127.0.0.1:30000")
    pause_mode: Literal["retract", "in_place", "abort"] = Field("retract", description="how generation pauses")
    timeout_seconds: float = Field(600.0, gt=0, description="per request")


class VLLMSinkConfig(BaseModel):
    """Apply each update to a vLLM server through pulsesync's worker extension (collective_rpc)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["vllm"] = "vllm"
    url: str = Field(description="the vLLM server, e.g. http://127.0.0.1:8000 (started with VLLM_SERVER_DEV_MODE=1)")
    update_dir: Path = Field(description="where update files are written; the vLLM workers must read this path")
    timeout_seconds: float = Field(600.0, gt=0, description="per request")


SinkConfig = Annotated[
    DirectorySinkConfig | CommandSinkConfig | SGLangSinkConfig | VLLMSinkConfig, Field(discriminator="type")
]


class SubscriberConfig(Config):
    """`pulsesync subscribe` and the in-process Subscriber."""

    trusted_keys: list[Path] = Field(default_factory=list, description="public keys whose manifests are accepted")
    cache_dir: Path | None = Field(None, description="the verified state persists here; a restart resumes from it")
    out_dir: Path | None = Field(None, description="shorthand for a `directory` sink writing here")
    step: int | None = Field(None, ge=0, description="sync to this step instead of the newest")
    poll_seconds: float = Field(2.0, gt=0, description="how often the daemon lists new ready markers")
    retry_initial_seconds: float = Field(1.0, gt=0, description="first wait after a failed sync; doubles each time")
    retry_max_seconds: float = Field(60.0, gt=0, description="longest wait between failed syncs")
    unhealthy_after: int = Field(5, ge=1, description="consecutive failed syncs before /healthz reports unhealthy")
    once_attempts: int = Field(3, ge=1, description="syncs --once tries before giving up")
    sinks: list[SinkConfig] = Field(default_factory=list, description="where verified states go, in order")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve /metrics and /healthz on this port")


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {part!r} must be a mapping to set {dotted}")
        node = child
    node[leaf] = value


def load_config(
    model: type[ConfigT], path: Path | str | None = None, overrides: dict[str, Any] | None = None
) -> ConfigT:
    """Load `model` from a YAML file (optional), then apply dotted-key overrides that are not None."""
    source = f"config file {path}" if path else "command line"
    tree: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"config file {path}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: invalid YAML ({e})".replace("\n", " ")) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        tree = loaded or {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, dotted, value)
    try:
        return model.model_validate(tree)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ConfigError(f"{source}: {key}: {err['msg']}{more}") from None
