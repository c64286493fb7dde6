"""Subscriber fast path: seconds per GiB of state to apply one patch, and the speedup over a full download.

A synthetic bf16 model (AdamW at an RL learning rate; see pulsesync.synthetic) publishes an anchor
and then one patch per step into a filesystem store through the real publisher, on both codec
workloads: "synthetic" (fp32 master weights, mostly +-1 ULP moves) and "real-like" (calibrated on
a real fine-tune, bench/calibrate.py: heavy-tailed moves, history-coded patches). Every read the
subscriber makes goes through a token bucket that limits the transfer path to `--mbps` (400 Mb/s
by default, a typical per-host share of a cloud object store), so downloads cost what they would
over such a link. Measured in the same run:

  fast_path        Subscriber.sync() one step ahead: manifest, patch download (throttled), verify,
                   apply in place, state digest check; "excl. download" subtracts the seconds any
                   store read was in flight
  one GET after another
                   the same steps synced by a second subscriber without the read-ahead (its patch
                   GET waits for the verified marker; protocol/speculation.py): the two take turns
                   at each step. With --rtt-ms, every request first waits that long for its first
                   byte, as from a store across a network: the read-ahead saves one such wait
  full_download    downloading the anchor's safetensors shards (a full checkpoint) through the
                   same token bucket: the baseline a subscriber without patches pays every step

The contracts, on each workload: fast path (download excluded) <= 0.2 s per GiB of state
(the median step; the quick run's fastest step, its median moving with the machine's load);
full_download / fast_path (download included) >= 50x. A broken contract exits 1. Every step's state is checked bitwise
against the trainer's. The JSON's top-level fields are the synthetic workload's (as before);
`workloads` holds both, and `real_like_fast_path_s_per_gib` the real-like one's.

    python bench/subscriber.py                          # 0.8 GiB of state
    python bench/subscriber.py --quick --json out.json  # 0.15 GiB, < 60 s: the automation contract
    python bench/subscriber.py --numpy                  # without the numba kernels
    python bench/subscriber.py --quick --rtt-ms 20      # a store 20 ms away
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from contracts import Contract, enforce

from pulsesync import mixsum
from pulsesync.codec import batch, jit
from pulsesync.dtypes import dense_bytes
from pulsesync.protocol import signing
from pulsesync.protocol.manifest import AnchorManifest
from pulsesync.publisher import Publisher
from pulsesync.publisher.config import PublisherConfig
from pulsesync.store import FileStore, ObjectInfo, ProgressCallback, TransferResult
from pulsesync.subscriber import Subscriber
from pulsesync.subscriber.config import SubscriberConfig
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes, real_like_trainer

WORKLOADS = ("synthetic", "real-like")


def trainer_for(workload: str, hidden: int, layers: int) -> SyntheticTrainer:
    """The codec benchmark's workloads (bench/codec.py), at lr 1e-6."""
    if workload == "real-like":
        return real_like_trainer(hidden, layers, seed=0, lr=1e-6)
    return SyntheticTrainer(llm_like_shapes(hidden, layers, vocab=96 * hidden), lr=1e-6, seed=0)


class TokenBucket:
    """Bytes may pass at `rate` per second on average, in bursts of at most `burst` bytes."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.updated = float(burst), time.perf_counter()
        self.enabled = True

    async def take(self, n: int) -> None:
        """Wait until n bytes' worth of tokens have accumulated, then spend them."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate) - n
        self.updated = now
        if self.tokens < 0:  # in debt: the bytes finish arriving once the debt is paid
            await asyncio.sleep(-self.tokens / self.rate)


class ThrottledStore(FileStore):
    """A FileStore whose requests wait `latency` seconds for their first byte and whose reads pass a token
    bucket; `read_seconds` counts the time any read is in flight (overlapping reads once)."""

    def __init__(self, root: Path, bucket: TokenBucket, latency: float = 0.0) -> None:
        super().__init__(root)
        self.bucket, self.latency = bucket, latency
        self.read_seconds = 0.0
        self._in_flight, self._busy_since = 0, 0.0

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[None]:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1
        try:
            if self.bucket.enabled and self.latency:
                await asyncio.sleep(self.latency)
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.read_seconds += time.perf_counter() - self._busy_since

    async def get(self, key: str, max_size: int | None = None) -> bytes:
        async with self._reading():
            data = await super().get(key, max_size)
            await self.bucket.take(len(data))
        return data

    async def list(self, prefix: str = "", start_after: str | None = None) -> AsyncIterator[ObjectInfo]:
        async with self._reading():
            infos = [info async for info in super().list(prefix, start_after)]
        for info in infos:
            yield info

    async def download_file(
        self,
        key: str,
        path: Path,
        progress: ProgressCallback | None = None,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
    ) -> TransferResult:
        async with self._reading():
            done = await super().download_file(key, path, progress, expected_sha256, expected_size)
            await self.bucket.take(done.size)
        return done


def publish(root: Path, key: Ed25519PrivateKey, trainer: SyntheticTrainer, steps: int) -> list[dict[str, torch.Tensor]]:
    """Publish anchor 0 and patches 1..steps; returns the trainer's states."""
    for _ in range(12):  # past AdamW's unusually dense first updates
        trainer.step()
    states = []
    config = PublisherConfig(anchor_interval=10**6, on_backpressure="block")
    with Publisher(config, store=FileStore(root), signing_key=key) as publisher:
        for step in range(steps + 1):
            if step:
                trainer.step()
            states.append(trainer.state())
            publisher.publish(step, states[-1])
        publisher.flush()
    return states


async def measure(
    root: Path, key: Ed25519PrivateKey, states: list[dict[str, torch.Tensor]], mbps: float, rtt: float
) -> dict:
    batch.warm_up()  # what Subscriber.start() loads in the background: compiled before anything is timed
    mixsum.warm_up()
    store = ThrottledStore(root, TokenBucket(mbps * 1e6 / 8, burst=64 << 10), latency=rtt)
    trusted = signing.trusted_keys([key.public_key()])
    # The read-ahead's baseline in the same run: a second subscriber whose patch GET waits for its
    # verified marker. The two take turns at each step, first one, then the other.
    sub, one_by_one = (Subscriber(SubscriberConfig(), store=store, trusted=trusted) for _ in range(2))
    one_by_one.stores.chain.speculate = False
    store.bucket.enabled = False
    for s in (sub, one_by_one):
        await s.sync(0)  # cold start (slow path), not measured: no need to wait for its download
    store.bucket.enabled = True
    fast, fast_excl, patch_bytes, one_after_another = [], [], [], []
    for step in range(1, len(states)):
        for s in (sub, one_by_one) if step % 2 else (one_by_one, sub):
            read_before = store.read_seconds
            result = await s.sync(step)
            assert result.path == "fast", result
            assert s.state is not None
            for name, t in states[step].items():
                assert torch.equal(s.state[name].view(torch.int16), t.view(torch.int16)), (step, name)
            if s is one_by_one:
                one_after_another.append(result.seconds)
                continue
            fast.append(result.seconds)
            fast_excl.append(result.seconds - (store.read_seconds - read_before))
            patch_bytes.append(result.bytes_downloaded)
    store.bucket.enabled = False
    anchor = await sub.stores.chain.manifest(0, "anchor")
    assert isinstance(anchor, AnchorManifest)
    store.bucket.enabled = True
    shards = [ref for ref in anchor.objects if ref.key.endswith(".safetensors")]
    with tempfile.TemporaryDirectory(prefix="pulsesync-bench-full-") as spool:
        t0 = time.perf_counter()
        for ref in shards:
            await store.download_file(ref.key, Path(spool) / "shard", expected_sha256=ref.sha256)
        full_s = time.perf_counter() - t0
    for s in (sub, one_by_one):
        await s.close()
    gib = dense_bytes(states[0]) / 2**30
    fast_s, fast_excl_s = statistics.median(fast), statistics.median(fast_excl)
    return {
        "state_gib": gib,
        "steps": len(fast),
        "mbps": mbps,
        "patch_bytes": statistics.median(patch_bytes),
        "full_bytes": sum(ref.size for ref in shards),
        "rtt_ms": rtt * 1000,
        "fast_path_s": fast_s,
        "fast_path_one_get_after_another_s": statistics.median(one_after_another),
        "fast_path_excl_download_s": fast_excl_s,
        "fast_path_s_per_gib": fast_excl_s / gib,
        "fastest_step_s_per_gib": min(fast_excl) / gib,
        "full_download_s": full_s,
        # Named for the contract's link speed; with --mbps it is the speedup at that speed.
        "speedup_vs_full_400mbps": full_s / fast_s,
        "per_step": {
            "fast_path_s": fast,
            "fast_path_excl_download_s": fast_excl,
            "patch_bytes": patch_bytes,
            "fast_path_one_get_after_another_s": one_after_another,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="0.15 GiB of state (12 steps; the full run 8)")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="also write PNG plots there (matplotlib)")
    parser.add_argument("--hidden", type=int, help="model width (default 1536; quick 768)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; quick 4)")
    parser.add_argument("--steps", type=int, help="fast-path steps measured (default 8; quick 12)")
    parser.add_argument("--mbps", type=float, default=400.0, help="link speed in megabits per second")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="each request's wait for its first byte (default 0)")
    parser.add_argument("--numpy", action="store_true", help="without the numba kernels (as without pulsesync[fast])")
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both", help="codec workload(s) to run")
    args = parser.parse_args()
    jit.enabled = jit.enabled and not args.numpy
    hidden = args.hidden or (768 if args.quick else 1536)
    layers = args.layers or (4 if args.quick else 8)
    # The quick run's syncs are small and noisy (fixed costs weigh more): a median of 12 steadies it.
    steps = args.steps or (12 if args.quick else 8)
    key = Ed25519PrivateKey.generate()
    kernels = "numba kernels" if jit.enabled else "numpy path" if args.numpy else "numpy path (numba not installed)"
    results = {}
    contracts: list[Contract] = []
    for workload in WORKLOADS if args.workload == "both" else [args.workload]:
        with tempfile.TemporaryDirectory(prefix="pulsesync-bench-") as tmp:
            states = publish(Path(tmp), key, trainer_for(workload, hidden, layers), steps)
            r = results[workload] = asyncio.run(measure(Path(tmp), key, states, args.mbps, args.rtt_ms / 1000))
            del states  # 9 states of the full run: free them before the next workload's
        speedup = r["speedup_vs_full_400mbps"]
        print(
            f"\n[{workload}] {r['state_gib']:.2f} GiB of bf16 state, {r['steps']} fast-path steps, "
            f"link {args.mbps:g} Mb/s, first byte after {args.rtt_ms:g} ms, {kernels}"
        )
        print(f"{'measure':<36} {'seconds':>9} {'s/GiB':>7} {'MB':>9}")
        full = f"{r['full_download_s']:>9.3f} {'':>7} {r['full_bytes'] / 1e6:>9.1f}"
        print(f"{'full checkpoint download (baseline)':<36} {full}")
        print(f"{'fast path, download included':<36} {r['fast_path_s']:>9.3f} {'':>7} {r['patch_bytes'] / 1e6:>9.2f}")
        print(f"{'  the same, patch GET after marker':<36} {r['fast_path_one_get_after_another_s']:>9.3f}")
        print(
            f"{'fast path, download excluded':<36} {r['fast_path_excl_download_s']:>9.3f} "
            f"{r['fast_path_s_per_gib']:>7.3f} {'':>9}"
        )
        # The full run is judged on its median step. The quick run's 25 ms syncs move with this
        # shared VM's speed (a whole run measured 35% slower than the one before, patch for patch):
        # it is judged on its fastest step (timeit's convention), which a code regression still breaks.
        fast, statistic = (
            (r["fastest_step_s_per_gib"], "fastest step") if args.quick else (r["fast_path_s_per_gib"], "median")
        )
        contracts += [
            Contract(f"{workload} fast path s/GiB (download excluded, {statistic})", fast, 0.2),
            Contract(f"{workload} speedup over a full download", speedup, 50, at_most=False),
        ]
    out: dict[str, object] = {**results.get("synthetic", {}), "numba": jit.enabled, "workloads": results}
    if "real-like" in results:
        out["real_like_fast_path_s_per_gib"] = results["real-like"]["fast_path_s_per_gib"]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.plots:
        import plots

        print("\n".join(str(p) for p in plots.subscriber(out, args.plots)))
    enforce(contracts)


if __name__ == "__main__":
    main()
