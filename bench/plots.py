"""PNG plots of the benchmarks' JSON (matplotlib: `pip install -e '.[plots]'`).

bench/codec.py and bench/scale.py call these with `--plots DIR`; this script redraws them from
saved JSON, e.g. the figures docs/benchmarks.md shows:

    python bench/plots.py --codec codec.json --scale scale.json --out docs/images
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

_DPI = 90  # small committed PNGs


def codec(doc: dict[str, Any], out: Path) -> list[Path]:
    """Per workload: ratio and bytes per changed element of each method, against the entropy bound."""
    out.mkdir(parents=True, exist_ok=True)
    workloads = doc["workloads"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(next(iter(workloads.values()))["methods"])
    width = 0.8 / len(workloads)
    for i, (workload, section) in enumerate(workloads.items()):
        xs = [j + i * width for j in range(len(names))]
        label = f"{workload} (density {section['density']:.2%})"
        axes[0].bar(xs, [section["methods"][n]["ratio"] for n in names], width, label=label)
        axes[1].bar(xs, [section["methods"][n]["bytes_per_change"] for n in names], width, label=label)
        bound = section["entropy_bound_bytes_per_change"]
        axes[1].axhline(bound, color=f"C{i}", linestyle=":", linewidth=1)
    titles = ("dense bytes / wire bytes (higher is better)", "wire bytes per changed element")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks([j + width * (len(workloads) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels([textwrap.fill(n, 16) for n in names], fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[1].text(0.99, 0.97, "dotted: entropy bound", transform=axes[1].transAxes, ha="right", va="top", fontsize=8)
    axes[0].legend(fontsize=8)
    fig.suptitle("bench/codec.py: codecs on each workload", fontsize=11)
    fig.tight_layout()
    path = out / "codec-methods.png"
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return [path]


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
    fig.tight_layout()
    path = out / "scale-fast-path.png"
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", type=Path, metavar="JSON", help="bench/codec.py --json output")
    parser.add_argument("--scale", type=Path, metavar="JSON", help="bench/scale.py --json output")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args()
    written = []
    if args.codec:
        written += codec(json.loads(args.codec.read_text()), args.out)
    if args.scale:
        written += scale(json.loads(args.scale.read_text()), args.out)
    print("\n".join(str(p) for p in written))


if __name__ == "__main__":
    main()
