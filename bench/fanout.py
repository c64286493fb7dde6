"""Fan-out across regions: an origin, two regional mirrors, subscribers in both regions; what leaves the origin.

Three real SeaweedFS servers on 127.0.0.1 stand for the origin bucket and two regions' buckets.
The publisher writes to the origin; `pulsesync mirror` copies each step to each region (one
`Mirror` per region, in this process); every subscriber lists its region's mirror first and the
origin last (`stores`). Everything that reads the origin (the mirrors, and subscribers falling
back) goes through an HTTP proxy that counts the body bytes it sends: the origin's egress (one proxy for
the mirrors, one for the subscribers, so that the report says whose it is).

- Region A's mirror lies: it writes a patch with one byte swapped, another patch replaced by the
  step before's (a stale object), and withholds a step's marker (steps 15, 30 and 45). It serves
  3 of the quick run's 30 subscribers (6 of 60).
- Region B's mirror lags: it copies every 2 s, within the subscribers' `max_lag_seconds` (15 s).

Every state a subscriber hands its sinks is compared bit for bit with the trainer's state of that
step (a recording sink): `unverified_served` counts those that differ, and subscribers that do not
end on the last step bit-exact. The same run without mirrors (every subscriber on the origin) is
the baseline. The workload is the real-like trainer (pulsesync.synthetic, calibrated on real
fine-tunes: bench/calibrate.py): an anchor at step 0, then patches.

  mirrors                  2
  origin_egress_over_patch origin egress from step 1 on / bytes of the patches published (a step a
                           second): each mirror reads each patch once, each fallback once more
  no_mirror_egress_over_patch  the same without mirrors (over 10 steps): one per subscriber
  fallbacks_per_step       syncs a mirror failed (taken from the origin), per step
  egress_by_kind           the origin's egress by reader (mirrors, subscribers) and object kind

The contracts: origin_egress_over_patch <= mirrors + 0.5 and unverified_served == 0. A broken
contract exits 1.

    python bench/fanout.py --quick --json out.json --plots DIR   # 30 subscribers, 60 steps: the contract
    python bench/fanout.py                                        # 60 subscribers, 120 steps
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from contracts import Contract, enforce

from pulsesync.mirror import Mirror, MirrorConfig
from pulsesync.protocol import layout, signing
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.sinks import Sink, Update
from pulsesync.store import S3Store, Store
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.synthetic import real_like_trainer
from tests.support.fault_proxy import FaultProxy
from tests.support.servers import BUCKET, seaweedfs_cluster


class LyingStore(S3Store):
    """A mirror's target that corrupts what the mirror writes at some steps: swapped bytes, a stale object,
    a withheld marker."""

    def __init__(self, *args: Any, lies: dict[int, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lies = lies
        self._before = b""  # the patch written before: a stale object

    async def put(self, key: str, data: bytes) -> None:
        step = layout.step_of_payload(key)
        if key.startswith("patches/"):
            lie = self.lies.get(step) if step is not None else None
            honest = data
            if lie == "swapped":
                data = data[:-1] + bytes([data[-1] ^ 0x01])
            elif lie == "stale":
                data = self._before or data
            self._before = honest
        await super().put(key, data)

    async def put_if_absent(self, key: str, data: bytes) -> None:
        if (entry := layout.parse_ready_key(key)) is not None and self.lies.get(entry.step) == "withheld":
            return
        await super().put_if_absent(key, data)


@dataclass
class Recorder(Sink):
    """Compares each state handed to it with the trainer's state of that step, bit for bit."""

    trained: list[dict[str, torch.Tensor]]
    name: str = "recorder"
    served: list[int] = field(default_factory=list)
    unverified: int = 0

    async def deliver(self, update: Update) -> None:
        expected = self.trained[update.step]
        same = update.state.keys() == expected.keys() and all(
            torch.equal(update.state[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in expected
        )
        self.unverified += not same
        self.served.append(update.step)


async def scenario(
    *,
    endpoints: dict[str, str],
    key: Ed25519PrivateKey,
    trained: list[dict[str, torch.Tensor]],
    args: argparse.Namespace,
    mirrored: bool,
) -> dict[str, Any]:
    """One run: publish, mirror (or not), follow with every subscriber; what left the origin."""
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    steps = args.steps if mirrored else args.baseline_steps  # the baseline's ratio is per step: fewer do
    trusted = signing.trusted_keys([key.public_key()])
    # One proxy for the mirrors' reads, one for the subscribers': the origin's egress, and whose it is.
    proxies = {"mirrors": FaultProxy(endpoints["origin"]), "subscribers": FaultProxy(endpoints["origin"])}
    for proxy in proxies.values():
        await proxy.start()
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    origin = S3Store(BUCKET, prefix, endpoint_url=endpoints["origin"])
    lies = {step: kind for step, kind in zip(args.lies, ("swapped", "stale", "withheld"), strict=False)}
    regions: dict[str, Store] = {}
    mirrors: list[Mirror] = []
    if mirrored:
        regions["a"] = LyingStore(BUCKET, prefix, endpoint_url=endpoints["a"], lies=lies)
        regions["b"] = S3Store(BUCKET, prefix, endpoint_url=endpoints["b"])
        for name, interval in (("a", 0.5), ("b", args.lag)):
            config = MirrorConfig(interval_seconds=interval)
            read = S3Store(BUCKET, prefix, endpoint_url=proxies["mirrors"].endpoint)
            mirror = Mirror(read, regions[name], config, trusted)
            mirrors.append(mirror)
            tasks.append(asyncio.create_task(mirror.run(stop)))
    counts = {"a": args.liar_region, "b": args.subscribers - args.liar_region} if mirrored else {"": args.subscribers}
    config = SubscriberConfig(
        poll_seconds=0.5,
        list_every_seconds=2.0,
        max_lag_seconds=args.max_lag,
        payload_wait_seconds=5.0,
        fleet_status=False,
        scrub_interval_seconds=None,
        retry_initial_seconds=0.1,
        retry_max_seconds=1.0,
    )
    subs: list[tuple[str, Subscriber, Recorder]] = []
    pub_config = PublisherConfig(anchor_interval=10**6, on_backpressure="block")
    patch_bytes = 0
    t0 = time.perf_counter()
    async with AsyncPublisher(pub_config, store=origin, signing_key=key) as pub:
        await pub.publish(0, trained[0], {"config.json": b'{"model_type": "t"}'})
        await pub.flush()
        for mirror in mirrors:  # a region's fleet starts from its mirror
            await until_copied(mirror, 0)
        for region, n in counts.items():
            for _ in range(n):
                stores: list[Store] = [S3Store(BUCKET, prefix, endpoint_url=proxies["subscribers"].endpoint)]
                if region:
                    stores.insert(0, S3Store(BUCKET, prefix, endpoint_url=endpoints[region]))
                recorder = Recorder(trained)
                sub = Subscriber(config, stores=stores, trusted=trusted, sinks=[recorder])
                subs.append((region, sub, recorder))
                tasks.append(asyncio.create_task(sub.run(stop)))
        await until(lambda: all(s.step == 0 for _, s, _ in subs), "every subscriber serves the anchor", 120)
        for proxy in proxies.values():  # from here on: patch steps only
            proxy.bytes_sent, proxy.sent = 0, {}
        for step in range(1, steps + 1):
            reports = await pub.publish(step, trained[step], {"config.json": b'{"model_type": "t"}'})
            del reports
            await asyncio.sleep(args.step_seconds)
        await pub.flush()
        async for info in origin.list("patches/"):
            patch_bytes += info.size
    last = steps
    await until(lambda: all(s.step == last for _, s, _ in subs), f"every subscriber serves step {last}", 300)
    for mirror in mirrors:  # the lagging mirror's last copies are egress of these steps too
        await until_copied(mirror, last)
    seconds = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*tasks)
    egress = sum(proxy.bytes_sent for proxy in proxies.values())
    by_kind: dict[str, int] = {}
    for who, proxy in proxies.items():
        for where, sent in proxy.sent.items():
            kind = next((k for k in ("patches/", "anchors/", "ready", "pointer") if k in where), "other")
            kind = f"{who}: " + ("listings" if "?prefix=" in where else kind.rstrip("/"))
            by_kind[kind] = by_kind.get(kind, 0) + sent
    fallbacks = {"a": 0, "b": 0}
    for region, sub, _ in subs:
        if region:
            fallbacks[region] += sum(sum(s.fallbacks.values()) for s in sub.stores.sources[:-1])
    unverified = sum(r.unverified for _, _, r in subs)
    exact = all(s.state is not None and r.served and r.served[-1] == last for _, s, r in subs)
    for _, sub, _ in subs:
        await sub.close()
    for store in [origin, *regions.values()]:
        await store.close()
    for mirror in mirrors:
        await mirror.origin.store.close()
    for proxy in proxies.values():
        await proxy.stop()
    return {
        "subscribers": len(subs),
        "steps": steps,
        "seconds": seconds,
        "origin_egress_bytes": egress,
        "patch_bytes": patch_bytes,
        "egress_over_patch": egress / patch_bytes,
        "egress_by_kind": by_kind,
        "fallbacks": fallbacks,
        "fallbacks_per_step": sum(fallbacks.values()) / steps,
        "unverified_served": unverified + (0 if exact else 1),
        "lies": {str(k): v for k, v in lies.items()},
    }


async def until(condition: Any, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting until {what}")
        await asyncio.sleep(0.1)


async def until_copied(mirror: Mirror, step: int) -> None:
    deadline = time.monotonic() + 60
    while not await mirror.target.exists(layout.commit_key(step)):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {mirror.target.url} to copy step {step}")
        await asyncio.sleep(0.1)


def trained_states(steps: int, hidden: int, layers: int, lr: float) -> list[dict[str, torch.Tensor]]:
    trainer = real_like_trainer(hidden, layers, seed=0, lr=lr)
    states = [trainer.state()]
    for _ in range(steps):
        trainer.step()
        states.append(trainer.state())
    return states


async def measure(args: argparse.Namespace, baseline: bool = True) -> dict[str, Any]:
    """The mirrored run and (with `baseline`) the same run without mirrors, on three fresh SeaweedFS servers."""
    key = Ed25519PrivateKey.generate()
    trained = trained_states(args.steps, args.hidden, args.layers, args.lr)
    with tempfile.TemporaryDirectory(prefix="pulsesync-fanout-") as tmp, contextlib.ExitStack() as servers:
        endpoints = {}
        for name in ("origin", "a", "b"):
            (Path(tmp) / name).mkdir()
            endpoints[name] = servers.enter_context(seaweedfs_cluster(Path(tmp) / name)).endpoint
        mirrored = await scenario(endpoints=endpoints, key=key, trained=trained, args=args, mirrored=True)
        direct = (
            await scenario(endpoints=endpoints, key=key, trained=trained, args=args, mirrored=False)
            if baseline
            else None
        )
    state_bytes = sum(t.numel() * t.element_size() for t in trained[0].values())
    return {
        "mirrors": 2,
        "subscribers": args.subscribers,
        "steps": args.steps,
        "state_bytes": state_bytes,
        "patch_bytes_per_step": mirrored["patch_bytes"] / args.steps,
        "origin_egress_over_patch": mirrored["egress_over_patch"],
        "no_mirror_egress_over_patch": direct["egress_over_patch"] if direct else None,
        "fallbacks_per_step": mirrored["fallbacks_per_step"],
        "unverified_served": mirrored["unverified_served"] + (direct["unverified_served"] if direct else 0),
        "runs": {"mirrored": mirrored} | ({"no_mirror": direct} if direct else {}),
    }


def settings(quick: bool) -> argparse.Namespace:
    """The run's sizes: 30 subscribers and 60 steps quick (the baseline 10), else 60 and 120 (20)."""
    args = argparse.Namespace()
    args.subscribers, args.steps, args.baseline_steps = (30, 60, 10) if quick else (60, 120, 20)
    args.liar_region = 3 if quick else 6  # subscribers on the lying mirror; the rest on the lagging one
    args.lies = [15, 30, 45]  # swapped bytes, a stale object, a withheld marker
    args.lag, args.max_lag, args.step_seconds = 2.0, 15.0, 1.0
    args.hidden, args.layers, args.lr = 256, 4, 1e-5
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 subscribers, 60 steps: the automation contract")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="draw the results here (bench/plots.py)")
    options = parser.parse_args()
    args = settings(options.quick)
    result = asyncio.run(measure(args))
    mirrored, direct = result["runs"]["mirrored"], result["runs"]["no_mirror"]
    print(f"{'':28}{'2 mirrors':>14}{'no mirror':>14}")
    print(f"{'subscribers':28}{mirrored['subscribers']:>14}{direct['subscribers']:>14}")
    print(
        f"{'origin egress (MB)':28}{mirrored['origin_egress_bytes'] / 1e6:>14.1f}"
        f"{direct['origin_egress_bytes'] / 1e6:>14.1f}"
    )
    print(f"{'egress / patch bytes':28}{mirrored['egress_over_patch']:>14.2f}{direct['egress_over_patch']:>14.2f}")
    print(f"{'fallbacks (region a, b)':28}{tuple(mirrored['fallbacks'].values())!s:>14}{'-':>14}")
    print(f"{'unverified states served':28}{mirrored['unverified_served']:>14}{direct['unverified_served']:>14}")
    print(
        f"patch bytes per step: {result['patch_bytes_per_step'] / 1e3:.1f} kB "
        f"of a {result['state_bytes'] / 1e6:.1f} MB state"
    )
    print(
        f"{'origin egress by kind (MB)':28}"
        + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in mirrored["egress_by_kind"].items())
    )
    if options.json:
        options.json.write_text(json.dumps(result, indent=2))
    if options.plots:
        from plots import fanout

        for path in fanout(result, options.plots):
            print(path)
    enforce(
        [
            Contract("origin_egress_over_patch", result["origin_egress_over_patch"], result["mirrors"] + 0.5),
            Contract("unverified_served", result["unverified_served"], 0),
        ]
    )


if __name__ == "__main__":
    main()
