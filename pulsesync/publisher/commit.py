"""Manifest construction and commit: the one place the publisher builds manifests and writes ready markers.

A step is committed when its signed manifest is written under the step's one commit key
(`layout.commit_key`) with put-if-absent, after every payload object it names is uploaded; a marker
is never overwritten. Then the pointer (`layout.POINTER_KEY`) is rewritten to name it: a hint for
polling subscribers, best effort. An anchor uploaded after its step's patch committed goes to
`layout.anchor_ready_key`, written only by the publisher whose patch committed the step.
"""

from __future__ import annotations

import logging

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.codec import CodecParams
from pulsesync.digest import StateDigest
from pulsesync.errors import ConflictError, StoreError
from pulsesync.protocol import layout
from pulsesync.protocol.manifest import (
    AnchorFormat,
    AnchorManifest,
    ObjectRef,
    PatchCodec,
    PatchManifest,
    Sizes,
    utc_now,
)
from pulsesync.store import Store
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.publisher")


def patch_manifest(
    step: int,
    base: VerifiedState,
    anchor_step: int,
    objects: list[ObjectRef],
    digest: StateDigest,
    sizes: Sizes,
    params: CodecParams,
    reference: ObjectRef | None = None,
    records: dict[str, int] | None = None,
) -> PatchManifest:
    """The manifest of a patch from `base` to `step`, in the chain that starts at `anchor_step`.

    `objects`: the patch, or a sharded step's parts in the order they apply.
    """
    return PatchManifest(
        step=step,
        base_step=base.step,
        anchor_step=anchor_step,
        base_digest=base.digest.root,
        objects=objects,
        state_digest=digest,
        sizes=sizes,
        created_at=utc_now(),
        reference=reference,
        codec=PatchCodec(
            format_version=params.format_version,
            value_coding=params.value_coding,
            zstd_level=params.zstd_level,
            chunk_elements=params.chunk_elements,
            records=records if params.format_version >= 2 else None,
        ),
    )


def anchor_manifest(
    step: int, refs: list[ObjectRef], digest: StateDigest, sizes: Sizes, shards: int, histories: list[str]
) -> AnchorManifest:
    """The manifest of an anchor: the HF-layout files under its folder, and which of them hold the step's patch
    history (`histories`, keys among `refs`)."""
    return AnchorManifest(
        step=step,
        objects=refs,
        state_digest=digest,
        sizes=sizes,
        created_at=utc_now(),
        codec=AnchorFormat(shards=shards),
        histories=histories,
    )


def marker_key(manifest: PatchManifest | AnchorManifest, step_committed: bool) -> str:
    """Where a manifest goes: the step's commit key, or, for an anchor of a step this publisher committed
    as a patch (`step_committed`), the anchor marker beside it."""
    if manifest.kind == "anchor" and step_committed:
        return layout.anchor_ready_key(manifest.step)
    return layout.commit_key(manifest.step)


async def write_ready_marker(
    store: Store, manifest: PatchManifest | AnchorManifest, key: Ed25519PrivateKey, step_committed: bool = False
) -> None:
    """Sign the manifest and write it as a ready marker (`marker_key`); ConflictError if the marker exists.

    A commit rewrites the pointer after it; an anchor added to a committed step does not (the newest
    step did not change).
    """
    marker = marker_key(manifest, step_committed)
    try:
        await store.put_if_absent(marker, manifest.signed(key).to_bytes())
    except ConflictError:
        raise ConflictError(
            f"step {manifest.step}: {store.url}{marker} already exists: another publisher writes to this "
            "prefix, or step numbers were reused; nothing was overwritten"
        ) from None
    if step_committed:
        return
    try:  # the step is committed; a stale pointer only delays subscribers until their next LIST
        await store.put(layout.POINTER_KEY, layout.pointer_body(manifest.step))
    except StoreError as e:
        log.warning(
            "step %d committed, but the pointer %s%s was not updated: %s",
            manifest.step,
            store.url,
            layout.POINTER_KEY,
            e,
        )
