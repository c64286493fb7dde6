"""Signed manifests: the description of one published patch or anchor, and its ready marker.

Manifests are canonical JSON (sorted keys, compact, UTF-8) signed with Ed25519 over everything
but the signature. Verification checks the signature over the canonical form of the bytes as
received, before trusting any field, so no coercion or re-serialization can hide a tamper.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from pulsesync.digest import StateDigest
from pulsesync.errors import ManifestError, ReplayError, UnknownKeyError, UnsupportedVersionError
from pulsesync.protocol import signing

MANIFEST_VERSION: Literal[1] = 1
MAX_MANIFEST_BYTES = 1 << 20  # a manifest of a 10k-tensor, 100-shard anchor is ~30 KB
_SHA256_HEX = r"^[0-9a-f]{64}$"


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8; integers and strings only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def utc_now() -> str:
    """Current time as RFC 3339 UTC with a Z suffix, second precision."""
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _parse_time(rfc3339: str) -> dt.datetime:
    return dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ObjectRef(_Strict):
    """One object a manifest covers: its key, exact size and SHA-256."""

    key: str = Field(min_length=1)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=_SHA256_HEX)

    @classmethod
    def for_bytes(cls, key: str, data: bytes) -> ObjectRef:
        """Reference to an object with the given content."""
        return cls(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())


class Sizes(_Strict):
    """What the published object set weighs."""

    dense_bytes: int = Field(ge=0, description="bytes of the full state, dense")
    wire_bytes: int = Field(ge=0, description="bytes of the objects to download")
    changed_elements: int = Field(ge=0, description="elements that differ from the base (anchors: all)")


class PatchCodec(_Strict):
    """Codec a patch was encoded with (patches are self-describing; this is for inspection)."""

    name: Literal["pulsesync-sparse"] = "pulsesync-sparse"
    format_version: int
    value_coding: str
    zstd_level: int
    chunk_elements: int
    # Format 2: records per "KIND/VALUES[/POSITIONS]" the encoder chose (`pulsesync inspect` shows
    # them); omitted from the JSON when None, so format-1 readers accept the manifest.
    records: dict[str, int] | None = None


class AnchorFormat(_Strict):
    """Layout of an anchor checkpoint."""

    name: Literal["safetensors"] = "safetensors"
    shards: int = Field(ge=1)


class _ManifestBase(_Strict):
    format_version: Literal[1] = MANIFEST_VERSION
    step: int = Field(ge=0)
    objects: list[ObjectRef] = Field(min_length=1)
    state_digest: StateDigest
    sizes: Sizes
    created_at: str
    # The publishing stream: generated at a prefix's first publish, kept by every restart. Signed,
    # so a manifest copied in from another run or prefix (same key) is told apart. "": written
    # before stream ids existed.
    stream_id: str = Field("", pattern=r"^[0-9a-z]{0,32}$")
    key_id: str = ""
    signature: str = ""

    @field_validator("created_at")
    @classmethod
    def _rfc3339(cls, v: str) -> str:
        try:
            _parse_time(v)
        except ValueError:
            raise ValueError(f"created_at {v!r} is not an RFC 3339 timestamp") from None
        return v

    @property
    def created(self) -> dt.datetime:
        """created_at as an aware datetime."""
        return _parse_time(self.created_at)

    @field_validator("objects")
    @classmethod
    def _unique_keys(cls, v: list[ObjectRef]) -> list[ObjectRef]:
        keys = [o.key for o in v]
        if len(set(keys)) != len(keys):
            raise ValueError("object keys must be unique")
        return v

    def _fields(self) -> dict[str, Any]:
        fields = self.model_dump(mode="json")
        if fields.get("reference", False) is None:
            del fields["reference"]
        if fields.get("histories", None) == []:
            del fields["histories"]
        if isinstance(fields.get("codec"), dict) and fields["codec"].get("records", False) is None:
            del fields["codec"]["records"]
        return fields

    def signing_payload(self) -> bytes:
        """Canonical bytes the signature covers: every field but the signature."""
        return canonical_json({k: v for k, v in self._fields().items() if k != "signature"})

    def to_bytes(self) -> bytes:
        """Canonical JSON of the whole manifest, as stored in the ready marker."""
        return canonical_json(self._fields())

    def signed(self, private_key: Ed25519PrivateKey) -> Any:
        """A copy with key_id and signature set by `private_key`."""
        unsigned = self.model_copy(update={"key_id": signing.key_id(private_key.public_key()), "signature": ""})
        return unsigned.model_copy(update={"signature": signing.sign(private_key, unsigned.signing_payload())})


class PatchManifest(_ManifestBase):
    """A patch from base_step to step, in the chain that starts at anchor_step."""

    kind: Literal["patch"] = "patch"
    base_step: int = Field(ge=0)
    anchor_step: int = Field(ge=0)
    base_digest: str = Field(min_length=1, description="root state digest of base_step")
    codec: PatchCodec
    # The patch whose history this one is coded against (the base step's patch), or None for a
    # self-contained patch. Omitted from the JSON when None, so format-1 readers accept the manifest.
    reference: ObjectRef | None = None

    @model_validator(mode="after")
    def _chain_order(self) -> PatchManifest:
        if not self.anchor_step <= self.base_step < self.step:
            raise ValueError(
                f"steps must satisfy anchor_step <= base_step < step, got {self.anchor_step}, "
                f"{self.base_step}, {self.step}"
            )
        return self


class AnchorManifest(_ManifestBase):
    """A full checkpoint of the state at step."""

    kind: Literal["anchor"] = "anchor"
    codec: AnchorFormat
    # Keys of the objects (among `objects`) that hold the history of the step's patch (one per patch
    # object; codec/history_file.py), so the next patch is history-coded. Omitted from the JSON when
    # empty: an anchor of a step that was not committed as a patch carries none.
    histories: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _histories_are_objects(self) -> AnchorManifest:
        keys = {o.key for o in self.objects}
        if missing := [k for k in self.histories if k not in keys]:
            raise ValueError(f"history {missing[0]!r} is not one of the anchor's objects")
        return self


Manifest = Annotated[PatchManifest | AnchorManifest, Field(discriminator="kind")]
_MANIFEST = TypeAdapter(Manifest)


def _no_floats(literal: str) -> Any:
    raise ValueError(f"number {literal[:40]} is not an integer (manifests hold integers and strings only)")


def _load(data: bytes, name: str) -> dict[str, Any]:
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{name}: {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit of a manifest")
    try:
        raw = json.loads(data, parse_float=_no_floats, parse_constant=_no_floats)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; deep nesting recurses
        raise ManifestError(f"{name}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{name}: expected a JSON object")
    version = raw.get("format_version")
    if version != MANIFEST_VERSION:
        raise UnsupportedVersionError(
            f"{name}: manifest format_version {str(version)[:40]} is not supported "
            f"(this pulsesync reads {MANIFEST_VERSION})"
        )
    return raw


def _validate(raw: dict[str, Any], name: str) -> PatchManifest | AnchorManifest:
    try:
        return _MANIFEST.validate_python(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ManifestError(f"{name}: field {where}: {err['msg']}") from None


def parse_manifest(data: bytes, name: str = "manifest") -> PatchManifest | AnchorManifest:
    """Parse a manifest WITHOUT authenticating it: for tools that only read the chain's shape (retention).

    Never use the result to decide what weights to serve; that is verify_manifest's job.
    """
    return _validate(_load(data, name), name)


def verify_manifest(
    data: bytes,
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    newer_than: int | None = None,
    name: str = "manifest",
) -> PatchManifest | AnchorManifest:
    """Parse and authenticate a manifest; `name` (e.g. its key) is used in error messages.

    Raises ManifestError (malformed), UnsupportedVersionError, UnknownKeyError, SignatureError
    (bad signature or any tampered field) or ReplayError (step <= newer_than).
    """
    manifest = _verify_as_stored(data, trusted, name)
    if manifest is None:
        manifest = _verify_canonical(data, trusted, name)
    check_newer(manifest, newer_than, name)
    return manifest


# A manifest as publishers store it (to_bytes): its signed payload with the signature member put in
# among the top-level keys (keys sort, so it is the first such member; strings escape their quotes).
_SIGNATURE_MEMBER = re.compile(rb',"signature":"([A-Za-z0-9+/]*={0,2})"')


def _verify_as_stored(
    data: bytes, trusted: Mapping[str, Ed25519PublicKey], name: str
) -> PatchManifest | AnchorManifest | None:
    """The manifest, if the bytes around its signature member are what the signature signs; else None.

    Verifies and parses exactly the signed bytes, so the fields are the signer's, as the canonical
    path's are, without putting them in canonical form again (a third of the time of a 0.5B model's
    manifest, on every fast-path step). None: anything else, which _verify_canonical decides.
    """
    found = _SIGNATURE_MEMBER.search(data) if len(data) <= MAX_MANIFEST_BYTES else None
    if found is None:
        return None
    payload = data[: found.start()] + data[found.end() :]
    try:
        raw = json.loads(payload, parse_float=_no_floats, parse_constant=_no_floats)
    except (ValueError, RecursionError):  # (_no_floats raises ValueError)
        return None
    if not isinstance(raw, dict) or raw.get("format_version") != MANIFEST_VERSION or "signature" in raw:
        return None
    kid, signature = raw.get("key_id"), found.group(1).decode("ascii")
    public_key = trusted.get(kid) if isinstance(kid, str) else None
    if public_key is None or not signing.is_valid(public_key, payload, signature):
        return None
    return _validate(raw | {"signature": signature}, name)


def _verify_canonical(
    data: bytes, trusted: Mapping[str, Ed25519PublicKey], name: str
) -> PatchManifest | AnchorManifest:
    """Parse any JSON form of a manifest, and authenticate its fields in canonical form."""
    raw = _load(data, name)
    kid, signature = raw.get("key_id"), raw.get("signature")
    if not isinstance(kid, str) or not isinstance(signature, str) or not signature:
        raise ManifestError(f"{name}: missing key_id or signature (unsigned manifest)")
    public_key = trusted.get(kid)
    if public_key is None:
        raise UnknownKeyError(f"{name}: signed by key {kid}, which is not among the {len(trusted)} trusted key(s)")
    try:
        payload = canonical_json({k: v for k, v in raw.items() if k != "signature"})
    except (ValueError, RecursionError) as e:  # a lone surrogate does not encode (UnicodeEncodeError)
        raise ManifestError(f"{name}: cannot be put in canonical form ({type(e).__name__})") from None
    signing.verify(public_key, payload, signature, name)
    return _validate(raw, name)


def check_newer(manifest: PatchManifest | AnchorManifest, newer_than: int | None, name: str) -> None:
    """ReplayError unless the manifest's step is newer than `newer_than` (None: any step)."""
    if newer_than is not None and manifest.step <= newer_than:
        raise ReplayError(f"{name}: step {manifest.step} is not newer than the held step {newer_than} (replay)")
