"""Position coding comparison: bytes per changed element of candidate gap codings on the codec workloads.

Candidates (each per 4M-element chunk, gaps p[i] - p[i-1] - 1): gap codes (format 2's GAP_CODES:
a code byte per gap, its low bits in an extra-bits stream, each part compressed on its own),
u16 in two byte planes (format 1's GAPS16), u16 interleaved, u8 with u32 escapes, LEB128 varints
(each + zstd-1), and Rice codes with the best parameter per chunk (exact bit count, no zstd),
against the order-0 entropy of the gaps; on both workloads of bench/codec.py.

    python bench/positions.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from codec import make_steps  # the codec benchmark's workloads
from counting import unique_counts

from pulsesync.codec.codings import gap_codes

CHUNK = 1 << 22


def leb128(gaps: np.ndarray) -> bytes:
    """Unsigned LEB128 of every gap, vectorized."""
    nbytes = 1 + sum((gaps >= 1 << (7 * k)).astype(np.int64) for k in range(1, 9))
    out = np.zeros(int(nbytes.sum()), np.uint8)
    starts = np.cumsum(nbytes) - nbytes
    for k in range(int(nbytes.max(initial=1))):
        m = nbytes > k
        out[starts[m] + k] = ((gaps[m] >> (7 * k)) & 0x7F) | np.where(nbytes[m] > k + 1, 0x80, 0)
    return out.tobytes()


def sizes(gaps: np.ndarray, z: zstandard.ZstdCompressor) -> dict[str, int]:
    escapes = 8 * int((gaps >= 0xFFFF).sum())
    g16 = np.minimum(gaps, 0xFFFF).astype(np.uint16)
    g8 = np.minimum(gaps, 255).astype(np.uint8)
    codes, extra = gap_codes.encode_gap_codes(np.cumsum(gaps + 1) - 1)
    return {
        "gap codes + zstd (pulsesync format 2)": len(z.compress(codes.tobytes())) + len(z.compress(extra)),
        "u16 byte planes + zstd (format 1)": len(z.compress(g16.view(np.uint8).reshape(-1, 2).T.tobytes())) + escapes,
        "u16 interleaved + zstd": len(z.compress(g16.tobytes())) + escapes,
        "u8 + u32 escapes + zstd": len(z.compress(g8.tobytes() + gaps[gaps >= 255].astype(np.uint32).tobytes())),
        "LEB128 + zstd": len(z.compress(leb128(gaps))),
        "LEB128 (no zstd)": len(leb128(gaps)),
        "Rice, best k per chunk": math.ceil(min(int((gaps >> k).sum()) + (1 + k) * gaps.size for k in range(20)) / 8),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    out = {workload: measure(workload) for workload in ("synthetic", "real-like")}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def measure(workload: str) -> dict[str, float]:
    """Bytes per changed element of each coding on one workload; prints its table."""
    steps = make_steps(workload, [1e-6, 3e-6], 512, 4, warmup=12, measured=1, seed=0)
    z = zstandard.ZstdCompressor(level=1)
    totals: dict[str, int] = {}
    all_gaps = []
    for s in steps:
        for name, new in s.new.items():
            a, b = s.old[name].reshape(-1).view(torch.int16).numpy(), new.reshape(-1).view(torch.int16).numpy()
            for start in range(0, a.size, CHUNK):
                pos = np.flatnonzero(a[start : start + CHUNK] != b[start : start + CHUNK])
                if pos.size:
                    gaps = np.diff(pos, prepend=-1) - 1
                    all_gaps.append(gaps)
                    for k, v in sizes(gaps, z).items():
                        totals[k] = totals.get(k, 0) + v
    changes = sum(g.size for g in all_gaps)
    _, counts = unique_counts(np.concatenate(all_gaps))
    p = counts / counts.sum()
    result = {k: v / changes for k, v in sorted(totals.items(), key=lambda kv: kv[1])}
    result["order-0 entropy"] = float(-(p * np.log2(p)).sum() / 8)
    print(f"[{workload}] {changes:,} changed elements over {len(steps)} steps; bytes per changed element:")
    for k, v in result.items():
        print(f"  {k:<38} {v:.3f}")
    return result


if __name__ == "__main__":
    main()
