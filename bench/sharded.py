"""Sharded publishing: the same model published from 1 rank (whole) and from N ranks (each its rows).

Each rank runs the real-like synthetic trainer (pulsesync.synthetic, calibrated on a real
fine-tune: docs/benchmarks.md) on its own rows of every tensor, an even dim-0 split as FSDP2's,
and publishes every step through `pulsesync.publisher.Publisher` (on several ranks, the sharded
publisher: each rank encodes and uploads its part, rank 0 commits). torchrun starts the ranks on
this machine (gloo, CPU); codec threads are 1 on every rank. Measured in the same run:

  step        per patch step, rank 0's wall time from publish() until flush() returns: the host copy,
              its part, the wait for every rank's part, the commit and the broadcast (on 1 rank: the
              host copy, digest, encode, upload and commit of the whole model); the median over a
              round's steps. Each rank publishes its states in ROUNDS rounds (a fresh publisher and
              store each); the fastest round's median is kept. Reported, not enforced: on a 2-vCPU
              VM the host's load moves it run to run (docs/benchmarks.md)
  phases      rank 0's step in its fastest round (medians): the host copy, its part, the gather + commit +
              broadcast, and the rest (the queue and the threads' hand-overs)
  overlap     per patch step, the time every rank was making its part (diff, encode, upload) over
              the shortest part: 1 when the parts are made in parallel, 0 when one waits for another;
              the median over every step of every round
  peak        each rank's peak resident memory while publishing one round (VmHWM, reset after the
              trainer's states are made and the codec's kernels compiled) over its shard's
              bytes, in a second run with MALLOC_MMAP_THRESHOLD_=131072 so freed buffers leave
              the resident set (glibc's default keeps some; its figure is printed beside)

  bytes/unsharded  per patch step, the bytes of the step's parts over the unsharded patch of the
              same states (the ranks' rows put together, coded here as a whole-model publisher
              codes them); `part_bytes_over_unsharded` in the JSON: 2 ranks, the worst step
  relaunch    the 2-rank job closed after step 2 and resumed (`resume`) on 2 ranks, and on 4 (another
              layout): the bytes the first step after it uploads over the same step uninterrupted, and
              what a subscriber holding step 2 reads for it and by which path

The parent then subscribes to every round's store of each world's first start, and to the relaunches'
stores, and checks every step bit for bit against the trainers' states, regenerated. Contracts (exit 1
when broken): bit-exact; per-rank peak <= 2.3x its shard; the 2 ranks' parts made at the same time
(overlap >= 0.5: what the speedup rests on, and unlike the speedup not moved by the host's load); the 2
ranks' parts <= 1.05x the unsharded patch's bytes, every step; the first step of the relaunch, on 2 ranks
and on 4, <= 1.05x its bytes uninterrupted; subscribers reach both on the fast path.

    python bench/sharded.py --quick --json out.json    # 94M parameters, 1 and 2 ranks (4 resuming), ~3.5 min
    python bench/sharded.py --ranks 1,2,4              # 0.2B parameters
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from contracts import Contract, enforce

from pulsesync.codec import CodecParams
from pulsesync.protocol import signing
from pulsesync.sharding import Rows
from pulsesync.synthetic import REAL_LIKE_NEAR_ZERO, REAL_LIKE_WEIGHT_STD, SyntheticTrainer, llm_like_shapes


def rows_of(shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """FSDP2's split of dim 0: ceil-sized chunks, the last ones shorter or empty."""
    size = -(-shape[0] // world)
    return min(shape[0], rank * size), min(shape[0], (rank + 1) * size)


def rank_trainer(shapes: dict[str, tuple[int, ...]], rank: int, world: int) -> SyntheticTrainer:
    """The real-like trainer of one rank's rows (seeded by rank: each rank's rows are its own)."""
    local = {}
    for name, shape in shapes.items():
        a, b = rows_of(shape, rank, world)
        if b > a:
            local[name] = (b - a, *shape[1:])
    return SyntheticTrainer(
        local,
        lr=1e-6,
        seed=rank,
        master_dtype=torch.bfloat16,
        weight_std=REAL_LIKE_WEIGHT_STD,
        near_zero_fraction=REAL_LIKE_NEAR_ZERO,
    )


def _rss(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def warm_up_codec() -> None:
    """Compile the encode and digest kernels (numba) on a small state, as a long-running publisher has."""
    from pulsesync import mixsum
    from pulsesync.codec import encode

    mixsum.warm_up()
    old = {"w": torch.randn(1 << 16).bfloat16()}
    new = {"w": old["w"].clone()}
    new["w"][::100] += 1
    encode(old, new, CodecParams(threads=1))


ROUNDS = 3  # publishing rounds per started world: a round costs ~2 s, starting a world ~15 s (its states)
RELAUNCH_AT = 2  # the relaunch round's first publisher commits steps 0..2; the relaunched one (resume) goes on
RESHARD_TO = 4  # the 2-rank job's steps 0..RELAUNCH_AT are also resumed on this many ranks (another layout)
RELAUNCH_BOUND = 1.05  # a relaunch's first step's bytes over the same step uninterrupted, on either layout


def relaunch(out: Path, config: Any, states: list[dict[str, torch.Tensor]], declared: dict[str, Any]) -> int:
    """Publish steps 0..RELAUNCH_AT, close, and publish the rest from a new publisher with `resume` (a relaunched
    job: its pieces rebuilt from the store); returns this rank's bytes uploaded for the first step after it.
    The store as the first publisher left it is copied to `reshard`, where RESHARD_TO ranks resume it."""
    import torch.distributed as dist

    from pulsesync.publisher import Publisher
    from pulsesync.store import FileStore

    store = FileStore(out / "relaunch")
    for steps, resume in ((range(RELAUNCH_AT + 1), False), (range(RELAUNCH_AT + 1, len(states)), True)):
        publisher = Publisher(config.model_copy(update={"resume": resume}), store=store, declared=declared)
        for step in steps:
            publisher.publish(step, dict(states[step]))
            publisher.flush()
        publisher.close()
        if not resume and dist.get_world_size() < RESHARD_TO:
            dist.barrier()
            if not dist.get_rank():
                shutil.copytree(out / "relaunch", out / "reshard")
            dist.barrier()
    (first,) = [r for r in publisher.reports if r.step == RELAUNCH_AT + 1]
    assert first.kind == "patch" and first.ok, first
    return first.wire_bytes


def publisher_config(out: Path, resume: bool = False) -> Any:
    """Every rank's publisher settings: no anchor after the first, one codec thread."""
    from pulsesync.publisher import PublisherConfig

    return PublisherConfig(
        signing_key=out / "key" / "publisher.key",
        anchor_interval=1000,
        on_backpressure="block",
        codec=CodecParams(threads=1),
        resume=resume,
    )


def reshard_worker(out: Path, hidden: int, layers: int, from_world: int) -> None:
    """One rank of a relaunch on another world size: the `from_world`-rank job's state at step RELAUNCH_AT + 1,
    this rank's rows of it, published with `resume` into the `reshard` store that job left at RELAUNCH_AT."""
    import torch.distributed as dist

    from pulsesync.publisher import Publisher
    from pulsesync.store import FileStore

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = llm_like_shapes(hidden, layers, vocab=96 * hidden)
    trainers = [rank_trainer(shapes, r, from_world) for r in range(from_world)]
    for trainer in trainers:
        for _ in range(RELAUNCH_AT + 1):
            trainer.step()
    parts = [trainer.state() for trainer in trainers]
    del trainers
    state, declared = {}, {}
    for name, shape in shapes.items():
        a, b = rows_of(shape, rank, world)
        declared[name] = Rows(a, b, shape) if b > a else None
        if b > a:
            state[name] = torch.cat([part[name] for part in parts if name in part])[a:b].clone()
    del parts
    publisher = Publisher(publisher_config(out, resume=True), store=FileStore(out / "reshard"), declared=declared)
    publisher.publish(RELAUNCH_AT + 1, state)
    publisher.flush()
    publisher.close()
    (first,) = [r for r in publisher.reports if r.step == RELAUNCH_AT + 1]
    assert first.kind == "patch" and first.ok, first
    (out / f"reshard-rank-{rank}.json").write_text(json.dumps({"part_bytes": first.wire_bytes}))
    dist.destroy_process_group()


def worker(out: Path, hidden: int, layers: int, steps: int, rounds: int) -> None:
    """One rank: make its states, then publish them all `rounds` times, timing the pipeline and the peak memory."""
    import torch.distributed as dist

    from pulsesync.publisher import Publisher
    from pulsesync.store import FileStore

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = llm_like_shapes(hidden, layers, vocab=96 * hidden)
    trainer = rank_trainer(shapes, rank, world)
    states = [trainer.state()]
    for _ in range(steps):
        trainer.step()
        states.append(trainer.state())
    del trainer
    declared = {}
    for name, shape in shapes.items():
        a, b = rows_of(shape, rank, world)
        declared[name] = Rows(a, b, shape) if b > a else None
    shard = sum(t.numel() * t.element_size() for t in states[0].values())
    config = publisher_config(out)
    warm_up_codec()  # one-time costs (kernel compilation) are not the publisher's memory per shard
    # Hand the trainer's freed memory back first, so the publisher's copies show in the resident size
    # instead of reusing it unseen; then the peak so far is the trainer's: start counting here.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss("VmRSS")
    step_s, phases, parts, sizes, peak = [], [], [], [], 0
    for r in range(rounds):
        store = FileStore(out / f"store-{r}")
        publisher = Publisher(config, store=store, declared=declared if world > 1 else None)
        took = []
        for step, state in enumerate(states):
            t0 = time.perf_counter()
            publisher.publish(step, {n: state[n] for n in state})
            publisher.flush()
            took.append(time.perf_counter() - t0)
        publisher.close()
        patches = [p for p in publisher.reports if p.kind == "patch" and p.ok]
        step_s.append(took[1:])  # the patch steps: step 0 is the anchor
        phases.append([(p.snapshot_s, p.encode_s, p.commit_s) for p in patches])
        parts.append([(p.started, p.encode_s) for p in patches])
        sizes = [p.wire_bytes for p in patches]
        del publisher
        if not r:  # the peak of one round: later rounds' publishers reuse (or add to) the freed heap
            peak = _rss("VmHWM") - before
    result = {
        "rank": rank,
        "world": world,
        "shard_bytes": shard,
        "peak_bytes": peak,
        "step_s": step_s,  # per round, per patch step: publish() until flush() returns
        "phases": phases,  # per round, per patch step: (host copy, its part, gather + commit + broadcast) seconds
        "parts": parts,  # per round, per patch step: (wall-clock start, seconds) of making this rank's objects
        "part_bytes": sizes,  # per patch step: this rank's part
        # A relaunch on as many ranks (the timed run only): this rank's part of the first step after it.
        "relaunch_part_bytes": relaunch(out, config, states, declared) if world > 1 and rounds > 1 else None,
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def torchrun(world: int, out: Path, args: list[str], env: dict[str, str]) -> None:
    """Run this script's workers on `world` ranks into `out`."""
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(world), __file__, "--worker", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"} | env)
    if done.returncode:
        sys.exit(f"{world} ranks failed:\n{(done.stdout + done.stderr)[-4000:]}")


def start_world(
    world: int, out: Path, hidden: int, layers: int, steps: int, rounds: int, env: dict[str, str]
) -> list[dict[str, Any]]:
    """Publish on `world` ranks into a new `out` (its own key); returns each rank's results."""
    out.mkdir(parents=True)
    signing.write_keypair(out / "key")
    sizes = ["--hidden", str(hidden), "--layers", str(layers), "--steps", str(steps), "--rounds", str(rounds)]
    torchrun(world, out, sizes, env)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def run(world: int, out: Path, hidden: int, layers: int, steps: int) -> dict[str, Any]:
    """Time `world` ranks (glibc's default allocator) and check every step; measure memory in a second run.

    The memory run fixes glibc's mmap threshold, so buffers over 128 KiB return to the system as
    they are freed: the default raises the threshold after the first large free, and the freed
    encode temporaries then stay resident (2.4-2.5x a shard, docs/benchmarks.md). Timing runs keep
    the default: the fixed threshold's page faults slow the whole-model baseline 2x.
    """
    timed = start_world(world, out / "timed", hidden, layers, steps, ROUNDS, {})
    resharded = 1 < world < RESHARD_TO  # a sharded job (relaunch() left its store) resumed on RESHARD_TO ranks
    if resharded:
        sizes = ["--hidden", str(hidden), "--layers", str(layers), "--reshard-from", str(world)]
        torchrun(RESHARD_TO, out / "timed", sizes, {})
    exact, over_unsharded, relaunch_reads = asyncio.run(check(out / "timed", hidden, layers, steps, world))
    sized = start_world(world, out / "sized", hidden, layers, 3, 1, {"MALLOC_MMAP_THRESHOLD_": "131072"})
    default_peak = max(r["peak_bytes"] / r["shard_bytes"] for r in timed)
    peak = max(r["peak_bytes"] / r["shard_bytes"] for r in sized)
    params = sum(torch.Size(s).numel() for s in llm_like_shapes(hidden, layers, vocab=96 * hidden).values())
    relaunches = {}
    if world > 1:  # the first step after a relaunch, on as many ranks and on RESHARD_TO, against it uninterrupted
        uninterrupted = sum(r["part_bytes"][RELAUNCH_AT] for r in timed)
        uploaded = {"relaunch": sum(r["relaunch_part_bytes"] for r in timed)}
        if resharded:
            reshard = (json.loads((out / "timed" / f"reshard-rank-{r}.json").read_text()) for r in range(RESHARD_TO))
            uploaded["reshard"] = sum(r["part_bytes"] for r in reshard)
        for name, sent in uploaded.items():
            path, read = relaunch_reads[name]
            relaunches[name] = {"bytes": sent, "uninterrupted_bytes": uninterrupted, "subscriber_path": path}
            relaunches[name] |= {"subscriber_bytes_read": read, "over_uninterrupted": sent / uninterrupted}
    return {
        "world": world,
        "parameters": params,
        "step_s_rounds": [statistics.median(steps) for steps in timed[0]["step_s"]],
        "step_s": min(statistics.median(steps) for steps in timed[0]["step_s"]),
        "phases_s": step_phases(timed[0]),
        "parts_overlap": parts_overlap(timed) if world > 1 else None,
        "peak_over_shard": peak,
        "peak_over_shard_default_malloc": default_peak,
        "bit_exact": exact,
        "part_bytes_over_unsharded_steps": over_unsharded,
        "relaunch": relaunches.get("relaunch"),
        "reshard": relaunches.get("reshard"),
    }


def step_phases(rank: dict[str, Any]) -> dict[str, float]:
    """Where rank 0's patch step went, in its fastest round (medians over the round's steps): the host copy,
    making its part (diff, encode, upload), the collectives and the commit, and the rest of the step."""
    fastest = min(range(len(rank["step_s"])), key=lambda r: statistics.median(rank["step_s"][r]))
    copy, part, commit = (statistics.median(p[i] for p in rank["phases"][fastest]) for i in range(3))
    rest = statistics.median(rank["step_s"][fastest]) - copy - part - commit
    return {"host_copy": copy, "part": part, "gather_commit": commit, "rest": rest}


def parts_overlap(ranks: list[dict[str, Any]]) -> float:
    """How much of the ranks' parts of a patch step were made at the same time, the median over every step of
    every round: per step, the time all ranks were making their parts over the shortest part (1: fully in
    parallel, 0: one after another)."""
    overlaps = []
    for r, steps in enumerate(ranks[0]["parts"]):
        for i in range(len(steps)):
            spans = [rank["parts"][r][i] for rank in ranks]
            common = min(s + d for s, d in spans) - max(s for s, _ in spans)
            overlaps.append(max(0.0, common) / max(min(d for _, d in spans), 1e-9))
    return statistics.median(overlaps)


async def check(
    out: Path, hidden: int, layers: int, steps: int, world: int
) -> tuple[bool, list[float], dict[str, tuple[str, int]]]:
    """Every step a subscriber of each store serves equals the ranks' states put together, bit for bit (each
    round's store, and the relaunches' up to their last step); per patch step, the bytes of its parts over those
    of the unsharded patch of the same states (encoded here as a whole-model publisher codes it: against the step
    before's history, the first after the anchor without); and per relaunch, the path a subscriber holding step
    RELAUNCH_AT takes to the first step after it and the bytes it reads for it (its marker and objects)."""
    from pulsesync.codec import PatchHistory, encode
    from pulsesync.protocol.manifest import PatchManifest
    from pulsesync.store import FileStore
    from pulsesync.subscriber import Subscriber
    from pulsesync.subscriber.config import SubscriberConfig

    shapes = llm_like_shapes(hidden, layers, vocab=96 * hidden)
    trainers = [rank_trainer(shapes, r, world) for r in range(world)]
    trusted = signing.trusted_keys([out / "key" / "publisher.pub"])

    def subscriber(store: Path) -> Subscriber:
        return Subscriber(SubscriberConfig(), store=FileStore(store), trusted=trusted)

    subs = {store.name: subscriber(store) for store in sorted(out.glob("store-*"))}
    relaunches = {name: subscriber(out / name) for name in ("relaunch", "reshard") if (out / name).is_dir()}
    last = {"reshard": RELAUNCH_AT + 1}  # the others go on to the last step
    exact, over_unsharded, reads = True, [], {}
    before: dict[str, torch.Tensor] = {}
    reference: PatchHistory | None = None
    for step in range(steps + 1):
        if step:
            for t in trainers:
                t.step()
        parts = [t.state() for t in trainers]
        whole = {n: torch.cat([p[n] for p in parts if n in p]) for n in shapes}
        for name, sub in (subs | relaunches).items():
            if step > last.get(name, steps):
                continue
            read = sub.stores.chain.fetcher.bytes_downloaded
            synced = await sub.sync(step)
            if step == RELAUNCH_AT + 1 and name in relaunches:
                reads[name] = synced.path.value, sub.stores.chain.fetcher.bytes_downloaded - read
            assert sub.state is not None
            exact &= all(torch.equal(sub.state[n].view(torch.int16), whole[n].view(torch.int16)) for n in shapes)
        if step:
            unsharded = encode(before, whole, CodecParams(threads=1), reference=reference)
            reference = unsharded.history
            manifest = await subs["store-0"].stores.chain.manifest(step, "patch")
            assert isinstance(manifest, PatchManifest)
            over_unsharded.append(sum(ref.size for ref in manifest.objects) / len(unsharded.data))
        before = whole
    for sub in (subs | relaunches).values():
        await sub.close()
    return exact, over_unsharded, reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="94M parameters, 1 and 2 ranks (CI)")
    parser.add_argument("--ranks", default="1,2", help="world sizes to run, comma-separated (1 is the baseline)")
    parser.add_argument("--hidden", type=int, help="model width (default 1024; quick 768)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; quick 6)")
    parser.add_argument("--steps", type=int, help="patch steps after the anchor (default 8; quick 6)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write results as JSON")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="also write PNG plots there (matplotlib)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=argparse.SUPPRESS)
    parser.add_argument("--reshard-from", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    hidden = args.hidden or (768 if args.quick else 1024)
    layers = args.layers or (6 if args.quick else 8)
    steps = args.steps or (6 if args.quick else 8)
    if args.worker is not None:
        if args.reshard_from:
            return reshard_worker(args.worker, hidden, layers, args.reshard_from)
        return worker(args.worker, hidden, layers, steps, args.rounds)
    worlds = [int(w) for w in args.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="pulsesync-bench-sharded-") as tmp:
        runs = {w: run(w, Path(tmp) / f"world-{w}", hidden, layers, steps) for w in worlds}
    base = runs[1]["step_s"]
    print(f"{runs[1]['parameters'] / 1e6:.0f}M parameters bf16, {steps} patch steps, codec threads 1 per rank")
    header = f"{'ranks':>5} {'step s':>8} {'speedup':>8} {'overlap':>8} {'peak/shard':>11} {'(default malloc)':>17}"
    print(f"{header} {'bytes/unsharded':>16} {'bit-exact':>10}")
    for w, r in runs.items():
        speedup, peak, exact = base / r["step_s"], r["peak_over_shard"], r["bit_exact"]
        default, overlap = r["peak_over_shard_default_malloc"], r["parts_overlap"]
        over = max(r["part_bytes_over_unsharded_steps"])
        row = f"{w:>5} {r['step_s']:>8.4f} {speedup:>7.2f}x {'' if overlap is None else f'{overlap:.2f}':>8}"
        print(f"{row} {peak:>10.2f}x {default:>16.2f}x {over:>15.3f}x {exact!s:>10}")
    print(f"\nrank 0's step, ms: {'ranks':>5} {'host copy':>10} {'part':>8} {'gather+commit':>14} {'rest':>7}")
    for w, r in runs.items():
        copy, part, commit, rest = (v * 1000 for v in r["phases_s"].values())
        print(f"{'':>18} {w:>5} {copy:>10.1f} {part:>8.1f} {commit:>14.1f} {rest:>7.1f}")
    two = runs.get(2)
    result: dict[str, Any] = {
        "bit_exact": all(r["bit_exact"] for r in runs.values()),
        "per_rank_peak_over_shard": max(r["peak_over_shard"] for w, r in runs.items() if w > 1),
        "publish_speedup_2_ranks": base / two["step_s"] if two else None,
        "parts_overlap_2_ranks": two["parts_overlap"] if two else None,
        # The 2-rank patches' bytes over an unsharded publish of the same states, the worst step.
        "part_bytes_over_unsharded": max(two["part_bytes_over_unsharded_steps"]) if two else None,
        # A relaunch on 2 ranks (resume): the bytes its first step uploads over the same step uninterrupted.
        "relaunch_bytes_over_uninterrupted": two["relaunch"]["over_uninterrupted"] if two else None,
        "relaunch_subscriber_bytes_read": two["relaunch"]["subscriber_bytes_read"] if two else None,
        # The same job resumed on RESHARD_TO ranks (another layout): its first step's bytes over it uninterrupted.
        "reshard_bytes_over_uninterrupted": two["reshard"]["over_uninterrupted"] if two else None,
        "reshard_subscriber_bytes_read": two["reshard"]["subscriber_bytes_read"] if two else None,
        "runs": {str(w): r for w, r in runs.items()},
        "quick": args.quick,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plots:
        import plots

        print("\n".join(str(p) for p in plots.sharded(result, args.plots)))
    contracts = [
        Contract("bit-exact (1 = every step of every run)", float(result["bit_exact"]), 1, at_most=False),
        Contract("per-rank peak / shard", result["per_rank_peak_over_shard"], 2.3),
    ]
    if two:
        overlap = result["parts_overlap_2_ranks"]
        contracts.append(Contract("2 ranks' parts made at the same time (overlap)", overlap, 0.5, at_most=False))
        over = result["part_bytes_over_unsharded"]
        contracts.append(Contract("2-rank part bytes / unsharded, worst step", over, 1.05))
        for name, ranks in (("relaunch", 2), ("reshard", RESHARD_TO)):
            relaunched = two[name]
            print(
                f"relaunch on {ranks} ranks (resume): step {RELAUNCH_AT + 1} uploads {relaunched['bytes']:,} bytes, "
                f"uninterrupted {relaunched['uninterrupted_bytes']:,} ({relaunched['over_uninterrupted']:.3f}x); "
                f"a subscriber holding step {RELAUNCH_AT} reads {relaunched['subscriber_bytes_read']:,} bytes "
                f"({relaunched['subscriber_path']} path)"
            )
            fast = float(relaunched["subscriber_path"] == "fast")
            contracts.append(Contract(f"{name}: subscribers' path to its first step is fast (1)", fast, 1, False))
        over = result["relaunch_bytes_over_uninterrupted"]
        contracts.append(Contract("relaunch: first step's bytes / uninterrupted", over, RELAUNCH_BOUND))
        over = result["reshard_bytes_over_uninterrupted"]
        label = f"reshard to {RESHARD_TO} ranks: first step's bytes / uninterrupted"
        contracts.append(Contract(label, over, RELAUNCH_BOUND))
    enforce(contracts)


if __name__ == "__main__":
    main()
