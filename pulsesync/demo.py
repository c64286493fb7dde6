"""`pulsesync demo`: the PULSE protocol end to end on one machine, with no server to install.

By default the store is an S3 server started inside this process (moto's server mode on
127.0.0.1, spoken to over HTTP by the same client as AWS S3); --store points it at S3, R2, MinIO
or a shared filesystem instead. A synthetic trainer (fp32 master weights, AdamW at an RL learning
rate, published as bf16) publishes through pulsesync's publisher a signed patch every step and a
signed anchor every k steps. Subscriber A follows from the start (fast path), B joins late (slow
path: anchor + chain). One patch object is corrupted in the store: the subscribers detect it,
fall back to the slow path and recover. Retention prunes the store after every anchor. The demo
succeeds only if both subscribers, and a rebuild of the newest step from the pruned store, are
bitwise equal to the trainer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.codec import CodecParams
from pulsesync.dtypes import dense_bytes
from pulsesync.errors import ConflictError
from pulsesync.protocol import layout, signing
from pulsesync.protocol.chain import ChainClient
from pulsesync.protocol.manifest import parse_manifest
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.rebuild import reconstruct
from pulsesync.retention import RetentionWorker
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.store import S3Store, Store, open_store
from pulsesync.store.config import StoreConfig
from pulsesync.store.embedded import embedded_s3
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes

EMBEDDED_BUCKET = "pulsesync-demo"


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
    """Run the demo; prints a per-step table and a summary; True iff everything ends bit-exact."""
    args = (steps, anchor_interval, hidden, layers, lr, late_join, seed, params or CodecParams(), out)
    if store is not None and store.url:
        return asyncio.run(_demo(open_store(store), *args))
    with embedded_s3(EMBEDDED_BUCKET) as endpoint:
        return asyncio.run(
            _demo(S3Store(EMBEDDED_BUCKET, f"demo-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint), *args)
        )


async def _corrupt_patch(store: Store, step: int) -> str:
    """Flip one byte of a published patch object in the store (as a faulty disk or proxy would)."""
    object_key = parse_manifest(await store.get(layout.commit_key(step))).objects[0].key
    data = bytearray(await store.get(object_key))
    data[len(data) // 2] ^= 0x01
    await store.put(object_key, bytes(data))
    return object_key


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
        if found := await ChainClient(store, {}).refresh():
            first = found[0][1].key
            raise ConflictError(f"{store.url} already holds published steps ({first}); use an empty prefix")
        t_start = time.perf_counter()
        late_join = late_join if late_join is not None else max(1, steps * 2 // 3 - 3)  # between anchors
        corrupt_at = next((s for s in range(2 * anchor_interval, 0, -anchor_interval) if late_join < s <= steps), None)
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
        publisher = AsyncPublisher(
            PublisherConfig(anchor_interval=anchor_interval, codec=params), store=store, signing_key=key
        )
        await publisher.start()
        sub_config = SubscriberConfig(codec=params)
        subs = {name: Subscriber(sub_config, store=store, trusted=trusted) for name in "AB"}
        joined = {"A": 0, "B": late_join}
        paths: dict[str, dict[str, int]] = {"A": {}, "B": {}}
        retention = RetentionWorker(
            store,
            RetentionPolicy(keep_patches=max(1, anchor_interval // 2), keep_anchors=1, grace_seconds=0),
            trusted,
        )
        pruned_objects = pruned_bytes = 0

        async def sync(name: str) -> str:
            sub = subs[name]
            fallbacks = sum(sub.status.fallbacks.values())
            path = (await sub.sync()).path
            paths[name][path] = paths[name].get(path, 0) + 1
            return f"{path} (fell back)" if sum(sub.status.fallbacks.values()) > fallbacks else path

        out(f"{'step':>5} {'published':<13} {'wire bytes':>12} {'density':>8} {'ratio':>6}  {'A':<17} {'B':<17} note")
        dense = patch_bytes = 0
        for step in range(steps + 1):
            if step:
                trainer.step()
            state = trainer.state()
            dense = dense_bytes(state)
            await publisher.publish(step, state)
            await publisher.flush()  # the demo's subscribers read each step right after it commits
            published = [r for r in publisher.reports if r.step == step and r.ok]
            patch = next((r for r in published if r.kind == "patch"), None)
            patch_bytes += patch.wire_bytes if patch else 0
            notes = []
            if step == corrupt_at:
                notes.append(f"corrupted {(await _corrupt_patch(store, step)).rsplit('/', 1)[-1]} in the store")
            a_path = await sync("A")
            b_path = await sync("B") if step >= late_join else "-"
            if step and step % anchor_interval == 0:
                plan = await retention.run_once()
                pruned_objects += plan.deleted_objects
                pruned_bytes += plan.freed_bytes
                notes.append(f"retention: {len(plan.unmark)} markers, {plan.freed_bytes:,} bytes pruned")
            out(
                f"{step:>5} {'+'.join(r.kind for r in published):<13} {published[0].wire_bytes:>12,} "
                f"{f'{patch.density:.2%}' if patch else '-':>8} {f'{patch.ratio:.0f}x' if patch else '-':>6}  "
                f"{a_path:<17} {b_path:<17} {'; '.join(notes)}"
            )
        await publisher.close()
        truth = trainer.state()
        equal = {name: s.state is not None and _bits_equal(s.state, truth) for name, s in subs.items()}
        rebuilt = await reconstruct(ChainClient(store, trusted))
        equal["store"] = rebuilt.step == steps and _bits_equal(rebuilt.state, truth)
        full = dense * steps
        out("")
        out(f"{'':<24} {'A':<34} B")
        rows = {
            "joined at step": {n: str(joined[n]) for n in subs},
            "paths taken": {
                n: ", ".join(f"{k} x{v}" for k, v in sorted(paths[n].items()) if k != "up-to-date") for n in subs
            },
            "manifests verified": {n: str(s.stores.read.chain.manifests_verified) for n, s in subs.items()},
            "fallbacks": {
                n: ", ".join(f"{k} x{v}" for k, v in s.status.fallbacks.items()) or "0" for n, s in subs.items()
            },
            "bytes downloaded": {n: f"{s.stores.bytes_downloaded:,}" for n, s in subs.items()},
            "bitwise equal to trainer": {n: "yes" if equal[n] else "NO" for n in subs},
        }
        for label, cells in rows.items():
            out(f"{label:<24} {cells['A']:<34} {cells['B']}")
        out(
            f"patches on the wire: {patch_bytes:,} bytes for {steps} steps; full checkpoints: {full:,} bytes "
            f"-> {full / max(patch_bytes, 1):.0f}x less"
        )
        out(
            f"retention: {pruned_objects} objects ({pruned_bytes:,} bytes) pruned; newest step {rebuilt.step} "
            f"rebuilt from the store (anchor {rebuilt.anchor_step} + {rebuilt.patches_applied} patches): "
            f"{'bitwise equal' if equal['store'] else 'NOT EQUAL'}"
        )
        ok = all(equal.values())
        verdict = "every subscriber bitwise equal to the trainer" if ok else "NOT bitwise equal to the trainer"
        out(f"result: {verdict} ({time.perf_counter() - t_start:.1f}s)")
        return ok
