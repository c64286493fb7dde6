"""Codec benchmark: pulsesync's patch codec vs the PULSE paper's default, on a realistic RL workload.

Workload: fp32 master weights with LLM-like magnitudes (median |w| ~ 0.012, norms ~ 1.0, one large
embedding) updated by torch.optim.AdamW at lr 1e-6 and 3e-6 on noisy gradients, published as bf16.
Every measured step must change 0.5-1.5% of elements (checked). In the same run, on the same
step pairs, it measures a baseline implementing PULSE's default (per-tensor sorted positions,
delta-encoded, downcast to the narrowest unsigned int, raw bf16 values, zstd-1) and each
pulsesync setting: bytes per changed element, full ratio (dense bf16 bytes / patch bytes), and
encode (diff + encode + compress) and decode + apply throughput in GB/s of dense state.

    python bench/codec.py                     # full run (145M parameters), prints a table
    python bench/codec.py --quick --json out.json   # < 60 s on 2 cores; the automation contract
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pulsesync.codec import CodecParams, apply_patch, encode_patch
from pulsesync.codec.baseline import pulse_apply, pulse_encode
from pulsesync.digest import StateDigest, state_digest
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes
from pulsesync.threads import default_threads

State = dict[str, torch.Tensor]
DENSITY_RANGE = (0.005, 0.015)


# --- measurement --------------------------------------------------------------------------------


@dataclass
class Step:
    lr: float
    old: State
    new: State
    old_digest: StateDigest
    new_digest: StateDigest
    changed: int
    numel: int
    dense_bytes: int


@dataclass
class Result:
    method: str
    patch_bytes: list[int] = field(default_factory=list)
    encode_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)


def make_steps(lrs: list[float], hidden: int, layers: int, warmup: int, measured: int, seed: int) -> list[Step]:
    """Warm AdamW up (its first updates are unusually dense), then keep consecutive bf16 states."""
    steps = []
    shapes = llm_like_shapes(hidden, layers, vocab=96 * hidden)
    for lr in lrs:
        trainer = SyntheticTrainer(shapes, lr=lr, seed=seed)
        for _ in range(warmup):
            trainer.step()
        prev = trainer.state()
        prev_digest = state_digest(prev)
        for _ in range(measured):
            trainer.step()
            cur = trainer.state()
            cur_digest = state_digest(cur)
            changed = sum(int((prev[n].view(torch.int16) != cur[n].view(torch.int16)).sum()) for n in cur)
            numel = sum(t.numel() for t in cur.values())
            steps.append(Step(lr, prev, cur, prev_digest, cur_digest, changed, numel, 2 * numel))
            prev, prev_digest = cur, cur_digest
    return steps


def check_density(steps: list[Step]) -> None:
    for i, s in enumerate(steps):
        density = s.changed / s.numel
        if not DENSITY_RANGE[0] <= density <= DENSITY_RANGE[1]:
            sys.exit(f"workload step {i} (lr {s.lr:g}) has density {density:.3%}, outside {DENSITY_RANGE}")


def _median_time(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        out = fn(arg) if setup else fn()  # type: ignore[call-arg]
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _to(state: State, device: str) -> State:
    return {n: t.to(device) for n, t in state.items()}


def _clone(state: State) -> State:
    return {n: t.clone() for n, t in state.items()}


def _assert_bit_exact(work: State, expected: State, method: str) -> None:
    for name, t in expected.items():
        if not torch.equal(work[name].view(torch.int16), t.view(torch.int16)):
            sys.exit(f"{method}: tensor {name!r} is not bit-exact after decode")


def measure(
    method: str,
    steps: list[Step],
    reps: int,
    encode: Callable[[Step], bytes],
    apply: Callable[[State, bytes, Step], None],
) -> Result:
    result = Result(method)
    for s in steps:
        encode(s)  # warm caches and thread pools
        t_enc, patch = _median_time(lambda s=s: encode(s), reps)
        assert isinstance(patch, bytes)
        work = _clone(s.old)
        apply(work, patch, s)
        _assert_bit_exact(work, s.new, method)
        t_dec, _ = _median_time(
            lambda work, patch=patch, s=s: apply(work, patch, s), reps, setup=lambda s=s: _clone(s.old)
        )
        result.patch_bytes.append(len(patch))
        result.encode_s.append(t_enc)
        result.decode_s.append(t_dec)
    return result


def pulsesync_method(params: CodecParams) -> tuple[Callable[[Step], bytes], Callable[[State, bytes, Step], None]]:
    def enc(s: Step) -> bytes:
        return encode_patch(s.old, s.new, params, base_digest=s.old_digest, new_digest=s.new_digest)

    def dec(work: State, patch: bytes, s: Step) -> None:
        apply_patch(work, patch, base_digest=s.old_digest, verify=False)
        if any(t.is_cuda for t in work.values()):  # kernels run asynchronously: time them done
            torch.cuda.synchronize()

    return enc, dec


def entropy_bound(steps: list[Step]) -> float:
    """Order-0 entropy of per-tensor position gaps plus ordered-value deltas, in bytes per change."""

    def entropy(x: np.ndarray) -> float:
        _, counts = np.unique(x, return_counts=True)
        p = counts / counts.sum()
        return float(-(p * np.log2(p)).sum() * counts.sum())

    bits = changes = 0.0
    for s in steps:
        gaps, deltas = [], []
        for name in s.new:
            a = s.old[name].reshape(-1).view(torch.int16).numpy().astype(np.int32)
            b = s.new[name].reshape(-1).view(torch.int16).numpy().astype(np.int32)
            pos = np.flatnonzero(a != b)
            ordered = lambda v: np.where(v < 0, v ^ 0x7FFF, v)  # noqa: E731 - the codec's order-preserving map
            gaps.append(np.diff(pos, prepend=-1))
            deltas.append(ordered(b[pos]) - ordered(a[pos]))
        bits += entropy(np.concatenate(gaps)) + entropy(np.concatenate(deltas))
        changes += s.changed
    return bits / 8 / changes


def summarize(result: Result, steps: list[Step], baseline: Result | None) -> dict[str, float]:
    dense = sum(s.dense_bytes for s in steps)
    changed = sum(s.changed for s in steps)
    wire = sum(result.patch_bytes)
    out = {
        "bytes_per_change": wire / changed,
        "ratio": dense / wire,
        "encode_gbps": dense / sum(result.encode_s) / 1e9,
        "decode_gbps": dense / sum(result.decode_s) / 1e9,
    }
    if baseline is not None:
        out["ratio_vs_baseline"] = out["ratio"] / (dense / sum(baseline.patch_bytes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, 2 steps per lr, default codec only")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--hidden", type=int, help="model width (default 1024; quick 512)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 4)")
    parser.add_argument("--steps", type=int, help="measured steps per learning rate (default 4; quick 2)")
    parser.add_argument("--reps", type=int, help="timing repetitions per step (median; default 5, quick 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="also measure the default codec on states held on this device (e.g. cuda)")
    args = parser.parse_args()
    hidden = args.hidden or (512 if args.quick else 1024)
    layers = args.layers or 4  # with vocab = 96 x hidden: embedding-heavy like small LLMs, density in range
    measured = args.steps or (2 if args.quick else 4)
    reps = args.reps or (3 if args.quick else 5)

    t0 = time.perf_counter()
    steps = make_steps([1e-6, 3e-6], hidden, layers, warmup=12, measured=measured, seed=args.seed)
    check_density(steps)
    t_workload = time.perf_counter() - t0
    params = [("pulsesync delta zstd-1 (default)", CodecParams())]
    if not args.quick:
        params += [
            ("pulsesync delta zstd-3", CodecParams(zstd_level=3)),
            ("pulsesync xor zstd-1", CodecParams(value_coding="xor")),
            ("pulsesync raw zstd-1", CodecParams(value_coding="raw")),
            ("pulsesync delta zstd-1, 1 thread", CodecParams(threads=1)),
        ]
    baseline = measure(
        "PULSE default (baseline)", steps, reps, lambda s: pulse_encode(s.old, s.new), lambda w, p, s: pulse_apply(w, p)
    )
    results = [
        (r, summarize(r, steps, baseline))
        for r in [baseline] + [measure(n, steps, reps, *pulsesync_method(p)) for n, p in params]
    ]
    if args.device:  # the same steps held on the device; the CPU rows above are the baseline
        on_device = [replace(s, old=_to(s.old, args.device), new=_to(s.new, args.device)) for s in steps]
        method = f"pulsesync default on {args.device}"
        device_result = measure(method, on_device, reps, *pulsesync_method(CodecParams()))
        results.append((device_result, summarize(device_result, steps, baseline)))
    bound = entropy_bound(steps)

    dense_mb = steps[0].dense_bytes / 1e6
    densities = [s.changed / s.numel for s in steps]
    digest_s, _ = _median_time(lambda: state_digest(steps[0].new), reps)
    print(
        f"workload: {steps[0].numel / 1e6:.0f}M bf16 parameters ({dense_mb:.0f} MB), AdamW lr 1e-6 and 3e-6, "
        f"{measured} steps each; density {min(densities):.2%}..{max(densities):.2%} "
        f"(mean {statistics.mean(densities):.2%}); "
        f"{default_threads()} threads; built in {t_workload:.0f}s"
    )
    print(
        f"order-0 entropy bound: {bound:.3f} bytes/change (ratio {2 / (bound * statistics.mean(densities)):.0f}x); "
        f"state digest xxh3-128: {steps[0].dense_bytes / digest_s / 1e9:.1f} GB/s"
    )
    print()
    print(f"{'method':<36} {'B/change':>9} {'full ratio':>11} {'vs PULSE':>9} {'encode GB/s':>12} {'decode GB/s':>12}")
    for r, s in results:
        print(
            f"{r.method:<36} {s['bytes_per_change']:>9.3f} {s['ratio']:>10.1f}x {s['ratio_vs_baseline']:>8.2f}x "
            f"{s['encode_gbps']:>12.2f} {s['decode_gbps']:>12.2f}"
        )
    default = results[1][1]
    if args.json:
        doc = {
            "density": statistics.mean(densities),
            "baseline_ratio": results[0][1]["ratio"],
            "ratio": default["ratio"],
            "encode_gbps": default["encode_gbps"],
            "decode_gbps": default["decode_gbps"],
            "entropy_bound_bytes_per_change": bound,
            "methods": {r.method: s for r, s in results},
            "per_lr_density": {
                str(lr): statistics.mean(s.changed / s.numel for s in steps if s.lr == lr) for lr in (1e-6, 3e-6)
            },
            "parameters": steps[0].numel,
            "machine": {"cpus": default_threads(), "python": platform.python_version(), "torch": torch.__version__},
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
