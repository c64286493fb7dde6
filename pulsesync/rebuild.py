"""States built from a chain: anchors loaded, patches applied in place, every link verified.

What the subscriber's paths, a publisher's resume, `pulsesync verify` and the demo build from
what a prefix's fetcher (`protocol.fetcher`) reads, as the manifests its chain client verified
list it: an anchor's state (its digest checked), a patch or a sharded step's parts applied under
an undo log (the result checked against the manifest's state digest), a chain of them with
downloads ahead of the apply, and a step rebuilt from the nearest anchor that verifies.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from pulsesync.codec import StepHistory, UndoLog, apply_parts, apply_patch
from pulsesync.codec.history_file import read_history
from pulsesync.digest import StateDigest, state_digest
from pulsesync.dtypes import dense_bytes
from pulsesync.errors import ForeignStreamError, IntegrityError, MissingReferenceError, NotFoundError, PulseSyncError
from pulsesync.model_dir import INDEX_FILE, WEIGHT_SUFFIX, load_owned, pieces_metadata
from pulsesync.progress import phase
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.fetcher import Fetcher, check_digest, split_parts
from pulsesync.protocol.manifest import AnchorManifest, PatchManifest
from pulsesync.sharding.layout import Assembly
from pulsesync.threads import in_thread_to_completion
from pulsesync.verified import HoldsVerified, VerifiedState

log = logging.getLogger("pulsesync.chain")
DECODE_MARGIN_BYTES = 64 << 20  # above 1.5x the held state: room for new tensors and positions
HISTORY_BYTES_PER_ELEMENT = 12  # a history holds at most a position (4) and a delta (<= 8) per element
MAX_ANCHORS_TRIED = 3  # a slow path passes at most this many failing anchors before it gives up


@dataclass(frozen=True)
class Reconstruction(HoldsVerified):
    """A state rebuilt from the store and verified, with where its chain starts."""

    verified: VerifiedState
    anchor_step: int
    patches_applied: int


@dataclass
class LoadedAnchor:
    """An anchor's state (digest checked), its non-weight files, and the history of its step's patch if it
    carries one (the reference of the next patch)."""

    state: dict[str, torch.Tensor]
    digest: StateDigest
    files: dict[str, bytes]
    history: StepHistory | None


async def load_anchor(fetcher: Fetcher, manifest: AnchorManifest) -> LoadedAnchor:
    """The anchor's state (digest checked), its non-weight files and the history it carries.

    Each shard streams to a temporary file with parallel ranged GETs where the store has them,
    its SHA-256 checked on the way, and is read back and deleted before the next: memory and
    disk stay bounded by the state plus one shard.
    """
    state: dict[str, torch.Tensor] = {}
    files: dict[str, bytes] = {}
    histories: list[bytes] = []
    assembly: Assembly | None = None
    total = sum(ref.size for ref in manifest.objects)
    with (
        tempfile.TemporaryDirectory(prefix=f"pulsesync-anchor-{manifest.step}-") as spool,
        phase(f"anchor {manifest.step}: download", total) as shown,
    ):
        for ref in manifest.objects:
            name = ref.key.rsplit("/", 1)[-1]
            if ref.key in manifest.histories:
                histories.append(await fetcher.fetch(ref))
                shown.advance(ref.size)
                continue
            if not name.endswith(WEIGHT_SUFFIX):
                files[name] = await fetcher.fetch(ref)
                shown.advance(ref.size)
                continue
            path = Path(spool) / name
            await fetcher.download(ref, path, progress=shown.transfer)
            try:
                shard = await asyncio.to_thread(load_owned, path)
                places = await asyncio.to_thread(pieces_metadata, path)
            except SafetensorError as e:
                raise IntegrityError(f"{fetcher.store.url}{ref.key}: not a valid safetensors file ({e})") from None
            path.unlink()
            if places is not None:  # one rank's pieces of a sharded anchor (docs/sharding.md)
                assembly = assembly or Assembly(f"anchor {manifest.step}")
                await asyncio.to_thread(assembly.add, shard, places)
                continue
            if duplicate := state.keys() & shard.keys():
                raise IntegrityError(f"anchor {manifest.step}: tensor {sorted(duplicate)[0]!r} is in two shards")
            state.update(shard)
    if assembly is not None:
        pieced = assembly.finish()
        if duplicate := state.keys() & pieced.keys():
            raise IntegrityError(f"anchor {manifest.step}: tensor {sorted(duplicate)[0]!r} is in two shards")
        state.update(pieced)
    digest = await asyncio.to_thread(state_digest, state, manifest.state_digest.algorithm, fetcher.threads)
    check_digest(digest, manifest.state_digest, f"anchor {manifest.step}")
    files.pop(INDEX_FILE, None)  # describes the shards, which a reader lays out anew
    return LoadedAnchor(state, digest, files, _read_histories(manifest, histories, state))


def _read_histories(
    manifest: AnchorManifest, objects: list[bytes], state: dict[str, torch.Tensor]
) -> StepHistory | None:
    """The step history an anchor's history objects hold together (None when it carries none)."""
    if not objects:
        return None
    tensors = {name: (t.numel(), t.element_size()) for name, t in state.items()}
    bound = HISTORY_BYTES_PER_ELEMENT * sum(n for n, _ in tensors.values()) + DECODE_MARGIN_BYTES
    history = StepHistory()
    for key, data in zip(manifest.histories, objects, strict=True):
        history.patches.update(read_history(data, f"anchor {manifest.step}: {key}", bound, tensors).patches)
    return history


async def apply_step(
    fetcher: Fetcher,
    state: dict[str, torch.Tensor],
    digest: StateDigest,
    manifest: PatchManifest,
    data: bytes | None = None,
    undo: UndoLog | None = None,
    reference: StepHistory | None = None,
    history: StepHistory | None = None,
) -> StateDigest:
    """Apply a verified patch (its bytes fetched here unless given) in place; returns the checked new digest.

    With `undo`, what the patch overwrote is logged there (also when it fails part way). A
    history-coded patch (or part) needs `reference`, the history of the step it is coded
    against; an empty `history` collects this step's own, one per object.
    """
    if digest.root != manifest.base_digest:
        raise IntegrityError(
            f"patch {manifest.step}: its base digest {manifest.base_digest} is not the held state's {digest.root}"
        )
    if data is None:
        data = await fetcher.fetch_patch(manifest)
    # A patch never decodes to much more than the state it changes: a signed zstd bomb (a small
    # frame declaring GiBs, sizes consistent) is refused before anything is allocated.
    held_bytes = dense_bytes(state)
    limit = held_bytes + held_bytes // 2 + DECODE_MARGIN_BYTES
    against = reference.get(manifest.reference.sha256) if reference is not None and manifest.reference else None
    if manifest.reference is not None and against is None:
        raise MissingReferenceError(
            f"patch {manifest.step}: coded against {manifest.reference.key}, whose history is not held "
            "(a restart, or a step missed)"
        )
    # The thread writes into `state`: a cancelled caller must not roll back before it is done.
    new: StateDigest | None
    if len(manifest.objects) > 1:  # a sharded step: its parts compose to the manifest's digest
        new = await in_thread_to_completion(
            apply_parts,
            state,
            split_parts(manifest, data),
            base_digest=digest,
            threads=fetcher.threads,
            undo=undo,
            max_decoded_bytes=limit,
            expected=manifest.state_digest,
            reference=reference,
            histories=[history.add(ref.sha256) for ref in manifest.objects] if history is not None else None,
        )
    else:
        new = await in_thread_to_completion(
            apply_patch,
            state,
            data,
            base_digest=digest,
            threads=fetcher.threads,
            undo=undo,
            max_decoded_bytes=limit,
            reference=against,
            history=history.add(manifest.objects[0].sha256) if history is not None else None,
            expected=manifest.state_digest,
        )
    assert new is not None  # verify=True
    check_digest(new, manifest.state_digest, f"patch {manifest.step}")
    return new


async def reconstruct(chain: ChainClient, step: int | None = None, anchors: int = MAX_ANCHORS_TRIED) -> Reconstruction:
    """Rebuild a ready step (default: the newest) from the nearest anchor on its chain, verifying every link.

    An anchor that fails (missing, damaged, forged) is passed for the one before it on the chain,
    up to `anchors` tried: one bad anchor does not block every cold start until the next.
    """
    ready = await chain.ready()
    if not ready:
        raise NotFoundError(f"{chain.store.url}: no ready steps")
    target = max(ready) if step is None else step
    failed: dict[int, PulseSyncError] = {}
    while len(failed) < anchors:
        walk, links = await chain.walk(target, lambda s: "anchor" in ready.get(s, ()) and s not in failed)
        if not walk.complete:
            if failed:  # the chain ends below the anchors that failed: say why they did
                raise failed[min(failed)]
            raise NotFoundError(f"{chain.store.url}: step {walk.end} is not ready, so step {target} cannot be rebuilt")
        try:
            anchor = await chain.manifest(walk.end, "anchor")
            assert isinstance(anchor, AnchorManifest)
            if len(streams := {m.stream_id for m in [anchor, *links]}) > 1:
                raise ForeignStreamError(
                    f"{chain.store.url}: the chain to step {target} mixes streams {sorted(streams)}"
                )
            if not links and "patch" in ready.get(target, ()):  # the step's commit says which state it is
                await _check_anchor_is_commit(chain, anchor)
            loaded = await load_anchor(chain.fetcher, anchor)
        except (IntegrityError, NotFoundError) as e:
            failed[walk.end] = e
            log.warning("anchor %d: %s: %s; trying the anchor before it", walk.end, type(e).__name__, e)
            continue
        state, files = loaded.state, loaded.files
        digest, history = await apply_chain(chain.fetcher, state, loaded.digest, links, reference=loaded.history)
        return Reconstruction(VerifiedState(target, state, digest, files, history), walk.end, len(links))
    raise failed[min(failed)]


async def _check_anchor_is_commit(chain: ChainClient, anchor: AnchorManifest) -> None:
    """IntegrityError unless an anchor of a step committed as a patch holds the state the commit signed."""
    commit = await chain.manifest(anchor.step, "patch")
    if commit.state_digest.root != anchor.state_digest.root:
        raise IntegrityError(
            f"anchor {anchor.step}: state digest {anchor.state_digest.root} is not the one its step was committed "
            f"with ({commit.state_digest.root})"
        )


async def apply_chain(
    fetcher: Fetcher,
    state: dict[str, torch.Tensor],
    digest: StateDigest,
    links: list[PatchManifest],
    window: int = 4,
    undo: list[UndoLog] | None = None,
    reference: StepHistory | None = None,
    applied: list[tuple[PatchManifest, bytes]] | None = None,
) -> tuple[StateDigest, StepHistory | None]:
    """Apply patches in order, downloading up to `window` patches ahead of the one being applied.

    With `undo`, one log per patch started is appended there, so the caller can roll back.
    With `applied`, each patch applied is appended there with its bytes (the state cache's journal).
    `reference` is the history of the patch that produced `state` (after an anchor, what it carries).
    Returns the new digest and the last patch's history.
    """
    if not links:
        return digest, reference
    fetches: dict[int, asyncio.Task[bytes]] = {}

    def prefetch(i: int) -> None:
        if i < len(links) and i not in fetches:
            fetches[i] = asyncio.create_task(fetcher.fetch_patch(links[i]))

    try:
        for i in range(min(window, len(links))):
            prefetch(i)
        with phase(f"patches to step {links[-1].step}: fetch and apply", len(links), "patch") as shown:
            for i, link in enumerate(links):
                prefetch(i + window)
                data = await fetches.pop(i)
                if undo is not None:
                    undo.append(UndoLog())
                history = StepHistory()
                log_ = undo[-1] if undo is not None else None
                digest = await apply_step(fetcher, state, digest, link, data, log_, reference, history)
                reference = history
                if applied is not None:
                    applied.append((link, data))
                shown.advance(1)
    finally:
        for task in fetches.values():
            task.cancel()
        await asyncio.gather(*fetches.values(), return_exceptions=True)
    return digest, reference
