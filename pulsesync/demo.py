"""`pulsesync demo`: the PULSE protocol end to end on one machine, with no server.

A synthetic trainer (fp32 master weights, AdamW at an RL learning rate, published as bf16)
publishes a signed patch every step and a signed anchor every k steps into a store, in the
protocol's layout, each ready marker written last with put-if-absent. By default the store is a
fresh directory (no server); --store points it at S3, R2, MinIO or a shared filesystem. Two
subscribers verify and apply the steps: one follows from the start (fast path), one joins late
(slow path: anchor + chain). The demo succeeds only if both end bitwise equal to the trainer.
The publish/subscribe daemons replace the minimal publisher and subscriber here as they land.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from pulsesync import layout, signing
from pulsesync.codec import CodecParams, apply_patch, encode_patch, read_header
from pulsesync.config import StoreConfig
from pulsesync.digest import StateDigest, state_digest
from pulsesync.errors import ConflictError, IntegrityError
from pulsesync.manifest import (
    AnchorFormat,
    AnchorManifest,
    ObjectRef,
    PatchCodec,
    PatchManifest,
    Sizes,
    utc_now,
    verify_manifest,
)
from pulsesync.store import FileStore, Store, open_store
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes

ANCHOR_FILE = "model.safetensors"


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


@dataclass
class _Publisher:
    """Minimal publisher: payload first, then the signed manifest as the ready marker, put-if-absent."""

    key: Ed25519PrivateKey
    store: Store
    anchor_interval: int
    params: CodecParams
    state: dict[str, torch.Tensor] | None = None
    digest: StateDigest | None = None
    step: int = -1
    anchor_step: int = -1

    async def publish(self, step: int, state: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
        """Publish a patch (when a baseline exists) and an anchor (every k steps); returns (kind, wire, changed)."""
        digest = state_digest(state, self.params.digest_algorithm)
        dense = sum(t.numel() * t.element_size() for t in state.values())
        out = []
        if self.state is not None and self.digest is not None:
            patch = encode_patch(self.state, state, self.params, base_digest=self.digest, new_digest=digest)
            header = read_header(patch)
            await self.store.put(layout.patch_key(step), patch)
            manifest = PatchManifest(
                step=step,
                base_step=self.step,
                anchor_step=self.anchor_step,
                base_digest=self.digest.root,
                objects=[ObjectRef.for_bytes(layout.patch_key(step), patch)],
                state_digest=digest,
                sizes=Sizes(dense_bytes=dense, wire_bytes=len(patch), changed_elements=header.changed_elements),
                created_at=utc_now(),
                codec=PatchCodec(
                    format_version=1,
                    value_coding=header.value_coding,
                    zstd_level=header.zstd_level,
                    chunk_elements=header.chunk_elements,
                ),
            )
            await self.store.put_if_absent(layout.ready_key(step, "patch"), manifest.signed(self.key).to_bytes())
            out.append(("patch", len(patch), header.changed_elements))
        if self.state is None or step % self.anchor_interval == 0:
            shard_key = layout.anchor_prefix(step) + ANCHOR_FILE
            shard = save_safetensors(state)
            await self.store.put(shard_key, shard)
            anchor = AnchorManifest(
                step=step,
                objects=[ObjectRef.for_bytes(shard_key, shard)],
                state_digest=digest,
                sizes=Sizes(
                    dense_bytes=dense, wire_bytes=len(shard), changed_elements=sum(t.numel() for t in state.values())
                ),
                created_at=utc_now(),
                codec=AnchorFormat(shards=1),
            )
            await self.store.put_if_absent(layout.ready_key(step, "anchor"), anchor.signed(self.key).to_bytes())
            self.anchor_step = step
            out.append(("anchor", len(shard), 0))
        self.state, self.digest, self.step = state, digest, step  # the baseline advances only once committed
        return out


@dataclass
class _Subscriber:
    """Minimal verifying subscriber: fast, chain and slow paths over the store."""

    name: str
    trusted: Mapping[str, Ed25519PublicKey]
    state: dict[str, torch.Tensor] | None = None
    digest: StateDigest | None = None
    step: int = -1
    paths: dict[str, int] = field(default_factory=dict)
    verified: int = 0
    downloaded: int = 0
    ready: list[layout.ReadyEntry] = field(default_factory=list)
    _last_ready_key: str | None = None

    async def _fetch(self, store: Store, ref: ObjectRef) -> bytes:
        data = await store.get(ref.key)
        self.downloaded += len(data)
        if len(data) != ref.size or hashlib.sha256(data).hexdigest() != ref.sha256:
            raise IntegrityError(f"object {ref.key}: size or SHA-256 does not match its manifest")
        return data

    async def _manifest(
        self, store: Store, step: int, kind: layout.Kind, newer_than: int | None = None
    ) -> PatchManifest | AnchorManifest:
        key = layout.ready_key(step, kind)
        m = verify_manifest(await store.get(key), self.trusted, newer_than=newer_than, name=key)
        self.verified += 1
        return m

    async def _discover(self, store: Store) -> None:
        """Append ready markers published since the last poll (one small listing request)."""
        async for info in store.list("ready/", start_after=self._last_ready_key):
            self._last_ready_key = info.key
            if entry := layout.parse_ready_key(info.key):
                self.ready.append(entry)

    async def sync(self, store: Store) -> str:
        """Move to the newest ready step; returns the path taken."""
        await self._discover(store)
        target = self.ready[-1].step
        patches = {e.step for e in self.ready if e.kind == "patch"}
        if target == self.step:
            return "up-to-date"
        # Patch steps between ours and the target (steps may skip): the chain must connect to us.
        chain = sorted(s for s in patches if self.step < s <= target)
        first = await self._manifest(store, chain[0], "patch") if self.state is not None and chain else None
        if isinstance(first, PatchManifest) and first.base_step == self.step:
            path = "fast" if len(chain) == 1 else "chain"
            state, digest, step = self.state, self.digest, self.step
        else:
            path = "slow"
            anchor_step = max(e.step for e in self.ready if e.kind == "anchor" and e.step <= target)
            m = await self._manifest(store, anchor_step, "anchor")
            state = load_safetensors(await self._fetch(store, m.objects[0]))
            digest = state_digest(state, m.state_digest.algorithm)
            if digest.root != m.state_digest.root:
                raise IntegrityError(f"anchor {anchor_step}: {digest.describe_mismatch(m.state_digest)}")
            step = anchor_step
            chain = sorted(s for s in patches if anchor_step < s <= target)
        assert state is not None
        work = {n: t.clone() for n, t in state.items()}  # staged: the served state changes only on success
        for s in chain:
            reuse = first is not None and path != "slow" and s == chain[0]  # already fetched and verified
            link = first if reuse else await self._manifest(store, s, "patch", step)
            assert isinstance(link, PatchManifest) and digest is not None
            digest = apply_patch(work, await self._fetch(store, link.objects[0]), base_digest=digest)
            assert digest is not None
            if digest.root != link.state_digest.root:
                raise IntegrityError(f"step {s}: {digest.describe_mismatch(link.state_digest)}")
            step = s
        self.state, self.digest, self.step = work, digest, step
        self.paths[path] = self.paths.get(path, 0) + 1
        return path


def run_demo(
    steps: int = 30,
    anchor_interval: int = 10,
    hidden: int = 256,
    layers: int = 4,
    lr: float = 1e-6,
    late_join: int | None = None,
    seed: int = 0,
    params: CodecParams | None = None,
    store: StoreConfig | None = None,
    out: Callable[[str], None] = print,
) -> bool:
    """Run the demo; prints a per-step table and a summary; True iff both subscribers are bit-exact.

    Without a store URL it publishes into a fresh directory (no server needed).
    """
    args = (steps, anchor_interval, hidden, layers, lr, late_join, seed, params or CodecParams(), out)
    if store is not None and store.url:
        return asyncio.run(_demo(open_store(store), *args))
    with tempfile.TemporaryDirectory(prefix="pulsesync-demo-") as tmp:
        return asyncio.run(_demo(FileStore(tmp), *args))


async def _demo(
    store: Store,
    steps: int,
    anchor_interval: int,
    hidden: int,
    layers: int,
    lr: float,
    late_join: int | None,
    seed: int,
    params: CodecParams,
    out: Callable[[str], None],
) -> bool:
    async with store:
        async for info in store.list("ready/"):
            raise ConflictError(f"{store.url} already holds published steps ({info.key}); use an empty prefix")
        t_start = time.perf_counter()
        late_join = late_join if late_join is not None else max(1, steps * 2 // 3 - 3)  # between anchors
        key = Ed25519PrivateKey.generate()
        trusted = dict(signing.trusted_keys([key.public_key()]))
        shapes = llm_like_shapes(hidden, layers, vocab=96 * hidden)
        trainer = SyntheticTrainer(shapes, lr=lr, seed=seed)
        out(
            f"pulsesync demo: {sum(torch.Size(s).numel() for s in shapes.values()) / 1e6:.1f}M parameters (bf16), "
            f"AdamW lr={lr:g}, {steps} steps, anchor every {anchor_interval}; store {store.url}; "
            f"signer {signing.key_id(key.public_key())}"
        )
        for _ in range(12):  # past AdamW's first steps, whose updates are unusually dense
            trainer.step()
        publisher = _Publisher(key, store, anchor_interval, params)
        early, late = _Subscriber("A", trusted), _Subscriber("B", trusted)
        out(f"{'step':>5} {'published':<15} {'wire bytes':>12} {'density':>8} {'ratio':>7}  {'A path':<10} B path")
        dense = patch_bytes = 0
        for step in range(steps + 1):
            if step:
                trainer.step()
            state = trainer.state()
            dense = sum(t.numel() * t.element_size() for t in state.values())
            published = await publisher.publish(step, state)
            kinds = "+".join(k for k, _, _ in published)
            wire = published[0][1]
            patch = next(((w, c) for k, w, c in published if k == "patch"), None)
            if patch:
                patch_bytes += patch[0]
            density = f"{patch[1] / (dense / 2):.2%}" if patch else "-"
            ratio = f"{dense / patch[0]:.0f}x" if patch else "-"
            a_path = await early.sync(store)
            b_path = await late.sync(store) if step >= late_join else "-"
            out(f"{step:>5} {kinds:<15} {wire:>12,} {density:>8} {ratio:>7}  {a_path:<10} {b_path}")
        ok = all(s.state is not None and _bits_equal(s.state, trainer.state()) for s in (early, late))
        full = dense * steps
        out("")
        out(
            f"patches on the wire: {patch_bytes:,} bytes for {steps} steps; full checkpoints: {full:,} bytes "
            f"-> {full / max(patch_bytes, 1):.0f}x less"
        )
        for s in (early, late):
            paths = ", ".join(f"{k} x{v}" for k, v in sorted(s.paths.items()))
            out(
                f"subscriber {s.name}: step {s.step}, paths: {paths}; {s.verified} manifests verified, "
                f"{s.downloaded:,} bytes downloaded, digest {s.digest.root if s.digest else '-'}"
            )
        verdict = "bitwise equal to the trainer" if ok else "NOT EQUAL to the trainer"
        out(f"result: both subscribers {verdict} ({time.perf_counter() - t_start:.1f}s)")
        return ok
