"""The rounds of one rank of a multi-rank trainer: each rank publishes the pieces it owns; one commit per step.

Per step, on every rank, through the coordinator (`publisher/coordinator.py`: a gloo process group
of pulsesync's own, never the trainer's collectives):

1. the rank encodes its pieces against its own baseline (a patch part) or writes them (an
   anchor's pieces file) and uploads that object itself, with the store's bounded, retried calls;
2. one gather of small descriptors (object keys, sizes, SHA-256, digest lane sums; never tensors);
3. rank 0 composes the whole model's state digest from the lane sums (mixsum-128 is additive) and
   writes the signed ready marker, only when every rank's object is durable, then broadcasts the
   outcome;
4. every rank moves its baseline only to a committed step.

A rank that fails, hangs past `sharding.timeout_seconds` or dies fails the step on every rank (no
marker); the job's relaunch with `resume` takes up the chain at its newest committed step (each
rank's pieces rebuilt from the store, `pieces_rebuild.py`), without it publishes an anchor first.
docs/sharding.md has the protocol and the failure table.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import mixsum
from pulsesync.codec import PatchHistory, StepHistory, encode_part
from pulsesync.codec.history_file import HISTORY_FILE, history_bytes
from pulsesync.digest import INCREMENTAL, StateDigest, moved_digest, summed_digest
from pulsesync.dtypes import State, flat_bits
from pulsesync.errors import ConfigError, ConflictError, PulseSyncError
from pulsesync.model_dir import PIECES_FILE, write_pieces
from pulsesync.progress import phase
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.fetcher import Fetcher
from pulsesync.protocol.manifest import AnchorManifest, ObjectRef, PatchManifest, Sizes
from pulsesync.publisher.commit import anchor_manifest, marker_key, patch_manifest, write_ready_marker
from pulsesync.publisher.config import PublisherConfig
from pulsesync.publisher.coordinator import Coordinator
from pulsesync.publisher.host_copy import HostCopy, HostCopyPool, read_files
from pulsesync.publisher.ownership import PrefixGuard, newest_own
from pulsesync.publisher.pieces_cache import PiecesCache
from pulsesync.publisher.pieces_rebuild import PieceReader, RebuiltPieces, rebuild_pieces
from pulsesync.publisher.report import StepReport
from pulsesync.publisher.rounds import Record, Rounds
from pulsesync.publisher.schedule import AnchorSchedule
from pulsesync.sharding.layout import Ownership, Piece, local_pieces, validate
from pulsesync.store import Store
from pulsesync.verified import VerifiedState

log = logging.getLogger("pulsesync.publisher")


@dataclass
class _Part:
    """What one rank did in one round, as rank 0 gathers it (no tensors)."""

    rank: int
    error: str = ""
    objects: list[ObjectRef] = field(default_factory=list)
    lanes: list[tuple[str, tuple[int, int]]] = field(default_factory=list)  # digest lane sums (anchor) or moves
    changed: int = 0
    codings: dict[str, int] = field(default_factory=dict)
    history: str = ""  # an anchor's: the key of the object holding this rank's part history of the step, if any


@dataclass
class _Outcome:
    """What rank 0 tells every rank after a round: committed or not, and the digest root it committed."""

    committed: bool
    error: str = ""
    root: str = ""
    wire_bytes: int = 0  # of every rank's objects: the anchor schedule must advance alike on every rank
    fatal: PulseSyncError | None = None  # stops every rank's publisher (a conflict, a bad layout)


def _piece_sums(piece: Piece, t: torch.Tensor) -> tuple[int, int]:
    """The mixsum-128 lanes of a piece's elements at their global flat indices (run by run)."""
    values, run, sums = mixsum.unsigned(flat_bits(t).numpy()), piece.run, (0, 0)
    for k in range(piece.runs):
        sums = mixsum.add(sums, mixsum.sum_range(values[k * run : (k + 1) * run], piece.start + k * piece.stride))
    return sums


class ShardedRounds(Rounds):
    """What each rank of a multi-rank job publishes: construct the publisher on every rank, with each rank's state.

    `publish(step, state)` takes `model.state_dict()` as is: DTensors (FSDP2, tensor parallel)
    describe their own pieces; a plain tensor is whole and this rank's unless `declared` names it
    (`Rows` of a larger tensor, or None: another rank owns it). `files` (config.json, tokenizer)
    are taken from rank 0.
    """

    stops_on_failure = True
    copies_when_idle = True

    def __init__(
        self,
        config: PublisherConfig,
        store: Store,
        key: Ed25519PrivateKey | None,
        record: Record,
        coordinator: Coordinator,
        declared: Mapping[str, Ownership] | None = None,
    ) -> None:
        if config.codec.digest_algorithm not in INCREMENTAL:
            algorithm = config.codec.digest_algorithm
            raise ConfigError(f"codec.digest_algorithm: a sharded publish needs mixsum-128, not {algorithm}")
        self.config, self.store, self._key, self._record, self._coordinator = config, store, key, record, coordinator
        self.rank, self.world = coordinator.rank, coordinator.world
        self._declared = dict(declared or {})
        self.run_id = self.stream_id = ""  # rank 0's, told to every rank at start
        self._schedule = AnchorSchedule(config.anchor_interval, config.anchor_bytes_budget)
        self._base: HostCopy | None = None  # this rank's pieces at the last committed step
        self._history: PatchHistory | None = None  # this rank's part of the last committed step's: the reference
        self._encoded: PatchHistory | None = None  # of the part this round uploaded, until its outcome is known
        self._base_root = ""
        self._base_step = -1
        self._pieces: dict[str, Piece] = {}  # what this rank publishes (replicas resolved), at the last anchor
        self._raw: dict[str, Piece] | None = None  # what it held then, before replicas were resolved
        self._keep: frozenset[str] | None = None
        self._layout: dict[str, list[Piece]] = {}
        self._digest: StateDigest | None = None  # rank 0: the whole model's, at the last committed step
        self._committed_step = -1  # rank 0: the last step whose commit marker it wrote
        self._anchor_next = True
        self.pool = HostCopyPool(keep=1)  # the baseline's and the next copy's buffers, recycled: no allocator churn
        self._chain: ChainClient | None = None
        self._dense_bytes = 0  # of the whole model, from the layout
        self._files = read_files({p.name: p for p in config.extra_files})  # rank 0: what anchors carry
        self._guard: PrefixGuard | None = None
        self._resume_from: int | None = None  # the committed step a relaunched job takes up (`resume`)
        self._resumed: PatchManifest | AnchorManifest | None = None  # rank 0: that step's commit
        self._cache = PiecesCache(config.cache_dir, self.rank, config.codec.threads) if config.cache_dir else None

    async def _collective(self, call: Callable[[Any], Any], obj: Any) -> Any:
        """A blocking collective, off the event loop."""
        return await asyncio.to_thread(call, obj)

    # --- start ---------------------------------------------------------------------------------
    async def scan(self) -> int:
        """Rank 0 reads the prefix (the stream to continue, the newest step) and tells every rank."""
        found = await self._start_on_root() if self.rank == 0 else None
        found = await self._collective(self._coordinator.broadcast, found)
        if isinstance(found, BaseException):
            raise found
        self.stream_id, self.run_id, last_step, newest = found
        # A relaunched job (`resume`) takes up the chain at its newest committed step once its pieces are known:
        # at the first publish (`_resume`).
        self._resume_from = newest if self.config.resume else None
        return int(last_step)

    async def _start_on_root(self) -> tuple[str, str, int, int | None] | PulseSyncError:
        """Rank 0: the prefix's stream to continue (or a new one) and the newest step in it."""
        assert self._key is not None
        chain = ChainClient(self.store, signing.trusted_keys([self._key.public_key()]), self.config.codec.threads or 1)
        self._chain, self._guard = chain, PrefixGuard(chain)
        stream = secrets.token_hex(8)
        try:
            await self._guard.scan()
            newest, last = await newest_own(chain, self.config.take_over_prefix, stream)
        except PulseSyncError as e:
            return e
        if newest is not None:
            found = chain.verified_marker(newest)
            assert found is not None
            stream, last = found[1].stream_id or stream, newest
        chain.stream_id = stream
        return stream, secrets.token_hex(4), last, newest

    async def _resume(self, snap: HostCopy, raw: dict[str, Piece]) -> None:
        """Take up the chain at its newest committed step, in place of a first anchor.

        Every rank rebuilds the pieces it now owns (`pieces_rebuild.py`: its share, tensor by tensor,
        from its cache where it holds the objects, else from the store), and the ranks' lane sums
        together must compose to the step's signed digest; then the first step is a patch against
        them. Caches that do not prove are passed over for the store; anything else (a step that
        cannot be rebuilt, pieces that do not prove) leaves the baseline empty, logged with why on
        every rank: the first step is an anchor, as without `resume`.
        """
        step, self._resume_from = self._resume_from, None
        assert step is not None
        per_rank: list[list[Piece]] = await self._collective(self._coordinator.all_gather, list(raw.values()))
        placed = validate(per_rank)
        pieces = {p.name: p for ps in placed.values() for p in ps if p.rank == self.rank}
        found = await self._chain_on_root(step) if self.rank == 0 else None
        found = await self._collective(self._coordinator.broadcast, found)
        threads = self.config.codec.threads or 1
        for cache in [self._cache.fetcher(), None] if self._cache is not None else [None]:
            reader, t0 = PieceReader(Fetcher(self.store, threads), cache), time.perf_counter()
            rebuilt, root, why = await self._rebuild_and_prove(step, found, placed, pieces, snap, reader)
            if root or cache is None or isinstance(found, str):
                break
            log.warning(
                "step %d: the ranks' caches do not give step %d (%s); rebuilding from the store", snap.step, step, why
            )
        if not root or rebuilt is None:
            log.warning("step %d: not resumed at step %d (%s); publishing an anchor", snap.step, step, why)
            return
        anchor, links = found
        self._layout, self._pieces, self._raw, self._keep = placed, pieces, raw, frozenset(pieces)
        self._dense_bytes = sum(ps[0].tensor_bytes for ps in placed.values())
        self._base = HostCopy(step, rebuilt.state, 0.0, {}, raw)
        self._base_root, self._base_step, self._history = root, step, rebuilt.history
        self._committed_step, self._anchor_next = step, False
        self._schedule.resume({anchor.step: {"anchor"}} | {link.step: {"patch"} for link in links})
        reference = "none" if rebuilt.history is None else "its own part's"
        if rebuilt.history is not None and rebuilt.history.parts:
            reference = f"{len(rebuilt.history.parts)} parts joined"
        log.info(
            "resumed at step %d from anchor %d and %d patches: rank %d read %d bytes from the store and %d from its "
            "cache in %.1f s (history %s)",
            step,
            anchor.step,
            len(links),
            self.rank,
            reader.store.bytes_downloaded,
            reader.cache.bytes_downloaded if reader.cache is not None else 0,
            time.perf_counter() - t0,
            reference,
        )

    async def _rebuild_and_prove(
        self,
        step: int,
        found: tuple[AnchorManifest, list[PatchManifest]] | str,
        placed: dict[str, list[Piece]],
        pieces: dict[str, Piece],
        snap: HostCopy,
        reader: PieceReader,
    ) -> tuple[RebuiltPieces | None, str, str]:
        """This rank's pieces at `step`, and the signed root every rank's compose to ("" and why not, on every rank)."""
        rebuilt, sums, error = None, [], found if isinstance(found, str) else ""
        if not isinstance(found, str):
            anchor, links = found
            try:
                rebuilt = await rebuild_pieces(
                    reader, anchor, links, pieces, snap.state, self.rank, self.world, self.config.codec.chunk_elements
                )
                for name, piece in sorted(pieces.items()):
                    sums.append((name, await asyncio.to_thread(_piece_sums, piece, rebuilt.state[name])))
            except Exception as e:  # whatever the bytes read make of it: an anchor on every rank, never a hang
                error = f"rank {self.rank}: {type(e).__name__}: {e}"
        gathered = await self._collective(self._coordinator.all_gather, (error, sums))
        proved = self._prove_on_root(step, placed, gathered) if self.rank == 0 else None
        root, why = await self._collective(self._coordinator.broadcast, proved)
        return rebuilt, root, why

    async def _chain_on_root(self, step: int) -> tuple[AnchorManifest, list[PatchManifest]] | str:
        """Rank 0: the verified anchor and patches `step` is rebuilt from, and its signed digest; or why not."""
        assert self._chain is not None
        try:
            ready = await self._chain.ready()
            walk, links = await self._chain.walk(step, lambda s: "anchor" in ready.get(s, ()))
            if not walk.complete:
                return f"step {walk.end} of its chain is not ready"
            anchor = await self._chain.manifest(walk.end, "anchor")
            assert isinstance(anchor, AnchorManifest)
            self._resumed = await self._chain.commit_manifest(step)
        except PulseSyncError as e:
            return f"{type(e).__name__}: {e}"
        return anchor, links

    def _prove_on_root(
        self, step: int, placed: dict[str, list[Piece]], gathered: list[tuple[str, list[tuple[str, tuple[int, int]]]]]
    ) -> tuple[str, str]:
        """Rank 0: the digest the ranks' rebuilt pieces compose to, if it is the step's signed one ("" and why not)."""
        if errors := [error for error, _ in gathered if error]:
            return "", "; ".join(errors)
        assert self._resumed is not None
        kinds = {name: (ps[0].dtype, ps[0].shape) for name, ps in placed.items()}
        lanes = [lane for _, sums in gathered for lane in sums]
        digest = summed_digest(self.config.codec.digest_algorithm, kinds, lanes)
        signed = self._resumed.state_digest
        if digest.root != signed.root:
            return "", f"the ranks' rebuilt pieces compose to digest {digest.root}, step {step}'s is {signed.root}"
        self._digest = digest
        return digest.root, ""

    # --- the trainer's side ----------------------------------------------------------------------
    def copy(self, step: int, state: State, files: dict[str, bytes]) -> HostCopy:
        """This rank's pieces of `state`, copied to host memory (replicas another rank publishes are not)."""
        t0 = time.perf_counter()
        pieces, tensors = local_pieces(state, self.rank, self._declared)
        # Replicas another rank publishes are not copied (the layout of the last anchor says which).
        keep = None if pieces != self._raw else self._keep  # pieces that moved: a layout to check, all copied
        held = {n: t for n, t in tensors.items() if keep is None or n in keep}
        copied = self.pool.copy(held)
        return HostCopy(step, copied, time.perf_counter() - t0, files, pieces)

    def holds(self, snap: HostCopy) -> bool:
        return self._base is snap

    async def drain(self) -> None:
        """Nothing runs after a step: its anchor is a round of the step."""

    async def close(self) -> None:
        """Nothing to persist: each rank's cache (`cache_dir`) is kept as it uploads."""

    def baseline(self) -> State:
        return self._base.state if self._base is not None else {}

    @property
    def owned_bytes(self) -> int:
        """Bytes of the pieces this rank publishes (its shard)."""
        return sum(p.length * (p.tensor_bytes // max(p.numel, 1)) for p in self._pieces.values())

    # --- the rounds ------------------------------------------------------------------------------
    async def publish(self, snap: HostCopy) -> None:
        """One step on every rank; a failure of this rank or of a collective stops publishing on every rank."""
        try:
            await self._publish_step(snap, snap.pieces or {})
        except PulseSyncError:
            raise
        except Exception as e:  # a collective that failed (a rank died or timed out) or a bug
            raise PulseSyncError(f"step {snap.step}: rank {self.rank}: {type(e).__name__}: {e}") from e

    async def _publish_step(self, snap: HostCopy, pieces: dict[str, Piece]) -> None:
        if self._base is None and self._resume_from is not None:
            await self._resume(snap, pieces)
        # Every rank must run the same rounds: one whose pieces changed (resharded) makes it an anchor for all.
        moved = await self._collective(self._coordinator.all_gather, pieces != self._raw)
        if self._anchor_next or self._base is None or any(moved):
            await self._round(snap, pieces, "anchor")
            return
        if await self._round(snap, pieces, "patch") and self._schedule.due:
            await self._round(snap, pieces, "anchor")

    async def _round(self, snap: HostCopy, raw: dict[str, Piece], kind: layout.Kind) -> bool:
        """One object set of a step on every rank; returns whether it was committed."""
        report = StepReport(snap.step, kind, snapshot_s=snap.seconds)
        pieces = self._pieces
        if kind == "anchor":  # the layout is checked on every rank before anything is uploaded
            per_rank: list[list[Piece]] = await self._collective(self._coordinator.all_gather, list(raw.values()))
            self._layout = validate(per_rank)
            self._dense_bytes = sum(ps[0].tensor_bytes for ps in self._layout.values())
            pieces = {p.name: p for ps in self._layout.values() for p in ps if p.rank == self.rank}
            self._raw, self._keep = raw, frozenset(pieces)
        # An anchor added to a step whose patch round committed carries each rank's part history: the next
        # parts are history-coded as if there were no anchor.
        history = self._history if kind == "anchor" and self._base_step == snap.step else None
        t0, report.started = time.perf_counter(), time.time()
        try:
            part = await (self._anchor_part(snap, pieces, history) if kind == "anchor" else self._patch_part(snap))
        except PulseSyncError as e:
            part = _Part(self.rank, error=f"{type(e).__name__}: {e}")
        report.encode_s = time.perf_counter() - t0
        report.wire_bytes = sum(ref.size for ref in part.objects)
        report.changed_elements = part.changed
        gathered: list[_Part | None] = await self._collective(self._coordinator.all_gather, part)
        t1 = time.perf_counter()
        mine = (
            await self._commit_on_root(snap, kind, [p for p in gathered if p is not None]) if self.rank == 0 else None
        )
        done = await self._collective(self._coordinator.broadcast, mine)
        assert isinstance(done, _Outcome)
        report.commit_s = time.perf_counter() - t1
        report.ok = done.committed
        report.error = done.error or None
        self._record(report)
        if done.fatal is not None:
            raise done.fatal
        if not done.committed:
            self._anchor_next, self._history = True, None  # the next step starts a sound chain again
            log.error("step %d: %s not committed on any rank (%s)", snap.step, kind, done.error)
            return False
        if self._base is not None and self._base is not snap:
            self.pool.release(self._base.state)
        self._base, self._pieces, self._base_root, self._base_step = snap, pieces, done.root, snap.step
        # A part after an anchor that carries its rank's history is coded against it; after one in place of a
        # patch, without a reference, as a patch is: a subscriber that starts from the anchor holds none.
        self._history = self._encoded if kind == "patch" else history
        self._anchor_next = False
        if kind == "anchor":
            self._schedule.anchor_started()
            self._schedule.anchor_committed(snap.step)
            if self._cache is not None:
                await self._cache.prune({ref.key for ref in part.objects})
        else:
            self._schedule.patch_committed(done.wire_bytes)
        return True

    async def _patch_part(self, snap: HostCopy) -> _Part:
        """Encode this rank's pieces against its baseline and upload the part."""
        assert self._base is not None
        self._encoded = None
        encoded = await asyncio.to_thread(
            encode_part,
            self._base.state,
            snap.state,
            self._pieces,
            self.config.codec,
            part=self.rank,
            base_root=self._base_root,
            dense_bytes_total=self._dense_bytes,
            reference=self._history,
        )
        self._encoded = encoded.history
        key = layout.part_key(snap.step, self.run_id, self.rank)
        await self.store.put(key, encoded.data)
        if self._cache is not None:
            await self._cache.keep(key, encoded.data)
        ref = ObjectRef.for_bytes(key, encoded.data)
        return _Part(self.rank, "", [ref], list(encoded.lanes.items()), encoded.changed_elements, encoded.codings)

    async def _anchor_part(self, snap: HostCopy, pieces: dict[str, Piece], history: PatchHistory | None) -> _Part:
        """Write this rank's pieces as its file of the anchor and upload it, and its part's `history` beside."""
        carried = await self._upload_history(snap.step, history) if history is not None else None
        if not pieces:
            return _Part(self.rank, "", [carried] if carried else [], history=carried.key if carried else "")
        if missing := sorted(set(pieces) - set(snap.state)):
            raise PulseSyncError(f"anchor {snap.step}: rank {self.rank} owns {missing[0]!r} but did not copy it")
        sums = [(n, await asyncio.to_thread(_piece_sums, p, snap.state[n])) for n, p in sorted(pieces.items())]
        name = PIECES_FILE.format(rank=self.rank, world=self.world)
        with tempfile.TemporaryDirectory(prefix=f"pulsesync-pieces-{snap.step}-", dir=self.config.spool_dir) as spool:
            path = Path(spool) / name
            places = {n: (p.start, list(p.shape), p.runs, p.stride) for n, p in pieces.items()}
            try:
                await asyncio.to_thread(write_pieces, path, {n: snap.state[n] for n in pieces}, places)
            except OSError as e:
                raise PulseSyncError(f"anchor {snap.step}: cannot write {path} ({e})") from e
            with phase(f"anchor {snap.step}: rank {self.rank}'s upload", path.stat().st_size) as shown:
                key = layout.anchor_dir(snap.step, self.run_id) + name
                done = await self.store.upload_file(key, path, progress=shown.transfer)
            if self._cache is not None:
                await self._cache.adopt(key, path)
        ref = ObjectRef(key=done.key, size=done.size, sha256=done.sha256)
        objects = [ref, carried] if carried else [ref]
        return _Part(
            self.rank, "", objects, sums, sum(p.length for p in pieces.values()), {}, carried.key if carried else ""
        )

    async def _upload_history(self, step: int, history: PatchHistory) -> ObjectRef:
        """Upload this rank's part history of `step` as an object of the step's anchor."""
        data = await asyncio.to_thread(history_bytes, StepHistory.of(history))
        key = layout.anchor_dir(step, self.run_id) + HISTORY_FILE.format(part=self.rank)
        await self.store.put(key, data)
        if self._cache is not None:
            await self._cache.keep(key, data)
        return ObjectRef.for_bytes(key, data)

    # --- rank 0: the commit ----------------------------------------------------------------------
    async def _commit_on_root(self, snap: HostCopy, kind: layout.Kind, parts: list[_Part]) -> _Outcome:
        failed = [f"rank {p.rank}: {p.error}" for p in parts if p.error]
        if failed:
            return _Outcome(False, "; ".join(failed))
        try:
            return await self._commit(snap, kind, sorted(parts, key=lambda p: p.rank))
        except ConflictError as e:
            return _Outcome(False, str(e), fatal=e)
        except PulseSyncError as e:
            return _Outcome(False, f"{type(e).__name__}: {e}")

    async def _commit(self, snap: HostCopy, kind: layout.Kind, parts: list[_Part]) -> _Outcome:
        assert self._key is not None and self._guard is not None and self._chain is not None
        lanes = [lane for p in parts for lane in p.lanes]
        first = {name: pieces[0] for name, pieces in self._layout.items()}
        wire = sum(ref.size for p in parts for ref in p.objects)
        changed = sum(p.changed for p in parts)
        sizes = Sizes(dense_bytes=self._dense_bytes, wire_bytes=wire, changed_elements=changed)
        if kind == "anchor":
            kinds = {name: (p.dtype, p.shape) for name, p in first.items()}
            digest = summed_digest(self.config.codec.digest_algorithm, kinds, lanes)
            refs = [ref for p in parts for ref in p.objects]
            prefix = layout.anchor_dir(snap.step, self.run_id)
            self._files |= snap.files
            for name, data in sorted(self._files.items()):
                await self.store.put(prefix + name, data)
                refs.append(ObjectRef.for_bytes(prefix + name, data))
            histories = [p.history for p in parts if p.history]
            manifest: Any = anchor_manifest(snap.step, refs, digest, sizes, len(parts), histories)
        else:
            assert self._digest is not None
            digest = moved_digest(self._digest, lanes)
            base = VerifiedState(self._base_step, {}, self._digest)
            objects = [p.objects[0] for p in parts]
            codings: dict[str, int] = {}
            for p in parts:
                for coding, n in p.codings.items():
                    codings[coding] = codings.get(coding, 0) + n
            anchor_step, params = self._schedule.anchor_step, self.config.codec
            records = dict(sorted(codings.items()))
            manifest = patch_manifest(snap.step, base, anchor_step, objects, digest, sizes, params, None, records)
        await self._guard.check(snap.step)
        step_committed = kind == "anchor" and self._committed_step == snap.step  # its patch round committed
        self._guard.wrote(marker_key(manifest, step_committed))
        signed = manifest.model_copy(update={"stream_id": self.stream_id})
        await write_ready_marker(self.store, signed, self._key, step_committed)
        self._committed_step = snap.step
        self._digest = digest
        log.info("step %d: %s committed from %d ranks (digest %s)", snap.step, kind, len(parts), digest.root)
        return _Outcome(True, root=digest.root, wire_bytes=wire)
