"""Value plane 0 plain (codecs 4 and 5) against paired (codecs 6 and 7): size and CPU time.

    python benchmarks/planes.py [--out DIR] [--lrs 1e-6 1e-5] [--ks 1 16] [--blocks 4]

The delta codecs store the zigzag bytes of the moves as byte planes, each one zstd frame whose
literals zstd codes with Huffman codes. In Adam steps most moves are one unit up or down, so the
low plane is mostly two symbols of nearly equal frequency, and a Huffman code, whose lengths are
whole bits, stays well above that plane's entropy. Codecs 6 and 7 code two low bytes as one
symbol (both below 15: 15 a + b; else an escape symbol, 225, with the two bytes in a frame of
their own), which halves the symbols and brings the code close to the entropy (docs/FORMAT.md).

For each chain pair (those of benchmarks/run.py, built or reused in OUT/chains) it takes
``--blocks`` evenly spaced 8 MiB blocks of the data region and prints, in bits per changed
word: the low plane's order-0 entropy (per block), the plane plain and as the codec writes it
(paired, unless pairing does not pay there); the high plane; then the CPU time per change of
compressing and of decompressing the low plane both ways (best of ``--rounds``), with the
codec's own functions (``pulsectl.codecs._bits``: the compiled loops where built). Each plane
is decoded again and checked.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def entropy_bits(symbols: Any) -> float:
    """Order-0 empirical entropy of a uint8 array, in bits in all."""
    import numpy as np

    counts = np.bincount(symbols, minlength=256)
    p = counts[counts > 0] / symbols.size
    return float(-(p * np.log2(p)).sum() * symbols.size)


def best_time(fn: Callable[[], Any], rounds: int) -> float:
    """The least thread CPU time of ``rounds`` calls of ``fn``."""
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t)
    return best


def measure(pairs: list[tuple[Path, Path]], nblocks: int, rounds: int) -> list[dict[str, float]]:
    import numpy as np

    from benchmarks.chains import sample_blocks
    from pulsectl import _zstd
    from pulsectl.codecs._bits import (
        compress_plane,
        paired_plane,
        raw_planes,
        unpack_paired_plane,
    )

    rows = []
    for old_path, new_path in pairs:
        sums = dict.fromkeys(
            ("changed", "entropy", "plain", "paired", "high", "enc0", "enc1", "dec0", "dec1"), 0.0
        )
        for old8, new8 in sample_blocks(old_path, new_path, nblocks):
            old, new = old8.view(np.uint16), new8.view(np.uint16)
            pos = np.flatnonzero(old != new)
            if pos.size == 0:
                continue
            low_plane, high = raw_planes(new[pos] - old[pos], 2)  # as the codecs compute them
            low = memoryview(low_plane)
            plain = compress_plane(low, 3)
            paired = paired_plane(low, 3)
            sums["enc0"] += best_time(partial(compress_plane, low, 3), rounds)
            sums["enc1"] += best_time(partial(paired_plane, low, 3), rounds)
            plain_unpack = partial(_zstd.decompress, plain, pos.size)
            if paired is None:  # the codec keeps plane 0 plain here
                paired, unpack = plain, plain_unpack
            else:
                unpack = partial(unpack_paired_plane, memoryview(paired), pos.size)
            if not plain or unpack() != low.tobytes():
                sys.exit(f"plane 0 did not decode back on {new_path}")
            sums["dec0"] += best_time(plain_unpack, rounds)
            sums["dec1"] += best_time(unpack, rounds)
            sums["changed"] += pos.size
            sums["entropy"] += entropy_bits(np.frombuffer(low, np.uint8))
            sums["plain"] += 8 * len(plain)
            sums["paired"] += 8 * len(paired)
            sums["high"] += 8 * len(compress_plane(memoryview(high), 3))
        n = sums.pop("changed")
        rows.append(
            {
                **{k: v / n for k, v in sums.items() if not k.startswith(("enc", "dec"))},
                **{k: v / n * 1e9 for k, v in sums.items() if k.startswith(("enc", "dec"))},
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
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    pairs = run_pairs(args.out / "chains", args.preset, args.lrs, args.ks)
    rows = measure([(old, new) for _, old, new in pairs], args.blocks, args.rounds)
    print("bits per change; CPU ns per change (best of --rounds)")
    print(
        f"{'pair':<16} {'low: entropy':>12} {'plain':>7} {'paired':>7} {'saved':>6}  "
        f"{'high':>6}  {'compress: plain':>15} {'paired':>7}  {'decompress: plain':>17} "
        f"{'paired':>7}"
    )
    for (label, _, _), r in zip(pairs, rows, strict=True):
        print(
            f"{label:<16} {r['entropy']:>12.3f} {r['plain']:>7.3f} {r['paired']:>7.3f} "
            f"{(r['plain'] - r['paired']) / 8:>5.3f}B  {r['high']:>6.3f}  "
            f"{r['enc0']:>15.2f} {r['enc1']:>7.2f}  {r['dec0']:>17.2f} {r['dec1']:>7.2f}"
        )


if __name__ == "__main__":
    main()
