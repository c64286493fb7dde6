"""Store settings: where published objects live and how the store is spoken to."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
        if parsed.scheme in ("http", "https"):  # an endpoint, not a store
            bucket, _, prefix = parsed.path.strip("/").partition("/")
            endpoint = f"{parsed.scheme}://{parsed.netloc}"
            raise ValueError(
                f"store url {v!r} is an endpoint; pass --store s3://{bucket or 'bucket'}/{prefix or 'prefix'} "
                f"--endpoint-url {endpoint} (store.url and store.endpoint_url in YAML)"
            )
        if parsed.scheme not in STORE_SCHEMES:
            raise ValueError(
                f"store url {v!r} must start with s3:// or file://: any S3-compatible service (R2, MinIO, GCS's "
                "XML API) is s3://bucket/prefix with --endpoint-url, a local or shared filesystem file:///path"
            )
        if parsed.scheme == "s3" and not parsed.netloc:
            raise ValueError(f"store url {v!r} names no bucket (s3://bucket/prefix)")
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            # file://data/x would silently mean /x: the host is not part of the path
            raise ValueError(f"store url {v!r} names host {parsed.netloc!r}; a local path is file:///path")
        if parsed.scheme == "file" and not parsed.path:
            raise ValueError(f"store url {v!r} names no path (file:///path)")
        return v
