"""The sinks' settings: what a subscriber config's `sinks:` list holds (no sink code is loaded to read them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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
    pause_mode: Literal["retract", "abort"] = Field(
        "retract", description="how generation pauses (in_place would keep caches the flush cannot clear)"
    )
    api_key: str | None = Field(None, description="bearer token, for a server started with --api-key/--admin-api-key")
    timeout_seconds: float = Field(600.0, gt=0, description="per request")


class VLLMSinkConfig(BaseModel):
    """Apply each verified state to a vLLM server: its weight-transfer API, or pulsesync's worker extension."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["vllm"] = "vllm"
    url: str = Field(description="the vLLM server, e.g. http://127.0.0.1:8000 (started with VLLM_SERVER_DEV_MODE=1)")
    engine_api: Literal["auto", "weight_transfer", "worker_extension"] = Field(
        "auto",
        description="auto: the path the server was launched with, read from its GET /server_info; "
        "weight_transfer: vLLM 0.32+ started with --weight-transfer-config "
        '\'{"backend": "pulsesync"}\'; worker_extension: started with --worker-extension-cls '
        "pulsesync.sinks.vllm.engine.extension.PulseSyncWorkerExtension. A setting the server was not launched with "
        "stops the delivery before any call that could fail inside vLLM, naming the fix",
    )
    update_dir: Path = Field(
        description="where update files (and the backend's reply files) are written; the vLLM workers must read "
        "and write this path"
    )
    pause_mode: Literal["wait", "abort", "keep"] = Field(
        "wait", description="POST /pause mode: drain running requests, abort them, or freeze them (recomputed after)"
    )
    api_key: str | None = Field(
        None, description="bearer token, for a server started with --api-key (it guards the dev-mode routes too)"
    )
    timeout_seconds: float = Field(600.0, gt=0, description="per request")

    @field_validator("update_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()  # the engine resolves paths from its own working directory


class VLLMLoRASinkConfig(BaseModel):
    """Serve each verified step of a LoRA adapter from a vLLM server under one name (`/v1/load_lora_adapter`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["vllm_lora"] = "vllm_lora"
    url: str = Field(
        description="the vLLM server, e.g. http://127.0.0.1:8000 (started with --enable-lora, "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and VLLM_SERVER_DEV_MODE=1)"
    )
    adapter_name: str = Field(min_length=1, description="the name requests use (`model`): one adapter, every step")
    adapter_dir: Path = Field(
        description="where each step's adapter directory is written; the vLLM server must read this path"
    )
    keep: int = Field(2, ge=1, description="adapter directories kept (the served one always)")
    pause_mode: Literal["wait", "abort", "keep"] = Field(
        "wait", description="POST /pause mode around the load: drain running requests, abort them, or freeze them"
    )
    api_key: str | None = Field(None, description="bearer token, for a server started with --api-key")
    timeout_seconds: float = Field(600.0, gt=0, description="per request")

    @field_validator("adapter_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()  # vLLM reads it from its own working directory


SinkConfig = Annotated[
    DirectorySinkConfig | CommandSinkConfig | SGLangSinkConfig | VLLMSinkConfig | VLLMLoRASinkConfig,
    Field(discriminator="type"),
]
