"""Three regions on three SeaweedFS servers: an origin, a lying mirror, a lagging one, 30 subscribers
(bench/fanout.py's run over 30 steps, without its no-mirror baseline): every state served verified, the
origin's egress per patch byte the mirrors' copies plus the fallbacks' (the bench enforces its bound)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import fanout

pytestmark = pytest.mark.integration


async def test_subscribers_in_two_regions_are_bit_exact_past_a_lying_and_a_lagging_mirror() -> None:
    args = fanout.settings(quick=True)
    args.steps, args.lies = 30, [8, 16, 24]  # the bench's contract needs its 60 steps; these checks do not
    result = await fanout.measure(args, baseline=False)
    run = result["runs"]["mirrored"]
    assert result["subscribers"] >= 30
    assert run["unverified_served"] == 0  # every state every subscriber served was the trainer's, bit for bit
    # Each lie sent the lying region's subscribers to the origin for the sync it spoiled, and only them:
    # the lagging mirror stayed within max_lag_seconds.
    assert run["fallbacks"]["a"] >= 3 * args.liar_region and run["fallbacks"]["b"] == 0
    # What left the origin: each mirror's copy of each patch (the withholding one copies the withheld step
    # again until the next lands), the patches of the spoiled syncs, and markers and listings.
    share = {kind: sent / run["patch_bytes"] for kind, sent in run["egress_by_kind"].items()}
    assert 2.0 <= share["mirrors: patches"] <= 2.1
    # Each fallback fetched patches only, never an anchor (~127 patches here): a few, as a subscriber some
    # steps behind (more on a loaded machine) chains them.
    assert 0 < share["subscribers: patches"] <= 4 * run["fallbacks"]["a"] / args.steps
    assert sum(v for k, v in share.items() if not k.endswith("patches")) <= 0.15
    assert result["origin_egress_over_patch"] == pytest.approx(sum(share.values()))
