"""PNG plots of the benchmarks' JSON (matplotlib: `pip install -e '.[plots]'`).

Every bench/ script calls these with `--plots DIR`; this script redraws them from saved JSON, e.g.
the figures docs/benchmarks.md shows:

    python bench/plots.py --codec codec.json --scale scale.json --store store.json \
        --publish publish.json --subscriber subscriber.json --out docs/images
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no screen
import matplotlib.pyplot as plt
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

_DPI = 90  # small committed PNGs


def codec(doc: dict[str, Any], out: Path) -> list[Path]:
    """The codecs' ratios, where their bytes go, and their ratio against step and density."""
    out.mkdir(parents=True, exist_ok=True)
    return [
        _codec_methods(doc["workloads"], out),
        _codec_bytes(doc["workloads"], out),
        _codec_steps(doc["workloads"], out),
    ]


def _method_labels(names: list[str]) -> list[str]:
    return [textwrap.fill(n.removeprefix("pulsesync "), 16) for n in names]


def _codec_methods(workloads: dict[str, Any], out: Path) -> Path:
    """Ratio of each method on each workload."""
    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(next(iter(workloads.values()))["methods"])
    width = 0.8 / len(workloads)
    for i, (workload, section) in enumerate(workloads.items()):
        xs = [j + i * width for j in range(len(names))]
        label = f"{workload} (density {section['density']:.2%})"
        bars = ax.bar(xs, [section["methods"][n]["ratio"] for n in names], width, label=label)
        ax.bar_label(bars, fmt="%.0fx", fontsize=7)
    ax.set_xticks([j + width * (len(workloads) - 1) / 2 for j in range(len(names))])
    ax.set_xticklabels(_method_labels(names), fontsize=7)
    ax.set_ylabel("dense bytes / wire bytes (higher is better)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("bench/codec.py: full ratio of each codec on each workload", fontsize=10)
    return _save(fig, out / "codec-methods.png")


_ROLES = {"positions": "C0", "values": "C1", "framing": "C7"}


def _codec_bytes(workloads: dict[str, Any], out: Path) -> Path:
    """Wire bytes per changed element, stacked: positions, values, framing; the entropy bound dotted."""
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2), sharey=True, squeeze=False)
    for ax, (workload, section) in zip(axes[0], workloads.items(), strict=True):
        names = list(section["methods"])
        bottom = [0.0] * len(names)
        for role, color in _ROLES.items():
            heights = [section["methods"][n]["wire_bytes_per_change"][role] for n in names]
            ax.bar(range(len(names)), heights, 0.6, bottom=bottom, color=color, label=role)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        for j, total in enumerate(bottom):
            ax.text(j, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
        bound = section["entropy_bound_bytes_per_change"]
        ax.axhline(bound, color="black", linestyle=":", linewidth=1, label="order-0 entropy bound")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(_method_labels(names), fontsize=7)
        ax.set_title(f"{workload} (density {section['density']:.2%})", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("wire bytes per changed element")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("bench/codec.py: where the bytes go (PULSE's split estimated: one zstd stream)", fontsize=11)
    return _save(fig, out / "codec-bytes.png")


def _codec_steps(workloads: dict[str, Any], out: Path) -> Path:
    """Per workload, from the sweep: each method's ratio against the optimizer step (a line per
    learning rate) and against the step's density."""
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.8 * len(workloads)), squeeze=False)
    styles = ("o-", "s--", "^:", "D-.")
    for (by_step, by_density), (workload, section) in zip(axes, workloads.items(), strict=True):
        lrs: list[float] = []
        for i, (name, points) in enumerate(section["sweep"].items()):
            lrs = sorted({p["lr"] for p in points})
            for lr, style in zip(lrs, styles, strict=False):
                run = [p for p in points if p["lr"] == lr]
                ratios = [p["ratio"] for p in run]
                label = name.removeprefix("pulsesync ") if lr == lrs[0] else None
                by_step.plot([p["step"] for p in run], ratios, style, color=f"C{i}", label=label, markersize=3)
                by_density.plot([p["density"] * 100 for p in run], ratios, style[0], color=f"C{i}", markersize=4)
        legend = ", ".join(f"{style} lr {lr:g}" for lr, style in zip(lrs, styles, strict=False))
        by_step.set_title(f"{workload}: ratio per optimizer step ({legend})", fontsize=9)
        by_density.set_title(f"{workload}: ratio against the step's density", fontsize=9)
        by_step.set_xlabel("optimizer step (from the first; AdamW's first updates are dense)")
        by_density.set_xlabel("changed elements (%)")
        by_density.set_xscale("log")
        by_density.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        by_density.xaxis.set_major_formatter(ScalarFormatter())
        by_density.xaxis.set_minor_formatter(NullFormatter())
        for ax in (by_step, by_density):
            ax.set_ylabel("dense / wire bytes")
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
        by_step.legend(fontsize=7)
    fig.suptitle("bench/codec.py: ratio per step and density (sweep: bytes of every step, untimed)", fontsize=11)
    return _save(fig, out / "codec-steps.png")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def scale(doc: dict[str, Any], out: Path) -> list[Path]:
    """Fast-path milliseconds per step against model size, beside the memory floor; and both as growth."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = doc["sizes"]
    params = [s["parameters"] / 1e9 for s in sizes]
    fig, (ms, growth) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {
        "fast-path step (Subscriber.sync)": [s["fast_s"] for s in sizes],
        "memory floor (one read-modify-write per change)": [s["floor_s"] for s in sizes],
    }
    for (label, seconds), marker in zip(series.items(), ("o-", "s--"), strict=True):
        ms.plot(params, [x * 1000 for x in seconds], marker, label=label)
        growth.plot(params, [x / seconds[0] for x in seconds], marker, label=label)
    growth.plot(params, [s["patch_bytes"] / sizes[0]["patch_bytes"] for s in sizes], "^:", label="patch bytes")
    growth.axhline(1.2, color="grey", linewidth=0.8, linestyle="-.")
    growth.text(params[0], 1.23, "1.2x", fontsize=8, color="grey")
    ms.set_ylabel("milliseconds per step")
    growth.set_ylabel("relative to the smallest model")
    for ax in (ms, growth):
        ax.set_xlabel("model parameters (billions, bf16)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"bench/scale.py: the same changes per step; step growth {doc['fast_path_growth_raw']:.2f}x, "
        f"memory floor {doc['memory_floor_growth']:.2f}x",
        fontsize=10,
    )
    return [_save(fig, out / "scale-fast-path.png")]


def store(doc: dict[str, Any], out: Path) -> list[Path]:
    """MB/s of each transfer: pulsesync's beside the plain single request, uploads and downloads."""
    out.mkdir(parents=True, exist_ok=True)
    groups = {
        "upload": {"one put_object": "plain_put_mbps", "Store.upload_file\n(multipart)": "multipart_put_mbps"},
        "download": {
            "one get_object,\nto memory": "plain_get_mbps",
            "one get_object, to\nfile + SHA-256": "plain_get_to_file_mbps",
            "Store.download_file\n(parallel ranges)": "parallel_get_mbps",
        },
    }
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2, 3]})
    for ax, (title, bars) in zip(axes, groups.items(), strict=True):
        colors = ["C7"] * (len(bars) - 1) + ["C0"]  # the plain requests grey, pulsesync's blue
        drawn = ax.bar(list(bars), [doc[k] for k in bars.values()], 0.6, color=colors)
        ax.bar_label(drawn, fmt="%.0f", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("MB/s (best of the repetitions)")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    size = doc["size_bytes"] >> 20
    fig.suptitle(f"bench/store.py: one {size} MiB object through {doc['endpoint']}", fontsize=10)
    return [_save(fig, out / "store-transfers.png")]


def publish(doc: dict[str, Any], out: Path) -> list[Path]:
    """Per step: the trainer's publish() beside the host copy it is held to, and the pipeline's stages."""
    out.mkdir(parents=True, exist_ok=True)
    per_step = doc["per_step"]
    fig, (latency, pipeline) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = range(len(per_step["publish_s"]))
    latency.plot(steps, [s * 1000 for s in per_step["host_copy_s"]], "s--", color="C7", label="host copy (baseline)")
    latency.plot(steps, [s * 1000 for s in per_step["publish_s"]], "o-", color="C0", label="Publisher.publish()")
    latency.set_xlabel("step")
    latency.set_ylabel("milliseconds on the trainer's thread")
    latency.set_ylim(bottom=0)
    latency.legend(fontsize=8)
    fastest, median = doc["ratio_fastest_publish_to_copy"], doc["ratio_publish_to_copy"]
    ratios = f"fastest {fastest:.2f}x (contract < 2x), median {median:.2f}x"
    latency.set_title(f"publish / host copy: {ratios}", fontsize=9)
    patches = per_step["patches"]
    bottom = [0.0] * len(patches)
    for i, stage in enumerate(("digest", "encode", "upload", "commit")):
        heights = [p[stage] * 1000 for p in patches]
        pipeline.bar([p["step"] for p in patches], heights, bottom=bottom, color=f"C{i}", label=stage)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    pipeline.set_xlabel("step (patches)")
    pipeline.set_ylabel("milliseconds on the publisher's thread")
    pipeline.set_ylim(top=max(bottom, default=1.0) * 1.25)  # room for the legend above the bars
    pipeline.legend(fontsize=8, ncol=4, loc="upper center")
    pipeline.set_title(f"pipeline per patch (ratio {doc['patch_ratio']:.0f}x)", fontsize=9)
    for ax in (latency, pipeline):
        ax.grid(axis="y", alpha=0.3)
    mb = doc["dense_bytes"] / 1e6
    fig.suptitle(f"bench/publish.py: {doc['parameters'] / 1e6:.0f}M parameters ({mb:.0f} MB bf16)", fontsize=10)
    return [_save(fig, out / "publish-steps.png")]


def subscriber(doc: dict[str, Any], out: Path) -> list[Path]:
    """Per workload and step: the fast path's seconds (with and without the download) against one full download."""
    out.mkdir(parents=True, exist_ok=True)
    workloads = doc["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 3.8), sharey=True, squeeze=False)
    for ax, (workload, r) in zip(axes[0], workloads.items(), strict=True):
        steps = range(1, r["steps"] + 1)
        ax.axhline(r["full_download_s"], color="C7", linestyle="--", label="full checkpoint download (baseline)")
        ax.plot(steps, r["per_step"]["fast_path_s"], "o-", color="C0", label="fast path, download included")
        ax.plot(
            steps, r["per_step"]["fast_path_excl_download_s"], "s:", color="C1", label="fast path, download excluded"
        )
        ax.set_yscale("log")
        ax.set_xlabel("step (one patch each)")
        ax.grid(alpha=0.3, which="both")
        ax.set_title(
            f"{workload}: {r['fast_path_s_per_gib']:.3f} s/GiB excl. download, "
            f"{r['speedup_vs_full_400mbps']:.0f}x faster than a full download",
            fontsize=9,
        )
    axes[0][0].set_ylabel("seconds (log)")
    axes[0][0].legend(fontsize=8)
    first = next(iter(workloads.values()))
    fig.suptitle(
        f"bench/subscriber.py: {first['state_gib']:.2f} GiB of bf16 state over a {first['mbps']:g} Mb/s link",
        fontsize=10,
    )
    return [_save(fig, out / "subscriber-fast-path.png")]


def sharded(doc: dict[str, Any], out: Path) -> list[Path]:
    """Per world size: a patch step's publish against one rank's, and each rank's peak memory per shard."""
    out.mkdir(parents=True, exist_ok=True)
    runs = sorted(doc["runs"].values(), key=lambda r: r["world"])
    worlds = [str(r["world"]) for r in runs]
    base = runs[0]["step_s"]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.6))
    speed.bar(worlds, [r["step_s"] * 1000 for r in runs], color="C0")
    for i, r in enumerate(runs):
        speed.annotate(f"{base / r['step_s']:.2f}x", (i, r["step_s"] * 1000), ha="center", va="bottom", fontsize=8)
    speed.set_xlabel("ranks")
    speed.set_ylabel("ms per step (rank 0)")
    speed.set_title("publish() until committed, per patch step", fontsize=9)
    width = 0.38
    xs = range(len(runs))
    memory.bar([x - width / 2 for x in xs], [r["peak_over_shard"] for r in runs], width, label="fixed mmap threshold")
    default = [r["peak_over_shard_default_malloc"] for r in runs]
    memory.bar([x + width / 2 for x in xs], default, width, color="C7", label="glibc default")
    memory.axhline(2.3, color="C3", linestyle="--", linewidth=1, label="contract 2.3x")
    memory.set_xticks(list(xs), worlds)
    memory.set_xlabel("ranks")
    memory.set_ylabel("peak resident / shard")
    memory.legend(fontsize=8)
    memory.set_title("each rank's peak memory while publishing", fontsize=9)
    for ax in (speed, memory):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"bench/sharded.py: {runs[0]['parameters'] / 1e6:.0f}M parameters, codec threads 1 per rank", fontsize=10
    )
    return [_save(fig, out / "sharded.png")]


def engines(doc: dict[str, Any], out: Path) -> list[Path]:
    """Per vLLM worker, TP=1 and TP=2: bytes it received for one fast-path patch and bytes it keeps."""
    out.mkdir(parents=True, exist_ok=True)
    labels, received, kept = [], [], []
    for tp in ("1", "2"):
        run = doc["runs"][tp]
        for rank, (got, held) in enumerate(zip(run["received_bytes"], run["kept_bytes"], strict=True)):
            labels.append(f"TP={tp}\nworker {rank}")
            received.append(got / 1e6)
            kept.append(held / 1e6)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar(labels, received, color="C0")
    left.set_ylabel("MB received")
    left.set_title("its update file, one fast-path patch", fontsize=9)
    right.bar(labels, kept, color="C1")
    right.set_ylabel("MB kept beside the engine's weights")
    right.set_title("its copy of the modules it rebuilds", fontsize=9)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"bench/engines.py: TP=2 workers receive {doc['worker_bytes_tp2_over_tp1']:.2f}x and keep "
        f"{doc['worker_kept_bytes_tp2_over_tp1']:.2f}x a TP=1 worker's",
        fontsize=10,
    )
    return [_save(fig, out / "engines.png")]


def fanout(doc: dict[str, Any], out: Path) -> list[Path]:
    """The origin's egress per patch byte, with two mirrors and without; fallbacks per region."""
    out.mkdir(parents=True, exist_ok=True)
    runs = doc["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    labels = [f"{doc['mirrors']} mirrors", "no mirror"]
    left.bar(
        labels, [runs["mirrored"]["egress_over_patch"], runs["no_mirror"]["egress_over_patch"]], color=["C0", "C1"]
    )
    left.axhline(doc["mirrors"] + 0.5, color="k", linestyle=":", label="contract")
    left.set_ylabel("origin egress / patch bytes")
    left.legend(fontsize=8)
    fallbacks = runs["mirrored"]["fallbacks"]
    right.bar([f"region {r}" for r in fallbacks], list(fallbacks.values()), color="C2")
    right.set_ylabel("syncs a mirror failed (from the origin)")
    right.set_title("a: the lying mirror; b: the lagging one", fontsize=9)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"bench/fanout.py: {doc['subscribers']} subscribers, {doc['steps']} steps, "
        f"{doc['unverified_served']} unverified states served",
        fontsize=10,
    )
    return [_save(fig, out / "fanout.png")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", type=Path, metavar="JSON", help="bench/codec.py --json output")
    parser.add_argument("--scale", type=Path, metavar="JSON", help="bench/scale.py --json output")
    parser.add_argument("--store", type=Path, metavar="JSON", help="bench/store.py --json output")
    parser.add_argument("--publish", type=Path, metavar="JSON", help="bench/publish.py --json output")
    parser.add_argument("--subscriber", type=Path, metavar="JSON", help="bench/subscriber.py --json output")
    parser.add_argument("--sharded", type=Path, metavar="JSON", help="bench/sharded.py --json output")
    parser.add_argument("--engines", type=Path, metavar="JSON", help="bench/engines.py --json output")
    parser.add_argument("--fanout", type=Path, metavar="JSON", help="bench/fanout.py --json output")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    plotters = {
        "codec": codec,
        "scale": scale,
        "store": store,
        "publish": publish,
        "subscriber": subscriber,
        "sharded": sharded,
        "engines": engines,
        "fanout": fanout,
    }
    written = []
    for name, plot in plotters.items():
        if path := getattr(args, name):
            written += plot(json.loads(path.read_text()), args.out)
    print("\n".join(str(p) for p in written))


if __name__ == "__main__":
    main()
