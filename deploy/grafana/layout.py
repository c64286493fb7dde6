"""Draw the dashboard's panel grid from pulsesync.json (no Grafana needed): docs/images/dashboard-layout.png.

python deploy/grafana/layout.py docs/images/dashboard-layout.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

DASHBOARD = Path(__file__).with_name("pulsesync.json")


def main(out: Path) -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig, ax = plt.subplots(figsize=(12, rows * 0.22))
    for p in panels:
        g = p["gridPos"]
        row = p["type"] == "row"
        ax.add_patch(
            Rectangle(
                (g["x"] + 0.1, g["y"] + 0.1),
                g["w"] - 0.2,
                g["h"] - 0.2,
                facecolor="#343a40" if row else "#f1f3f5",
                edgecolor="#868e96",
            )
        )
        queries = "" if row else "\n".join(t["expr"][:48] + ("…" if len(t["expr"]) > 48 else "") for t in p["targets"])
        ax.text(
            g["x"] + 0.4,
            g["y"] + 0.55,
            p["title"],
            fontsize=8,
            weight="bold",
            va="center",
            color="white" if row else "black",
        )
        if queries:
            ax.text(g["x"] + 0.4, g["y"] + 1.4, queries, fontsize=5.5, va="top", family="monospace", color="#495057")
    ax.set_xlim(0, 24)
    ax.set_ylim(rows, 0)
    ax.axis("off")
    ax.set_title(
        "deploy/grafana/pulsesync.json: panel layout (drawn from the JSON, not a Grafana screenshot)", fontsize=9
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
