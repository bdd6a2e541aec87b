"""An experiment on the value planes: what pairing the low bytes of the moves would save.

    python benchmarks/planes.py [--out DIR] [--lrs 1e-6 1e-5] [--ks 1 16] [--blocks 4]

Codecs 3, 4 and 5 store the zigzag bytes of the moves as byte planes, each one zstd frame whose
literals zstd codes with Huffman codes. In Adam steps most moves are one unit up or down, so the
low plane is mostly two symbols of nearly equal frequency, and a Huffman code, whose lengths are
whole bits, stays well above that plane's entropy. Coding two low bytes as one symbol (both
below 15: 15 a + b; else an escape symbol, 225, with the two bytes in a stream of their own)
halves the symbols and brings the code close to the entropy.

For each chain pair (those of benchmarks/run.py, built or reused in OUT/chains) it takes
``--blocks`` evenly spaced 8 MiB blocks of the data region and prints, in bits per changed
word: the low plane's order-0 entropy (per block), the plane as pulsectl stores it now, and
paired; the high plane as stored now; and the CPU time of compressing the low plane both ways.
Each paired plane is decoded again and checked against the plane. This experiment led to codecs
6 and 7 (docs/FORMAT.md), which store plane 0 so; it still measures the plain form against the
paired one, with its own numpy pairing (the codecs use compiled loops).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SMALL = 15  # low bytes below this pair up: 15 * 15 = 225 pair symbols
ESCAPE = SMALL * SMALL


def entropy_bits(symbols: Any) -> float:
    """Order-0 empirical entropy of a uint8 array, in bits in all."""
    import numpy as np

    counts = np.bincount(symbols, minlength=256)
    p = counts[counts > 0] / symbols.size
    return float(-(p * np.log2(p)).sum() * symbols.size)


def pair_up(low: Any) -> tuple[Any, Any]:
    """The pair symbols of a low plane (zero-padded to an even length) and the escape bytes."""
    import numpy as np

    padded = np.concatenate([low, np.zeros(low.size % 2, dtype=np.uint8)])
    a, b = padded[0::2].astype(np.int32), padded[1::2].astype(np.int32)
    small = (a < SMALL) & (b < SMALL)
    symbols = np.where(small, SMALL * a + b, ESCAPE).astype(np.uint8)
    escapes = np.stack([a[~small], b[~small]], axis=1).astype(np.uint8).ravel()
    return symbols, escapes


def unpair(symbols: Any, escapes: Any, count: int) -> Any:
    import numpy as np

    out = np.empty(2 * symbols.size, dtype=np.uint8)
    out[0::2] = symbols // SMALL
    out[1::2] = symbols % SMALL
    at = np.flatnonzero(symbols == ESCAPE)
    out[2 * at] = escapes[0::2]
    out[2 * at + 1] = escapes[1::2]
    return out[:count]


def measure(pairs: list[tuple[Path, Path]], nblocks: int) -> list[dict[str, float]]:
    import numpy as np

    from benchmarks.chains import sample_blocks
    from pulsectl import _zstd

    def packed(plane: Any) -> int:
        return len(_zstd.compress_plane(plane, 3)) if plane.any() else 0

    rows = []
    for old_path, new_path in pairs:
        sums = dict.fromkeys(
            ("changed", "entropy", "now", "paired", "high", "t_now", "t_pair"), 0.0
        )
        for old8, new8 in sample_blocks(old_path, new_path, nblocks):
            old, new = old8.view(np.uint16), new8.view(np.uint16)
            pos = np.flatnonzero(old != new)
            if pos.size == 0:
                continue
            moved = (new[pos] - old[pos]).view(np.int16)
            zigzag = ((moved << 1) ^ (moved >> 15)).view(np.uint16)
            low = (zigzag & 0xFF).astype(np.uint8)
            high = (zigzag >> 8).astype(np.uint8)
            t = time.thread_time()
            now = packed(low)
            sums["t_now"] += time.thread_time() - t
            t = time.thread_time()
            symbols, escapes = pair_up(low)
            paired = packed(symbols) + packed(escapes)
            sums["t_pair"] += time.thread_time() - t
            if not np.array_equal(unpair(symbols, escapes, low.size), low):
                sys.exit(f"pairing lost bytes on {new_path}")
            sums["changed"] += pos.size
            sums["entropy"] += entropy_bits(low)
            sums["now"] += 8 * now
            sums["paired"] += 8 * paired
            sums["high"] += 8 * packed(high)
        n = sums["changed"]
        rows.append(
            {
                "changed": n,
                "entropy": sums["entropy"] / n,
                "now": sums["now"] / n,
                "paired": sums["paired"] / n,
                "high": sums["high"] / n,
                "ns_now": sums["t_now"] / n * 1e9,
                "ns_pair": sums["t_pair"] / n * 1e9,
            }
        )
    return rows


def main() -> None:
    from benchmarks.chains import RUN_KS, RUN_LRS, run_pairs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/pulsectl-bench"))
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--lrs", type=float, nargs="+", default=list(RUN_LRS))
    ap.add_argument("--ks", type=int, nargs="+", default=list(RUN_KS))
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()

    pairs = run_pairs(args.out / "chains", args.preset, args.lrs, args.ks)
    rows = measure([(old, new) for _, old, new in pairs], args.blocks)
    print(
        f"{'pair':<16} {'low: entropy':>12} {'stored':>7} {'paired':>7} {'saved':>6}  "
        f"{'high: stored':>12}  {'compress ns/chg: now':>20} {'paired':>7}   (bits per change)"
    )
    for (label, _, _), r in zip(pairs, rows, strict=True):
        print(
            f"{label:<16} {r['entropy']:>12.3f} {r['now']:>7.3f} {r['paired']:>7.3f} "
            f"{(r['now'] - r['paired']) / 8:>5.3f}B  {r['high']:>12.3f}  "
            f"{r['ns_now']:>20.2f} {r['ns_pair']:>7.2f}"
        )


if __name__ == "__main__":
    main()
