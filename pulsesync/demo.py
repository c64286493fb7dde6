"""`pulsesync demo`: the PULSE protocol end to end on one machine, with no server.

A synthetic trainer (fp32 master weights, AdamW at an RL learning rate, published as bf16)
publishes (pulsesync.publisher) a signed patch every step and a signed anchor every k steps into a store, in the
protocol's layout, each ready marker written last with put-if-absent. By default the store is a
fresh directory (no server); --store points it at S3, R2, MinIO or a shared filesystem. Two
subscribers verify and apply the steps: one follows from the start (fast path), one joins late
(slow path: anchor + chain). The demo succeeds only if both end bitwise equal to the trainer.
Publisher and subscribers are pulsesync's own (pulsesync.publisher, pulsesync.subscriber).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync import signing
from pulsesync.codec import CodecParams
from pulsesync.config import PublisherConfig, StoreConfig, SubscriberConfig
from pulsesync.errors import ConflictError
from pulsesync.publisher import AsyncPublisher
from pulsesync.store import FileStore, Store, open_store
from pulsesync.subscriber import Subscriber
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


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
        config = PublisherConfig(anchor_interval=anchor_interval, codec=params)
        publisher = AsyncPublisher(config, store=store, signing_key=key)
        await publisher.start()
        sub_config = SubscriberConfig(codec=params)
        early, late = (Subscriber(sub_config, store=store, trusted=trusted) for _ in "AB")
        paths: dict[int, dict[str, int]] = {id(early): {}, id(late): {}}

        async def sync(subscriber: Subscriber) -> str:
            path = (await subscriber.sync()).path
            counts = paths[id(subscriber)]
            counts[path] = counts.get(path, 0) + 1
            return path

        out(f"{'step':>5} {'published':<15} {'wire bytes':>12} {'density':>8} {'ratio':>7}  {'A path':<10} B path")
        dense = patch_bytes = 0
        for step in range(steps + 1):
            if step:
                trainer.step()
            state = trainer.state()
            dense = sum(t.numel() * t.element_size() for t in state.values())
            await publisher.publish(step, state)
            await publisher.flush()  # the demo's subscribers read each step right after it commits
            published = [r for r in publisher.reports if r.step == step and r.ok]
            kinds = "+".join(r.kind for r in published)
            patch = next((r for r in published if r.kind == "patch"), None)
            patch_bytes += patch.wire_bytes if patch else 0
            density = f"{patch.density:.2%}" if patch else "-"
            ratio = f"{patch.ratio:.0f}x" if patch else "-"
            a_path = await sync(early)
            b_path = await sync(late) if step >= late_join else "-"
            out(f"{step:>5} {kinds:<15} {published[0].wire_bytes:>12,} {density:>8} {ratio:>7}  {a_path:<10} {b_path}")
        ok = all(s.state is not None and _bits_equal(s.state, trainer.state()) for s in (early, late))
        full = dense * steps
        out("")
        out(
            f"patches on the wire: {patch_bytes:,} bytes for {steps} steps; full checkpoints: {full:,} bytes "
            f"-> {full / max(patch_bytes, 1):.0f}x less"
        )
        for name, s in zip("AB", (early, late), strict=True):
            taken = ", ".join(f"{k} x{v}" for k, v in sorted(paths[id(s)].items()) if k != "up-to-date")
            out(
                f"subscriber {name}: step {s.step}, paths: {taken}; {s.reader.manifests_verified} manifests "
                f"verified, {s.reader.bytes_downloaded:,} bytes downloaded, digest {s.digest.root if s.digest else '-'}"
            )
        verdict = "bitwise equal to the trainer" if ok else "NOT EQUAL to the trainer"
        out(f"result: both subscribers {verdict} ({time.perf_counter() - t_start:.1f}s)")
        return ok
