"""`pulsesync inspect --html`: the chain as one self-contained HTML page (pure: rows in, text out).

A timeline (inline SVG: no scripts, no fetches) of every step in the store: patch sizes on a log
scale, anchors, steps retention removed (tombstoned, or gone), whether each marker's signature
verified, and under it the chain a subscriber can follow from each anchor; then a table of the
same rows. Every value shown is escaped: names and errors come from an untrusted store.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from html import escape

from pulsesync.inspect_chain import ChainRow, RetiredRow
from pulsesync.protocol.fleet import FleetStatus

_WIDTH, _PLOT_TOP, _PLOT_HEIGHT, _LEFT = 1100, 30, 200, 70
_STATUS_COLOUR = {True: "#2b8a3e", None: "#5c7cfa", False: "#c92a2a"}  # verified, unchecked, failed
_STATUS_TEXT = {True: "verified", None: "not checked (no trusted key)", False: "FAILED verification"}
_LEGEND = {True: "verified", None: "not checked", False: "failed"}


def _verdict(row: ChainRow) -> bool | None:
    """Verified (True), not checked (None), or failed (False: a bad signature or an unreadable manifest)."""
    return row.verified if row.signer else False


def _density(row: ChainRow, elements: int | None) -> str:
    if row.kind == "anchor" or not elements:
        return "-"
    return f"{row.changed_elements / elements:.3%}"


def chains(rows: list[ChainRow]) -> dict[int, tuple[int, int]]:
    """For each anchor step: the first and last step a subscriber holding it can reach by patches."""
    reach = {r.step: (r.step, r.step) for r in rows if r.kind == "anchor" and r.signer}
    for r in rows:
        if r.kind == "patch" and r.chains_from in reach:
            first, last = reach[r.chains_from]
            reach[r.chains_from] = (first, max(last, r.step))
    return reach


def _svg(rows: list[ChainRow], retired: list[RetiredRow], reach: dict[int, tuple[int, int]]) -> str:
    steps = [r.step for r in rows] + [r.step for r in retired]
    if not steps:
        return "<p>No steps in the store.</p>"
    low, high = min(steps), max(steps)
    span = max(high - low, 1)
    plot_width = _WIDTH - _LEFT - 20
    bar = max(min(plot_width / (span + 1) * 0.7, 18.0), 1.0)

    def x(step: int) -> float:
        return _LEFT + (step - low) / span * (plot_width - bar) + bar / 2

    sizes = [r.wire_bytes for r in rows if r.wire_bytes > 0]
    top_exp = math.ceil(math.log10(max(sizes))) if sizes else 1
    bottom_exp = min(math.floor(math.log10(min(sizes))), top_exp - 1) if sizes else 0

    def y(size: int) -> float:
        level = (math.log10(max(size, 1)) - bottom_exp) / (top_exp - bottom_exp)
        return _PLOT_TOP + _PLOT_HEIGHT * (1 - min(max(level, 0.0), 1.0))

    base = _PLOT_TOP + _PLOT_HEIGHT
    out = [f'<svg width="{_WIDTH}" height="{base + 60 + 16 * len(reach)}" ']
    out[0] += 'role="img" aria-label="timeline of the stream">'
    for exp in range(bottom_exp, top_exp + 1):
        out.append(f'<line x1="{_LEFT}" x2="{_WIDTH - 20}" y1="{y(10**exp):.1f}" y2="{y(10**exp):.1f}" class="grid"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{y(10**exp) + 4:.1f}" class="axis" text-anchor="end">1e{exp} B</text>')
    for r in rows:
        colour = _STATUS_COLOUR[_verdict(r)]
        tip = escape(
            f"step {r.step} {r.kind}: {r.wire_bytes:,} wire bytes, {r.changed_elements:,} changed, "
            f"ratio {r.ratio:.0f}x, {_STATUS_TEXT[_verdict(r)]}"
            + (f", chains from {r.chains_from}" if r.kind == "patch" else "")
        )
        top = y(r.wire_bytes)
        shape = "anchor" if r.kind == "anchor" else "patch"
        out.append(
            f'<rect class="{shape}" data-step="{r.step}" x="{x(r.step) - bar / 2:.1f}" y="{top:.1f}" '
            f'width="{bar:.1f}" height="{base - top:.1f}" fill="{colour}"><title>{tip}</title></rect>'
        )
        if r.kind == "anchor":
            out.append(f'<text x="{x(r.step):.1f}" y="{top - 4:.1f}" class="label" text-anchor="middle">A</text>')
    for t in retired:
        out.append(
            f'<rect class="retired" data-step="{t.step}" x="{x(t.step) - bar / 2:.1f}" y="{base - 8}" '
            f'width="{bar:.1f}" height="8"><title>step {t.step} {escape(t.kind)}: removed by retention at '
            f"{t.removed_at:%Y-%m-%d %H:%M:%S}Z</title></rect>"
        )
    present = set(steps)
    for step in range(low, high + 1):
        if step not in present:
            out.append(
                f'<rect class="gone" x="{x(step) - bar / 2:.1f}" y="{base - 3}" width="{bar:.1f}" height="3">'
                f"<title>step {step}: no marker (pruned, or never published)</title></rect>"
            )
    out.append(f'<line x1="{_LEFT}" x2="{_WIDTH - 20}" y1="{base}" y2="{base}" class="axis-line"/>')
    tick_every = max(1, 10 ** math.floor(math.log10(span + 1)) // 2 if span >= 20 else 1)
    for step in range(low, high + 1):
        if step % tick_every == 0:
            out.append(f'<text x="{x(step):.1f}" y="{base + 14}" class="axis" text-anchor="middle">{step}</text>')
    for i, (anchor, (first, last)) in enumerate(sorted(reach.items())):
        line_y = base + 34 + 16 * i
        out.append(
            f'<line class="chain" x1="{x(first):.1f}" x2="{x(last):.1f}" y1="{line_y}" y2="{line_y}">'
            f"<title>from anchor {anchor}: steps {first} to {last}</title></line>"
        )
        out.append(f'<circle cx="{x(first):.1f}" cy="{line_y}" r="4" class="chain-anchor"/>')
        out.append(f'<text x="{_LEFT - 6}" y="{line_y + 4}" class="axis" text-anchor="end">chain {anchor}</text>')
    out.append("</svg>")
    return "\n".join(out)


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #212529; }
h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #666; margin-bottom: 16px; }
.summary span { display: inline-block; margin-right: 20px; }
svg .grid { stroke: #eee; } svg .axis { font-size: 11px; fill: #555; } svg .label { font-size: 10px; fill: #000; }
svg .axis-line { stroke: #999; } svg .retired { fill: #f08c00; } svg .gone { fill: #adb5bd; }
svg .chain { stroke: #1c7ed6; stroke-width: 4; } svg .chain-anchor { fill: #1c7ed6; }
svg .anchor { stroke: #000; stroke-width: 1; }
.legend span { margin-right: 16px; } .legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; }
table { border-collapse: collapse; margin-top: 16px; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: right; }
th { background: #f8f9fa; position: sticky; top: 0; } td.l, th.l { text-align: left; }
tr.anchor td { background: #f1f3f5; } tr.bad td { color: #c92a2a; } tr.retired td { color: #f08c00; }
tr.gone td { color: #868e96; }
"""


def _fleet_table(fleet: Sequence[FleetStatus], now: dt.datetime, ttl_seconds: float) -> str:
    """Who serves which step, how far behind, and who went silent (advisory: each subscriber's own account)."""
    if not fleet:
        return '<p id="fleet">no subscriber status objects</p>'
    rows = []
    for f in fleet:
        age = max(f.age(now).total_seconds(), 0.0)
        gone = age > ttl_seconds
        rows.append(
            f'<tr class="{"gone" if gone else ""}"><td class="l">{escape(f.subscriber)}</td>'
            f"<td>{'-' if f.step is None else f.step}</td><td>{'-' if f.lag is None else f.lag}</td>"
            f'<td class="l">{escape(f.path or "-")}</td><td>{age:.0f} s</td>'
            f'<td class="l">{"gone" if gone else "live"}</td></tr>'
        )
    return (
        '<table id="fleet"><thead><tr><th class="l">subscriber</th><th>step</th><th>lag</th>'
        '<th class="l">last path</th><th>status age</th><th class="l">state</th></tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def render(
    rows: list[ChainRow],
    retired: list[RetiredRow],
    store_url: str,
    now: dt.datetime | None = None,
    fleet: Sequence[FleetStatus] = (),
    fleet_ttl: float = 600.0,
) -> str:
    """One HTML page: summary, timeline, legend, the fleet, and a table of every step."""
    now = now or dt.datetime.now(dt.timezone.utc)
    patches = [r for r in rows if r.kind == "patch"]
    anchors = [r for r in rows if r.kind == "anchor"]
    failed = [r for r in rows if _verdict(r) is False]
    elements = max((r.changed_elements for r in anchors), default=None)
    reach = chains(rows)
    summary = [
        f"{len(patches)} patches ({sum(r.wire_bytes for r in patches):,} bytes)",
        f"{len(anchors)} anchors ({sum(r.wire_bytes for r in anchors):,} bytes)",
        f"{len(retired)} removed by retention, payloads pending",
        f"{len(failed)} failed verification"
        if failed
        else "every marker verified"
        if rows and all(r.verified for r in rows)
        else "signatures not checked (no trusted key)",
    ]
    table: list[tuple[int, int, str]] = []  # (step, 0 for removed / 1 for present, row): in step order
    for r in rows:
        classes = " ".join(c for c, on in (("anchor", r.kind == "anchor"), ("bad", _verdict(r) is False)) if on)
        chain = "-" if r.kind == "anchor" else "broken" if r.chains_from is None else str(r.chains_from)
        status = _STATUS_TEXT[_verdict(r)] + (f": {r.error}" if r.error else "")
        table.append(
            (
                r.step,
                1,
                f'<tr class="{classes}" data-step="{r.step}"><td>{r.step}</td><td class="l">{r.kind}</td>'
                f"<td>{'-' if r.base_step is None else r.base_step}</td><td>{chain}</td><td>{r.wire_bytes:,}</td>"
                f"<td>{r.changed_elements:,}</td><td>{_density(r, elements)}</td><td>{r.ratio:.0f}x</td>"
                f'<td class="l">{escape(r.signer[:16])}</td><td class="l">{escape(status)}</td></tr>',
            )
        )
    for t in retired:
        status = "removed by retention" + (f": {t.error}" if t.error else "")
        table.append(
            (
                t.step,
                0,
                f'<tr class="retired" data-step="{t.step}"><td>{t.step}</td><td class="l">{escape(t.kind)}</td>'
                f"<td>-</td><td>-</td><td>{t.payload_bytes:,}</td><td>-</td><td>-</td><td>-</td><td></td>"
                f'<td class="l">{escape(status)} at {t.removed_at:%Y-%m-%d %H:%M:%S}Z</td></tr>',
            )
        )
    chain_lines = "".join(
        f"<li>from anchor {a}: steps {first} to {last} ({last - first} patches)</li>"
        for a, (first, last) in sorted(reach.items())
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<title>pulsesync chain: {escape(store_url)}</title><style>{_CSS}</style></head>
<body>
<h1>pulsesync chain</h1>
<div class="sub">{escape(store_url)} &middot; generated {now:%Y-%m-%d %H:%M:%S}Z by pulsesync inspect --html</div>
<div class="summary">{"".join(f"<span>{escape(s)}</span>" for s in summary)}</div>
<div class="legend">
{"".join(f'<span><i style="background:{_STATUS_COLOUR[v]}"></i>{t}</span>' for v, t in _LEGEND.items())}
<span><i style="background:#f08c00"></i>tombstoned</span>
<span><i style="background:#adb5bd"></i>no marker (pruned)</span>
<span><i style="background:#1c7ed6"></i>chain from an anchor</span>
<span>bar height: wire bytes (log scale); A: anchor</span>
</div>
{_svg(rows, retired, reach)}
<h2>Chains a subscriber can take</h2><ul id="chains">{chain_lines or "<li>none: no anchor</li>"}</ul>
<h2>Fleet (each subscriber's own status object; gone: silent for {fleet_ttl:.0f} s)</h2>
{_fleet_table(fleet, now, fleet_ttl)}
<table id="steps"><thead><tr><th>step</th><th class="l">kind</th><th>base</th><th>chain</th><th>wire bytes</th>
<th>changed</th><th>density</th><th>ratio</th><th class="l">signer</th><th class="l">status</th></tr></thead>
<tbody>
{chr(10).join(html for _, _, html in sorted(table))}
</tbody></table>
</body></html>
"""
