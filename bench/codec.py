"""Codec benchmark: pulsesync's patch codec vs the PULSE paper's default, on a realistic RL workload.

Workload: fp32 master weights with LLM-like magnitudes (median |w| ~ 0.012, norms ~ 1.0, one large
embedding) updated by torch.optim.AdamW at lr 1e-6 and 3e-6 on noisy gradients, published as bf16.
Every measured step must change 0.5-1.5% of elements (checked). In the same run, on the same
step pairs, it measures a baseline implementing PULSE's default (per-tensor sorted positions,
delta-encoded, downcast to the narrowest unsigned int, raw bf16 values, zstd-1) and each
pulsesync setting: bytes per changed element, full ratio (dense bf16 bytes / patch bytes), and
encode (diff + encode + compress) and decode + apply throughput in GB/s of dense state, and where
the bytes go: positions, values and framing (headers, zstd frame overhead), exact for pulsesync
(EncodedPatch.wire), estimated for PULSE (pulse_wire). A sweep (bytes only, untimed) keeps every
step's ratio, density and split from the first optimizer step on at lr 1e-6, 3e-6 and 1e-5.
Then a real causal LLM (bench/real_llm.py: SmolLM2-135M fine-tuned with AdamW at lr 1e-6 on
English text) is coded step by step as a publisher codes it: `real_llm_ratio_vs_pulse` is its
worst step's ratio to PULSE's default. Contract (exit 1 when broken): that worst step is at least
2.5x (issue 28; deterministic: the same bytes every run on one machine).

    python bench/codec.py                     # full run (145M parameters), prints a table
    python bench/codec.py --quick --json out.json   # < 60 s on 2 cores; the automation contract
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import real_llm  # bench/real_llm.py (this script's folder is on sys.path)
import torch
from contracts import enforce
from counting import row_counts

from pulsesync.codec import CodecParams, PatchHistory, apply_patch, encode
from pulsesync.codec.baseline import pulse_apply, pulse_encode, pulse_wire
from pulsesync.digest import StateDigest, state_digest
from pulsesync.synthetic import SyntheticTrainer, llm_like_shapes, real_like_trainer
from pulsesync.threads import default_threads

State = dict[str, torch.Tensor]
DENSITY_RANGE = (0.003, 0.015)  # real fine-tunes measured 0.1%..1.1% (docs/benchmarks.md)
SWEEP_LRS = (1e-6, 3e-6, 1e-5)
METHODS = [  # (name, params, history-coded); the quick run and the sweep take the first three
    # Digests are given to the encoder (not timed): the steps' are mixsum-128, format 1's default is xxh3-128.
    ("pulsesync v1 (format 1, delta)", CodecParams(format_version=1, digest_algorithm="mixsum-128"), False),
    ("pulsesync v2 stateless", CodecParams(), False),
    ("pulsesync v2 history-coded (default)", CodecParams(), True),
    ("pulsesync v2 history, zstd-3", CodecParams(zstd_level=3), True),
    ("pulsesync v2 history, 1 thread", CodecParams(threads=1), True),
]


# --- measurement --------------------------------------------------------------------------------


@dataclass
class Step:
    step: int  # the trainer's optimizer step that produced `new`
    lr: float
    old: State
    new: State
    old_digest: StateDigest
    new_digest: StateDigest
    changed: int
    numel: int
    dense_bytes: int
    reference: PatchHistory | None = None  # history of the patch before (what a subscriber holds)
    previous: State | None = None  # the state before `old`


@dataclass
class Result:
    method: str
    patch_bytes: list[int] = field(default_factory=list)
    wire: list[dict[str, int]] = field(default_factory=list)  # per step: bytes by role
    encode_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)


WORKLOADS: dict[str, Callable[[int, int, float, int], SyntheticTrainer]] = {
    # fp32 master weights ~ N(0, 0.0178), noisy gradients: ~90% of changes are +-1 ULP
    "synthetic": lambda hidden, layers, lr, seed: SyntheticTrainer(
        llm_like_shapes(hidden, layers, vocab=96 * hidden), lr=lr, seed=seed
    ),
    # calibrated on real fine-tunes (bench/calibrate.py, docs/benchmarks.md): bf16 weights, near-zero mass
    "real-like": lambda hidden, layers, lr, seed: real_like_trainer(hidden, layers, seed=seed, lr=lr),
}


def training_steps(workload: str, lr: float, hidden: int, layers: int, seed: int, first: int = 1) -> Iterator[Step]:
    """Consecutive bf16 states of one training run from optimizer step `first` on, each step's reference
    the history of the patch before (what a subscriber holds), as the publisher codes them."""
    trainer = WORKLOADS[workload](hidden, layers, lr, seed)
    before: State | None = None
    prev = trainer.state()
    prev_digest = state_digest(prev)
    reference: PatchHistory | None = None
    for step in itertools.count(1):
        trainer.step()
        cur = trainer.state()
        cur_digest = state_digest(cur)
        if step >= first:
            changed = sum(int((prev[n].view(torch.int16) != cur[n].view(torch.int16)).sum()) for n in cur)
            numel = sum(t.numel() for t in cur.values())
            yield Step(step, lr, prev, cur, prev_digest, cur_digest, changed, numel, 2 * numel, reference, before)
        if step >= first - 1:  # the patch a yielded step is coded against
            reference = encode(prev, cur, base_digest=prev_digest, new_digest=cur_digest, reference=reference).history
        before, prev, prev_digest = prev, cur, cur_digest


def make_steps(
    workload: str, lrs: list[float], hidden: int, layers: int, warmup: int, measured: int, seed: int
) -> list[Step]:
    """Past AdamW's warmup (its first updates are unusually dense), `measured` consecutive steps per lr."""
    steps = []
    for lr in lrs:
        steps += itertools.islice(training_steps(workload, lr, hidden, layers, seed, first=warmup + 2), measured)
    return steps


def sweep(workload: str, hidden: int, layers: int, count: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Bytes only, nothing timed: each sweep method on steps 1..count at each of SWEEP_LRS (warmup included,
    no density check), for ratio against step and density."""
    encoders = {"PULSE default (baseline)": _pulse_encode}
    encoders |= {name: pulsesync_method(params, history)[0] for name, params, history in METHODS[:3]}
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in encoders}
    for lr in SWEEP_LRS:
        for s in itertools.islice(training_steps(workload, lr, hidden, layers, seed), count):
            for name, enc in encoders.items():
                patch, wire = enc(s)
                split = wire()
                points[name].append(
                    {
                        "step": s.step,
                        "lr": lr,
                        "density": s.changed / s.numel,
                        "ratio": s.dense_bytes / len(patch),
                        "wire_bytes_per_change": {role: size / s.changed for role, size in split.items()},
                    }
                )
    return points


def check_density(steps: list[Step], workload: str) -> None:
    for i, s in enumerate(steps):
        density = s.changed / s.numel
        if not DENSITY_RANGE[0] <= density <= DENSITY_RANGE[1]:
            sys.exit(f"{workload} step {i} (lr {s.lr:g}) has density {density:.3%}, outside {DENSITY_RANGE}")


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


# A method's encoder returns the patch and what gives its bytes by role (called after the timing).
Wire = Callable[[], dict[str, int]]
Encoder = Callable[[Step], tuple[bytes, Wire]]
Applier = Callable[[State, bytes, Step], None]


def measure(method: str, steps: list[Step], reps: int, encode: Encoder, apply: Applier) -> Result:
    result = Result(method)
    for s in steps:
        encode(s)  # warm caches and thread pools
        t_enc, encoded = _median_time(lambda s=s: encode(s), reps)
        assert isinstance(encoded, tuple)
        patch, wire = encoded
        work = _clone(s.old)
        apply(work, patch, s)
        _assert_bit_exact(work, s.new, method)
        t_dec, _ = _median_time(
            lambda work, patch=patch, s=s: apply(work, patch, s), reps, setup=lambda s=s: _clone(s.old)
        )
        result.patch_bytes.append(len(patch))
        result.wire.append(wire())
        assert sum(result.wire[-1].values()) == len(patch), method
        result.encode_s.append(t_enc)
        result.decode_s.append(t_dec)
    return result


def pulsesync_method(params: CodecParams, history: bool = False) -> tuple[Encoder, Applier]:
    def enc(s: Step) -> tuple[bytes, Wire]:
        reference = s.reference if history else None
        e = encode(s.old, s.new, params, base_digest=s.old_digest, new_digest=s.new_digest, reference=reference)
        return e.data, lambda: e.wire

    def dec(work: State, patch: bytes, s: Step) -> None:
        reference = s.reference if history else None
        apply_patch(work, patch, base_digest=s.old_digest, verify=False, reference=reference)
        if any(t.is_cuda for t in work.values()):  # kernels run asynchronously: time them done
            torch.cuda.synchronize()

    return enc, dec


def ordered(v: np.ndarray) -> np.ndarray:
    """int16 bit patterns (held in wider ints) in the codec's order-preserving map."""
    return np.where(v < 0, v ^ 0x7FFF, v)


def entropy_bits(*columns: np.ndarray) -> float:
    """Order-0 entropy (total bits) of the last column given the others (empirical joint counts)."""
    counts = row_counts(*columns)
    bits = float(-(counts * np.log2(counts / counts.sum())).sum())
    if len(columns) == 1:
        return bits
    context = row_counts(*columns[:-1])
    return bits - float(-(context * np.log2(context / context.sum())).sum())


def entropy_bounds(steps: list[Step]) -> tuple[float, float]:
    """Bytes per change: order-0 (position gaps + ordered deltas) and conditional (deltas given the old
    value's exponent and the position's delta at the previous step, clipped to +-8; gaps order-0)."""

    order0 = conditional = changes = 0.0
    for s in steps:
        gaps, deltas, exps, previous = [], [], [], []
        for name in s.new:
            a = s.old[name].reshape(-1).view(torch.int16).numpy().astype(np.int32)
            b = s.new[name].reshape(-1).view(torch.int16).numpy().astype(np.int32)
            pos = np.flatnonzero(a != b)
            gaps.append(np.diff(pos, prepend=-1))
            deltas.append(ordered(b[pos]) - ordered(a[pos]))
            exps.append((a[pos] >> 7) & 0xFF)
            if s.previous is not None:
                p = s.previous[name].reshape(-1).view(torch.int16).numpy().astype(np.int32)
                previous.append(np.clip(ordered(a[pos]) - ordered(p[pos]), -8, 8))
        g, d, e = np.concatenate(gaps), np.concatenate(deltas), np.concatenate(exps)
        prev = np.concatenate(previous) if previous else np.zeros_like(d)
        order0 += entropy_bits(g) + entropy_bits(d)
        conditional += entropy_bits(g) + entropy_bits(e, prev, d)
        changes += s.changed
    return order0 / 8 / changes, conditional / 8 / changes


def summarize(result: Result, steps: list[Step], baseline: Result) -> dict[str, Any]:
    dense = sum(s.dense_bytes for s in steps)
    changed = sum(s.changed for s in steps)
    wire = sum(result.patch_bytes)
    roles = result.wire[0].keys()
    return {
        "bytes_per_change": wire / changed,
        "wire_bytes_per_change": {role: sum(w[role] for w in result.wire) / changed for role in roles},
        "ratio": dense / wire,
        "ratio_vs_baseline": dense / wire / (dense / sum(baseline.patch_bytes)),
        "encode_gbps": dense / sum(result.encode_s) / 1e9,
        "decode_gbps": dense / sum(result.decode_s) / 1e9,
    }


def run_workload(workload: str, args: argparse.Namespace, hidden: int, measured: int, reps: int) -> dict[str, Any]:
    """Measure every method on one workload; print its table; return its JSON section."""
    t0 = time.perf_counter()
    layers = args.layers or 4  # with vocab = 96 x hidden: embedding-heavy like small LLMs
    steps = make_steps(workload, [1e-6, 3e-6], hidden, layers, warmup=12, measured=measured, seed=args.seed)
    check_density(steps, workload)
    t_workload = time.perf_counter() - t0
    methods = METHODS[:3] if args.quick else METHODS
    baseline = measure("PULSE default (baseline)", steps, reps, _pulse_encode, _pulse_apply)
    results = [(baseline, summarize(baseline, steps, baseline))]
    for name, params, history in methods:
        result = measure(name, steps, reps, *pulsesync_method(params, history))
        results.append((result, summarize(result, steps, baseline)))
    if args.device:  # the same steps held on the device; the CPU rows above are the baseline
        on_device = [replace(s, old=_to(s.old, args.device), new=_to(s.new, args.device)) for s in steps]
        method = f"pulsesync v2 history on {args.device}"
        device_result = measure(method, on_device, reps, *pulsesync_method(CodecParams(), True))
        results.append((device_result, summarize(device_result, steps, baseline)))
    order0, conditional = entropy_bounds(steps)
    densities = [s.changed / s.numel for s in steps]
    mean_density = statistics.mean(densities)
    print(
        f"\n[{workload}] {steps[0].numel / 1e6:.0f}M bf16 parameters ({steps[0].dense_bytes / 1e6:.0f} MB), "
        f"AdamW lr 1e-6 and 3e-6, {measured} steps each; density {min(densities):.2%}..{max(densities):.2%} "
        f"(mean {mean_density:.2%}); {default_threads()} threads; built in {t_workload:.0f}s"
    )
    print(
        f"entropy bounds, bytes/change: order-0 {order0:.3f} (ratio {2 / (order0 * mean_density):.0f}x), "
        f"conditional {conditional:.3f} (ratio {2 / (conditional * mean_density):.0f}x)"
    )
    print(
        f"{'method':<38} {'B/change':>9} {'positions':>9} {'values':>7} {'full ratio':>11} {'vs PULSE':>9} "
        f"{'encode GB/s':>12} {'decode GB/s':>12}"
    )
    for r, row in results:
        split = row["wire_bytes_per_change"]
        print(
            f"{r.method:<38} {row['bytes_per_change']:>9.3f} {split['positions']:>9.3f} {split['values']:>7.3f} "
            f"{row['ratio']:>10.1f}x {row['ratio_vs_baseline']:>8.2f}x {row['encode_gbps']:>12.2f} "
            f"{row['decode_gbps']:>12.2f}"
        )
    print("(PULSE's positions and values: its one zstd stream split in proportion to each compressed alone)")
    sweep_hidden = hidden // 2 if args.quick else hidden  # quick: a quarter of the parameters, to stay < 60 s
    points = sweep(workload, sweep_hidden, layers, args.sweep_steps, args.seed) if args.sweep_steps else {}
    for lr in SWEEP_LRS if points else ():
        line = ", ".join(
            f"{name.removeprefix('pulsesync ')} {min(p['ratio'] for p in ps if p['lr'] == lr):.0f}-"
            f"{max(p['ratio'] for p in ps if p['lr'] == lr):.0f}x"
            for name, ps in points.items()
        )
        densities = [p["density"] for p in next(iter(points.values())) if p["lr"] == lr]
        span = f"density {min(densities):.2%}..{max(densities):.2%}"
        print(f"sweep (hidden {sweep_hidden}) lr {lr:g}, steps 1-{args.sweep_steps}, {span}: {line}")
    return {
        "sweep": points,
        "density": mean_density,
        "entropy_bound_bytes_per_change": order0,
        "conditional_bound_bytes_per_change": conditional,
        "methods": {r.method: row for r, row in results},
        "per_lr_density": {
            str(lr): statistics.mean(s.changed / s.numel for s in steps if s.lr == lr) for lr in (1e-6, 3e-6)
        },
        "parameters": steps[0].numel,
    }


def _pulse_encode(s: Step) -> tuple[bytes, Wire]:
    patch = pulse_encode(s.old, s.new)
    return patch, lambda: pulse_wire(s.old, s.new, patch)


def _pulse_apply(work: State, patch: bytes, s: Step) -> None:
    pulse_apply(work, patch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, 2 steps per lr, fewer methods")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="also write PNG plots there (matplotlib)")
    parser.add_argument("--hidden", type=int, help="model width (default 1024; quick 512)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 4)")
    parser.add_argument("--steps", type=int, help="measured steps per learning rate (default 4; quick 2)")
    parser.add_argument("--reps", type=int, help="timing repetitions per step (median; default 5, quick 3)")
    parser.add_argument(
        "--sweep-steps", type=int, help="steps from the first, per sweep lr, whose bytes are kept (default 24; quick 2)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="also measure the default codec on states held on this device (e.g. cuda)")
    parser.add_argument(
        "--real-llm-steps", type=int, help="optimizer steps of the real LLM workload (default 6; quick 4; 0: skip)"
    )
    parser.add_argument(
        "--real-llm-workloads",
        default="all",
        help=f"the real LLM's fine-tunes, comma-separated, of {', '.join(real_llm.ALL_WORKLOADS)} (default: all)",
    )
    args = parser.parse_args()
    hidden = args.hidden or (512 if args.quick else 1024)
    measured = args.steps or (2 if args.quick else 4)
    reps = args.reps or (3 if args.quick else 5)
    if args.sweep_steps is None:
        args.sweep_steps = 2 if args.quick else 24
    t0 = time.perf_counter()
    sections = {w: run_workload(w, args, hidden, measured, reps) for w in WORKLOADS}
    llm_steps = args.real_llm_steps if args.real_llm_steps is not None else (4 if args.quick else 6)
    every = list(real_llm.ALL_WORKLOADS)
    names = every if args.real_llm_workloads == "all" else args.real_llm_workloads.split(",")
    llm = real_llm.measure_all(llm_steps, names) if llm_steps else None
    if llm is not None:
        real_llm.print_all(llm)
    synthetic, real = sections["synthetic"], sections["real-like"]
    default = synthetic["methods"]["pulsesync v2 history-coded (default)"]
    pulse = "PULSE default (baseline)"
    doc = {
        "density": synthetic["density"],
        "baseline_ratio": synthetic["methods"][pulse]["ratio"],
        "ratio": default["ratio"],
        "encode_gbps": default["encode_gbps"],
        "decode_gbps": default["decode_gbps"],
        "entropy_bound_bytes_per_change": synthetic["entropy_bound_bytes_per_change"],
        "methods": synthetic["methods"],
        "per_lr_density": synthetic["per_lr_density"],
        "parameters": synthetic["parameters"],
        "real_like_ratio_vs_pulse": real["methods"]["pulsesync v2 stateless"]["ratio_vs_baseline"],
        "history_ratio_vs_pulse": real["methods"]["pulsesync v2 history-coded (default)"]["ratio_vs_baseline"],
        # Real causal LLM fine-tunes (bench/real_llm.py): the worst step of all of them, to PULSE's default.
        "real_llm_ratio_vs_pulse": llm.get("worst_ratio_vs_pulse") if llm else None,
        # The MoE fine-tune's worst steady step and its first patch to PULSE's default; the LoRA fine-tunes'
        # worst step against the order-0 entropy of its ULP moves, and its ratio to the raw bf16 adapter.
        "moe_ratio_vs_pulse": llm.get("moe_ratio_vs_pulse") if llm else None,
        "moe_first_patch_ratio_vs_pulse": llm.get("moe_first_patch_ratio_vs_pulse") if llm else None,
        "lora_bytes_over_entropy_bound": llm.get("lora_bytes_over_entropy_bound") if llm else None,
        "lora_ratio_vs_raw": llm.get("lora_ratio_vs_raw") if llm else None,
        "real_llm": llm,
        "workloads": sections,
        "machine": {"cpus": default_threads(), "python": platform.python_version(), "torch": torch.__version__},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    if args.plots:
        import plots

        print("\n".join(str(p) for p in plots.codec(doc, args.plots)))
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")
    if llm is not None:
        enforce(real_llm.contracts(llm))


if __name__ == "__main__":
    main()
