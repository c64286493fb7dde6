"""verl's weight sync: pulsesync's checkpoint engine against verl's own backends, same weights, same steps.

One actor (`PulseSyncCheckpointEngine.send_weights`, what verl's actor worker calls) publishes each
step of a real-like trainer into a store; one rollout worker (`receive_weights`, what verl's
CheckpointEngineWorker calls) reaches it and applies the `delta_flush` flushes it yields to a copy
of the weights, checked bit for bit against the trainer's every step. Two workloads: the real-like
synthetic trainer (pulsesync.synthetic, calibrated on real fine-tunes: docs/benchmarks.md) at an
RL learning rate (1e-6) and at a supervised one (1e-5). Per patch step, in the same run:

  pulsesync        bytes the step put in the store (its patch): what crosses clusters or regions
  delta_sharded    what verl's DeltaShardedCheckpointEngine sends for the same step: int32 positions
                   and values, 4 + itemsize bytes per changed element (verl/checkpoint_engine/
                   delta_sync/encode.py, `DeltaFlush.wire_bytes`), to every rollout worker
  nccl             what verl's NCCLCheckpointEngine sends: every tensor whole, to every rollout worker
  to_held          seconds from send_weights returning to the rollout worker holding the step
                   verified and its adapter having taken every flush (median over patch steps)

and what one step costs to sync a region of R rollout workers from the trainer's region at AWS's
inter-region price ($0.02/GB, docs/scale.md): verl's backends send to each worker; pulsesync's
patch crosses once into a regional mirror (`stores:`) and R times without one. Anchor steps are
reported apart. Contracts (exit 1 when broken): bit-exact every step; pulsesync's bytes per patch
step <= 0.5x delta_sharded's and <= 0.05x nccl's, on every workload.

    python bench/verl_sync.py --quick --json out.json   # 2 workloads x 8 steps, a 0.1B model, < 1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from contracts import Contract, enforce

from pulsesync.integrations.verl import PulseSyncCheckpointEngine
from pulsesync.protocol.signing import write_keypair
from pulsesync.synthetic import real_like_trainer

WORKLOADS = {"rl (lr 1e-6)": 1e-6, "supervised (lr 1e-5)": 1e-5}
INTER_REGION_PER_GB = 0.02  # AWS S3 data transfer to another AWS region (docs/scale.md)
REPLICAS = 64  # rollout workers in the other region, for the cost column


def apply_flush(state: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
    """What verl's delta consumers do with one flush: write the listed positions (or tensors) in place."""
    tensors = dict(named)
    spec = json.loads(tensors["__delta_spec__"].numpy().tobytes())
    values, positions = tensors["__values__"], tensors.get("__positions__")
    for p in spec["params"]:
        target = state[p["name"]].view(-1)
        part = values[p["val_start"] : p["val_end"]]
        if positions is None:
            target.copy_(part)
        else:
            target[positions[p["pos_start"] : p["pos_end"]].view(torch.int32).long()] = part


async def run_workload(lr: float, hidden: int, layers: int, steps: int, anchor_interval: int) -> dict[str, Any]:
    trainer = real_like_trainer(hidden=hidden, layers=layers, seed=7, lr=lr)
    with tempfile.TemporaryDirectory() as tmp:
        key, pub, _ = write_keypair(Path(tmp) / "keys")
        store = {"url": (Path(tmp) / "store").as_uri()}
        kwargs = {
            "publisher": {"store": store, "signing_key": str(key), "anchor_interval": anchor_interval},
            "subscriber": {"store": store, "trusted_keys": [str(pub)], "poll_seconds": 0.01},
        }
        actor = PulseSyncCheckpointEngine(bucket_size=256 << 20, is_master=True, **kwargs)
        rollout = PulseSyncCheckpointEngine(bucket_size=256 << 20, **kwargs)
        held = {name: torch.zeros_like(t) for name, t in trainer.state().items()}  # not the trainer's: sent whole
        rows, before = [], None
        try:
            for step in range(steps):
                if step:
                    trainer.step()
                state = trainer.state()
                metrics = await actor.send_weights(iter(state.items()), global_steps=step)
                sent = time.perf_counter()
                flush_bytes = 0
                async for named, _is_last in rollout.receive_weights(step):
                    apply_flush(held, named)
                    flush_bytes += sum(t.nbytes for name, t in named if name != "__delta_spec__")
                to_held = time.perf_counter() - sent
                exact = all(torch.equal(held[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())
                changed = (
                    sum(int((state[n].view(torch.int16) != before[n].view(torch.int16)).sum()) for n in state)
                    if before is not None
                    else sum(t.numel() for t in state.values())
                )
                rows.append(
                    {
                        "step": step,
                        "anchor": bool(metrics["pulsesync/anchor"]),
                        "pulsesync": int(metrics["pulsesync/wire_bytes"]),
                        "delta_sharded": changed * (4 + 2),  # bf16: int32 position + 2-byte value
                        "nccl": sum(t.nbytes for t in state.values()),
                        "flushes": flush_bytes,
                        "to_held": to_held,
                        "exact": exact,
                    }
                )
                before = state
        finally:
            actor.close()
            rollout.close()
    patches = [r for r in rows if not r["anchor"]]
    worst = max(patches, key=lambda r: r["pulsesync"] / r["delta_sharded"])
    per_step = {k: statistics.median(r[k] for r in patches) for k in ("pulsesync", "delta_sharded", "nccl")}
    gb = 1e9
    return {
        "rows": rows,
        "bit_exact": all(r["exact"] for r in rows),
        "median_bytes_per_patch_step": per_step,
        "pulsesync_over_delta_sharded": max(r["pulsesync"] / r["delta_sharded"] for r in patches),
        "pulsesync_over_nccl": max(r["pulsesync"] / r["nccl"] for r in patches),
        "worst_step": worst["step"],
        "to_held_seconds": statistics.median(r["to_held"] for r in patches),
        "region_cost_per_step_usd": {
            "pulsesync, regional mirror": per_step["pulsesync"] / gb * INTER_REGION_PER_GB,
            "pulsesync, no mirror": REPLICAS * per_step["pulsesync"] / gb * INTER_REGION_PER_GB,
            "delta_sharded": REPLICAS * per_step["delta_sharded"] / gb * INTER_REGION_PER_GB,
            "nccl": REPLICAS * per_step["nccl"] / gb * INTER_REGION_PER_GB,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 0.1B model, 8 steps per workload (CI)")
    parser.add_argument("--hidden", type=int, help="model width (default 1024; quick 512)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 8; quick 4)")
    parser.add_argument("--steps", type=int, help="steps per workload, the first an anchor (default 16; quick 8)")
    parser.add_argument("--anchor-interval", type=int, default=50, help="an anchor every K steps (default 50)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write results as JSON")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="accepted for the CI loop; this bench draws none")
    args = parser.parse_args()
    hidden = args.hidden or (512 if args.quick else 1024)
    layers = args.layers or (4 if args.quick else 8)
    steps = args.steps or (8 if args.quick else 16)
    results = {
        name: asyncio.run(run_workload(lr, hidden, layers, steps, args.anchor_interval))
        for name, lr in WORKLOADS.items()
    }
    params = sum(t.numel() for t in real_like_trainer(hidden=hidden, layers=layers).state().values())
    print(f"verl weight sync, {params / 1e6:.0f}M parameters (bf16), {steps} steps, the first an anchor")
    print(f"{'workload':24}{'pulsesync':>12}{'delta_sharded':>15}{'nccl':>12}{'ratio to delta':>16}{'to held':>10}")
    for name, r in results.items():
        b = r["median_bytes_per_patch_step"]
        print(
            f"{name:24}{b['pulsesync'] / 1e6:>10.2f}MB{b['delta_sharded'] / 1e6:>13.2f}MB{b['nccl'] / 1e6:>10.1f}MB"
            f"{r['pulsesync_over_delta_sharded']:>16.3f}{r['to_held_seconds']:>9.3f}s"
        )
    print(f"one step into another region of {REPLICAS} rollout workers, at ${INTER_REGION_PER_GB}/GB:")
    for name, r in results.items():
        costs = ", ".join(f"{k} ${v:.6f}" for k, v in r["region_cost_per_step_usd"].items())
        print(f"  {name}: {costs}")
    if args.json:
        args.json.write_text(json.dumps({"parameters": params, "steps": steps, "workloads": results}, indent=2))
    contracts = []
    for name, r in results.items():
        contracts += [
            Contract(f"bit_exact[{name}]", float(r["bit_exact"]), 1.0, at_most=False),
            Contract(f"pulsesync_over_delta_sharded[{name}]", r["pulsesync_over_delta_sharded"], 0.5),
            Contract(f"pulsesync_over_nccl[{name}]", r["pulsesync_over_nccl"], 0.05),
        ]
    enforce(contracts)


if __name__ == "__main__":
    main()
