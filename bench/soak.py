"""Soak: one publisher, three subscriber daemons and retention on SeaweedFS behind the fault proxy, for N minutes.

    python bench/soak.py --minutes 30 --json soak.json

A real SeaweedFS S3 gateway serves the prefix. The publisher writes to it directly; the three
subscriber daemons (`fast`, a `late` joiner, and `restarted`, stopped and started again from its
cache half way) and a retention worker (grace 0) reach it through the fault proxy, which injects a
random mix of every fault the tests inject one by one: 5xx storms, resets, truncated and trickling
bodies, an endpoint that stops answering, outages, oversized bodies. Beside them an adversary
writes into the store: stray keys under ready/, markers forged far in the future (copied,
malformed, unsigned), forged tombstones, and patches overwritten with junk.

The `fast` subscriber feeds a vLLM stand-in (pulsesync's real worker extension on a module) and a
directory sink. Asserted: no sink ever received a state whose digest differs from the publisher's
for that step; once faults stop, every subscriber reaches the newest step within a bound; no
daemon exited. Prints a table and writes JSON. `pytest -m soak` runs it for SOAK_MINUTES (2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsesync.digest import state_digest
from pulsesync.protocol import layout, signing
from pulsesync.publisher import AsyncPublisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.retention import RetentionWorker
from pulsesync.retention.policy import RetentionPolicy
from pulsesync.sinks import Sink, Update
from pulsesync.sinks.directory import DirectorySink, DirectorySinkConfig, recorded
from pulsesync.sinks.vllm.sidecar.sink import VLLMSink, VLLMSinkConfig
from pulsesync.store import RetryPolicy, S3Store
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes
from tests.support.fault_proxy import FaultProxy
from tests.support.servers import BUCKET, seaweedfs_server
from tests.support.vllm_standin import VLLMStandIn, module_holding

CONVERGE_SECONDS = 90.0  # after the faults stop, every subscriber serves the newest step within this
STEP_SECONDS = 0.25  # the trainer's pace
ANCHOR_INTERVAL = 10


def _published_marker(key: str) -> bool:
    step = layout.parse_anchor_ready_key(key)
    entry = layout.parse_ready_key(key)
    step = entry.step if entry is not None else step
    return step is not None and step < layout.MAX_STEP - 1000


class DigestCheck(Sink):
    """Fails the soak if a delivered state's digest is not the publisher's for that step."""

    name = "check"

    def __init__(self, published: dict[int, str], who: str, violations: list[str]) -> None:
        self.published, self.who, self.violations = published, who, violations
        self.delivered = 0

    async def deliver(self, update: Update) -> None:
        expected = self.published.get(update.step)
        actual = state_digest(update.state, update.digest.algorithm).root  # rehash: trust nothing
        if actual != expected or update.digest.root != expected:
            self.violations.append(f"{self.who}: step {update.step} delivered {actual}, published {expected}")
        self.delivered += 1


@dataclass
class Daemon:
    name: str
    sub: Subscriber
    task: asyncio.Task[None]
    stop: asyncio.Event


@dataclass
class Soak:
    minutes: float
    workdir: Path
    seed: int = 0
    published: dict[int, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    exited: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    daemons: dict[str, Daemon] = field(default_factory=dict)
    checks: dict[str, DigestCheck] = field(default_factory=dict)

    async def run(self, endpoint: str) -> dict[str, Any]:
        rng = random.Random(self.seed)

        prefix = f"soak-{uuid.uuid4().hex[:8]}"
        self.proxy = FaultProxy(endpoint)
        await self.proxy.start()
        key = Ed25519PrivateKey.generate()
        self.trusted = signing.trusted_keys([key.public_key()])
        self.direct = S3Store(BUCKET, prefix, endpoint_url=endpoint)
        policy = RetryPolicy(attempts=3, initial_wait=0.05, max_wait=0.5, attempt_timeout=3.0, max_total=8.0)
        self.faulty = lambda: S3Store(BUCKET, prefix, endpoint_url=self.proxy.endpoint, retry=policy)
        trainer = SyntheticTrainer(llm_like_shapes(hidden=64, layers=2, vocab=96 * 64), lr=1e-5, seed=self.seed)
        self.standin = VLLMStandIn(module_holding(trainer.state()))
        await self.standin.start()
        pub = AsyncPublisher(
            PublisherConfig(anchor_interval=ANCHOR_INTERVAL, on_backpressure="block"),
            store=self.direct,
            signing_key=key,
        )
        await pub.start()
        retention = RetentionWorker(
            self.faulty(), RetentionPolicy(keep_patches=5, keep_anchors=1, grace_seconds=0), self.trusted
        )
        step = 0

        async def publish_one() -> None:
            nonlocal step
            if step:
                trainer.step()
            state = trainer.state()
            self.published[step] = state_digest(state).root
            await pub.publish(step, state, {"config.json": b'{"model_type": "soak"}'})
            step += 1

        await publish_one()
        await pub.flush()
        self._start("fast", extra_sinks=self._engine_sinks())
        end = time.monotonic() + self.minutes * 60
        started = time.monotonic()
        faults = asyncio.create_task(self._inject(rng, prefix, end))
        late_at, restart_at = started + self.minutes * 20, started + self.minutes * 30
        restarted_started = False
        while time.monotonic() < end:
            await publish_one()
            if step % 4 == 0:
                with contextlib.suppress(Exception):  # a failed run is retried at the next
                    await retention.run_once()
            if "late" not in self.daemons and time.monotonic() > late_at:
                self._start("late")
            if not restarted_started and time.monotonic() > started + 5:
                self._start("restarted")
                restarted_started = True
            if restart_at and time.monotonic() > restart_at:
                await self._restart("restarted")
                restart_at = 0.0
            self._watch()
            await asyncio.sleep(STEP_SECONDS)
        await faults
        self._calm()
        if "late" not in self.daemons:
            self._start("late")
        # Faults over: publish up to the next anchor and two patches past it, then everyone converges.
        while step % ANCHOR_INTERVAL != 3:
            await publish_one()
        await pub.flush()
        newest = step - 1
        t0 = time.monotonic()
        converged: dict[str, float] = {}
        while len(converged) < len(self.daemons) and time.monotonic() - t0 < CONVERGE_SECONDS:
            self._watch()
            for name, d in self.daemons.items():
                if name not in converged and d.sub.step == newest:
                    converged[name] = time.monotonic() - t0
            await asyncio.sleep(0.1)
        self._watch()
        for d in self.daemons.values():
            d.stop.set()
        for d in self.daemons.values():
            with contextlib.suppress(Exception):
                await d.task
        await pub.close()
        await retention.store.close()
        for d in self.daemons.values():
            await d.sub.close()
        self._check_engine_and_directory(newest)
        await self.standin.stop()
        await self.proxy.stop()
        await self.direct.close()
        return self._report(newest, converged)

    def _engine_sinks(self) -> list[Sink]:
        vllm = VLLMSink(VLLMSinkConfig(url=self.standin.url, update_dir=self.workdir / "updates", timeout_seconds=30))
        return [DirectorySink(DirectorySinkConfig(out_dir=self.workdir / "served", keep=2)), vllm]

    def _start(self, name: str, extra_sinks: list[Sink] | None = None) -> None:
        check = self.checks.setdefault(name, DigestCheck(self.published, name, self.violations))
        config = SubscriberConfig(
            poll_seconds=0.1,
            retry_initial_seconds=0.05,
            retry_max_seconds=1.0,
            sync_deadline_seconds=30.0,
            cache_dir=self.workdir / f"cache-{name}" if name == "restarted" else None,
        )
        sub = Subscriber(config, store=self.faulty(), trusted=self.trusted, sinks=[*(extra_sinks or []), check])
        stop = asyncio.Event()
        self.daemons[name] = Daemon(name, sub, asyncio.create_task(sub.run(stop)), stop)

    async def _restart(self, name: str) -> None:
        old = self.daemons[name]
        old.stop.set()
        await old.task
        await old.sub.close()
        self._start(name)
        self.faults["subscriber restart"] += 1

    def _watch(self) -> None:
        for name, d in self.daemons.items():
            if d.task.done() and not d.stop.is_set() and name not in self.exited:
                self.exited.append(f"{name}: {d.task.exception()!r}")

    def _calm(self) -> None:
        self.proxy.schedule.clear()
        self.proxy.down = self.proxy.hang = False
        self.proxy.trickle_seconds = None
        self.proxy.oversize.clear()

    async def _inject(self, rng: random.Random, prefix: str, end: float) -> None:
        """Every ~2 s, one fault: a network fault at the proxy for a moment, or an object an adversary writes."""
        kinds = [
            "5xx storm", "resets", "truncated bodies", "trickling bodies", "silent endpoint", "outage",
            "oversized bodies", "stray ready key", "far-future copied marker", "malformed marker",
            "unsigned marker", "forged tombstone", "junk patch",
        ]  # fmt: skip
        while time.monotonic() < end - 5:
            kind = rng.choice(kinds)
            self.faults[kind] += 1
            try:
                await self._one_fault(kind, rng)
            except Exception as e:  # the adversary's own write failing is no finding
                self.faults[f"{kind} (not injected: {type(e).__name__})"] += 1
            self._calm()
            await asyncio.sleep(rng.uniform(0.5, 2.0))

    async def _one_fault(self, kind: str, rng: random.Random) -> None:
        p, store = self.proxy, self.direct
        moment = rng.uniform(1.0, 4.0)
        if kind in ("5xx storm", "resets", "truncated bodies"):
            action = {"5xx storm": ["500", "503"], "resets": ["reset"], "truncated bodies": ["truncate"]}[kind]
            p.schedule[:] = [rng.choice(action) if rng.random() < 0.6 else "ok" for _ in range(40)]
            await asyncio.sleep(moment)
        elif kind == "trickling bodies":
            p.trickle_seconds = 1.0
            await asyncio.sleep(moment)
        elif kind == "silent endpoint":
            p.hang = True
            await asyncio.sleep(moment)
        elif kind == "outage":
            p.down = True
            await asyncio.sleep(moment)
        elif kind == "oversized bodies":
            p.oversize[".bin"] = 256 << 20
            await asyncio.sleep(moment)
        else:
            # Templates are the publisher's own markers, not the adversary's earlier far-future junk.
            ready = sorted([k.key async for k in store.list(layout.READY_PREFIX) if _published_marker(k.key)])
            far = layout.MAX_STEP - rng.randrange(1000)
            if kind == "stray ready key":
                await store.put(rng.choice(["ready/notes.txt", "ready/_SUCCESS", "ready/zzz.json"]), b"x")
            elif kind == "far-future copied marker" and ready:
                await store.put(layout.commit_key(far), await store.get(rng.choice(ready)))
            elif kind == "malformed marker":
                body = rng.choice([b"[" * 50_000, b'{"format_version": 1, "step": NaN}', b"\xff" * 100])
                await store.put(rng.choice([layout.commit_key(far), layout.anchor_ready_key(far)]), body)
            elif kind == "unsigned marker" and ready:
                doc = json.loads(await store.get(ready[-1]))
                doc["signature"] = ""
                await store.put(layout.commit_key(far), json.dumps(doc).encode())
            elif kind == "forged tombstone":
                anchors = [k.key async for k in store.list(layout.ANCHOR_READY_PREFIX) if _published_marker(k.key)]
                if anchors:
                    newest = await store.get(anchors[-1])
                    stone = {"marker": newest.decode(), "removed_at": "2000-01-01T00:00:00+00:00"}
                    await store.put(layout.tombstone_key(rng.randrange(10**6), "anchor"), json.dumps(stone).encode())
            elif kind == "junk patch":
                patches = [k.key async for k in store.list("patches/")]
                if len(patches) > 3:
                    await store.put(rng.choice(patches[:-2]), rng.randbytes(rng.choice([10, 4096, 1 << 20])))

    def _check_engine_and_directory(self, newest: int) -> None:
        for step, digest in self.standin.held_digests:
            if self.published.get(step) != digest:
                self.violations.append(f"vLLM stand-in: holds {digest} after step {step}, not the published one")
        current = recorded(self.workdir / "served" / "current")
        if current is not None and self.published.get(current["step"]) != current["digest"]:
            self.violations.append(f"directory sink: current is {current}, not the published digest")

    def _report(self, newest: int, converged: dict[str, float]) -> dict[str, Any]:
        subscribers = {
            name: {
                "step": d.sub.step,
                "converged_s": round(converged[name], 2) if name in converged else None,
                "delivered": self.checks[name].delivered,
                "paths": dict(d.sub.status.paths),
                "fallbacks": dict(d.sub.status.fallbacks),
                "rejected_markers": d.sub.status.rejected_markers,
            }
            for name, d in self.daemons.items()
        }
        return {
            "minutes": self.minutes,
            "steps_published": newest + 1,
            "faults": dict(sorted(self.faults.items())),
            "subscribers": subscribers,
            "engine_updates": len(self.standin.held_digests),
            "violations": self.violations,
            "exited": self.exited,
            "ok": not self.violations and not self.exited and len(converged) == len(self.daemons),
        }


def run_soak(minutes: float, workdir: Path, seed: int = 0) -> dict[str, Any]:
    """Run a soak of `minutes` on a fresh SeaweedFS in workdir; returns the report (see `ok`)."""
    (workdir / "weed").mkdir(parents=True, exist_ok=True)
    with seaweedfs_server(workdir / "weed") as endpoint:
        return asyncio.run(Soak(minutes, workdir, seed).run(endpoint))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # thousands of expected retries and failed syncs; the table says it
    with tempfile.TemporaryDirectory(prefix="pulsesync-soak-") as tmp:
        report = run_soak(args.minutes, Path(tmp), args.seed)
    print(f"soak: {report['minutes']} min, {report['steps_published']} steps published")
    print(f"{'fault':40} {'times':>6}")
    for kind, n in report["faults"].items():
        print(f"{kind:40} {n:>6}")
    print(f"\n{'subscriber':12} {'step':>6} {'converged s':>12} {'delivered':>10} {'rejected':>9}  paths / fallbacks")
    for name, s in report["subscribers"].items():
        print(
            f"{name:12} {s['step']:>6} {s['converged_s']!s:>12} {s['delivered']:>10} {s['rejected_markers']:>9}  "
            f"{s['paths']} / {s['fallbacks']}"
        )
    print(f"\nviolations: {report['violations'] or 'none'}; daemons exited: {report['exited'] or 'none'}")
    print("OK" if report["ok"] else "FAILED")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
