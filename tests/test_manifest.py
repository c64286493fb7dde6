"""Manifests: sign -> verify round trip; every single-field tamper, wrong key, wrong version rejected."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.digest import state_digest
from pulsesync.errors import (
    IntegrityError,
    ManifestError,
    ReplayError,
    SignatureError,
    UnknownKeyError,
    UnsupportedVersionError,
)
from pulsesync.protocol import manifest as manifest_module
from pulsesync.protocol import signing
from pulsesync.protocol.manifest import (
    AnchorFormat,
    AnchorManifest,
    ObjectRef,
    PatchCodec,
    PatchManifest,
    Sizes,
    canonical_json,
    utc_now,
    verify_manifest,
)

KEY = Ed25519PrivateKey.generate()
TRUSTED = dict(signing.trusted_keys([KEY.public_key()]))
DIGEST = state_digest({"w": torch.arange(4, dtype=torch.float32)})


def _patch_manifest(step: int = 5) -> PatchManifest:
    return PatchManifest(
        step=step,
        base_step=step - 1,
        anchor_step=0,
        base_digest="ab" * 16,
        objects=[ObjectRef.for_bytes(f"patches/{step:012d}/patch.bin", b"payload")],
        state_digest=DIGEST,
        sizes=Sizes(dense_bytes=16, wire_bytes=7, changed_elements=1),
        created_at=utc_now(),
        codec=PatchCodec(format_version=1, value_coding="delta", zstd_level=1, chunk_elements=1 << 22),
    )


def _anchor_manifest() -> AnchorManifest:
    return AnchorManifest(
        step=0,
        objects=[ObjectRef.for_bytes("anchors/000000000000/model.safetensors", b"shard")],
        state_digest=DIGEST,
        sizes=Sizes(dense_bytes=16, wire_bytes=5, changed_elements=4),
        created_at=utc_now(),
        codec=AnchorFormat(shards=1),
    )


@pytest.mark.parametrize("make", [_patch_manifest, _anchor_manifest])
def test_sign_verify_round_trip(make) -> None:
    manifest = make().signed(KEY)
    assert manifest.key_id == signing.key_id(KEY.public_key())
    data = manifest.to_bytes()
    assert data == canonical_json(json.loads(data))  # stored canonical
    assert verify_manifest(data, TRUSTED) == manifest


def _leaves(obj: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, (*path, i))]
    return [path]


def _tampered(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "x"
    raise AssertionError(value)


@pytest.mark.parametrize("make", [_patch_manifest, _anchor_manifest])
def test_every_single_field_tamper_is_detected(make) -> None:
    data = make().signed(KEY).to_bytes()
    doc = json.loads(data)
    leaves = _leaves(doc)
    assert len(leaves) > 15
    for path in leaves:
        copy = json.loads(data)
        node = copy
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = _tampered(node[path[-1]])
        expected = {
            ("format_version",): UnsupportedVersionError,
            ("key_id",): UnknownKeyError,
        }.get(path, SignatureError)
        with pytest.raises(expected):
            verify_manifest(canonical_json(copy), TRUSTED, name="m")


def test_added_or_removed_field_and_reformatting() -> None:
    doc = json.loads(_patch_manifest().signed(KEY).to_bytes())
    with pytest.raises(SignatureError):
        verify_manifest(canonical_json({**doc, "extra": 1}), TRUSTED)
    with pytest.raises(SignatureError):
        verify_manifest(canonical_json({k: v for k, v in doc.items() if k != "created_at"}), TRUSTED)
    # Whitespace and key order are not content: a pretty-printed copy still verifies.
    assert verify_manifest(json.dumps(doc, indent=2).encode(), TRUSTED).step == 5


def test_stored_bytes_are_verified_as_they_are_and_any_other_form_in_canonical_form(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A marker as publishers store it verifies on its own bytes (the signature member cut out) without
    being put in canonical form again; any other form of the same fields takes the canonical path."""
    manifest = _patch_manifest().signed(KEY)
    data = manifest.to_bytes()
    canonical: list[bytes] = []
    real = manifest_module._verify_canonical
    monkeypatch.setattr(manifest_module, "_verify_canonical", lambda d, *a: canonical.append(d) or real(d, *a))
    assert verify_manifest(data, TRUSTED) == manifest and canonical == []
    doc = json.loads(data)
    signature = doc.pop("signature")
    first = b'{"signature":"' + signature.encode() + b'",' + canonical_json(doc)[1:]  # not where it sorts
    pretty = json.dumps({**doc, "signature": signature}, indent=1).encode()
    cut = data.index(b',"signature"')
    doubled = data[:cut] + b',"signature":"AAAA"' + data[cut:]  # a forged member first: JSON keeps the last
    for other in (first, pretty, doubled):
        assert verify_manifest(other, TRUSTED) == manifest and canonical[-1] == other
    bad = data.replace(signature.encode(), signature[:-4].encode() + b"AAA=")
    with pytest.raises(SignatureError):
        verify_manifest(bad, TRUSTED)
    assert canonical[-1] == bad  # the stored path does not decide a failure: the canonical path names it


@pytest.mark.parametrize("make", [_patch_manifest, _anchor_manifest])
def test_any_byte_of_a_stored_marker_changed_is_refused_or_verifies_to_the_signed_fields(make) -> None:
    """Every byte, each set to another value: an IntegrityError, or (base64's spare bits in the
    signature's last character) the same signed fields; never other fields."""
    manifest = make().signed(KEY)
    data = manifest.to_bytes()
    for at in range(len(data)):
        for value in {data[at] ^ 1, data[at] ^ 0x20, ord('"')} - {data[at]}:
            changed = data[:at] + bytes([value]) + data[at + 1 :]
            try:
                got = verify_manifest(changed, TRUSTED, name="m")
            except IntegrityError:
                continue
            assert got.model_copy(update={"signature": ""}) == manifest.model_copy(update={"signature": ""})


def test_type_coercion_cannot_hide_a_tamper() -> None:
    doc = json.loads(_patch_manifest().signed(KEY).to_bytes())
    with pytest.raises(SignatureError):
        verify_manifest(canonical_json({**doc, "step": "5"}), TRUSTED)


def test_wrong_key() -> None:
    other = Ed25519PrivateKey.generate()
    data = _patch_manifest().signed(other).to_bytes()
    with pytest.raises(UnknownKeyError, match="not among the 1 trusted"):
        verify_manifest(data, TRUSTED)
    # Signed by another key but claiming the trusted key's id: the signature gives it away.
    forged = json.loads(data)
    forged["key_id"] = signing.key_id(KEY.public_key())
    unsigned = {k: v for k, v in forged.items() if k != "signature"}
    forged["signature"] = signing.sign(other, canonical_json(unsigned))
    with pytest.raises(SignatureError) as info:
        verify_manifest(canonical_json(forged), TRUSTED)
    assert not isinstance(info.value, UnknownKeyError)


def test_unsigned_malformed_and_wrong_version() -> None:
    unsigned = _patch_manifest().to_bytes()
    with pytest.raises(ManifestError, match="unsigned"):
        verify_manifest(unsigned, TRUSTED)
    with pytest.raises(ManifestError, match="not valid JSON"):
        verify_manifest(b"{not json", TRUSTED, name="ready/000000000005.patch.json")
    with pytest.raises(ManifestError, match="JSON object"):
        verify_manifest(b"[1, 2]", TRUSTED)
    doc = json.loads(_patch_manifest().signed(KEY).to_bytes())
    with pytest.raises(UnsupportedVersionError, match="format_version 2"):
        verify_manifest(canonical_json({**doc, "format_version": 2}), TRUSTED)


def test_validly_signed_but_invalid_content_is_a_manifest_error() -> None:
    doc = json.loads(_patch_manifest().signed(KEY).to_bytes())
    doc["base_step"] = doc["step"]  # breaks anchor_step <= base_step < step
    unsigned = {k: v for k, v in doc.items() if k not in ("signature",)}
    doc["signature"] = signing.sign(KEY, canonical_json(unsigned))
    with pytest.raises(ManifestError, match="base_step < step"):
        verify_manifest(canonical_json(doc), TRUSTED, name="m")


def test_replay_is_rejected() -> None:
    data = _patch_manifest(step=5).signed(KEY).to_bytes()
    assert verify_manifest(data, TRUSTED, newer_than=4).step == 5
    for held in (5, 9):
        with pytest.raises(ReplayError, match=f"not newer than the held step {held}"):
            verify_manifest(data, TRUSTED, newer_than=held)


def test_error_messages_name_the_object() -> None:
    with pytest.raises(UnknownKeyError, match=r"ready/000000000005\.patch\.json"):
        verify_manifest(
            _patch_manifest().signed(Ed25519PrivateKey.generate()).to_bytes(),
            TRUSTED,
            name="ready/000000000005.patch.json",
        )


def test_object_ref_checks_its_fields() -> None:
    ref = ObjectRef.for_bytes("k", b"abc")
    assert ref.size == 3 and ref.sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    with pytest.raises(ValueError):
        ObjectRef(key="k", size=-1, sha256=ref.sha256)
    with pytest.raises(ValueError):
        ObjectRef(key="k", size=1, sha256="XYZ")
