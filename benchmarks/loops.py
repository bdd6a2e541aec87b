"""The codecs' compiled inner loops alone, in nanoseconds per word, on real 8 MiB blocks.

    python benchmarks/loops.py [--out DIR] [--lrs 1e-6 1e-5] [--ks 1 16] [--blocks 4]
                               [--rounds 5] [--against OTHER_CHECKOUT]

For each chain pair (the chains of benchmarks/run.py, built or reused in OUT/chains) it takes
``--blocks`` evenly spaced 8 MiB blocks of the data region and times, on each, the loops that
`--level max` spends its time in: ``context_encode`` (diff) and ``context_scatter`` (apply, in
place on a copy of the base block), with codec 4's payload made beforehand. Figures are CPU
time of this thread (not wall time: other work on a shared machine moves that more), the best
of ``--rounds``, summed over the blocks and divided by their words.

``--against DIR`` runs the same in a child Python that imports pulsectl from DIR (another
checkout, with its extension built in place: ``python setup.py build_ext --inplace``), round
by round in turn with this checkout, and prints both: the way to measure a change to
pulsectl/_speedups.c against the code before it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's idle BLAS threads spin otherwise

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
if "--import-from" in sys.argv:  # the child of --against: pulsectl from that checkout
    sys.path.insert(0, sys.argv[sys.argv.index("--import-from") + 1])

BLOCK = 8 << 20
# The chains of benchmarks/run.py (its LRS and KS): asking for other steps would rebuild them.
RUN_STEPS = (1, 4, 16)


def measure(pairs: list[tuple[Path, Path]], nblocks: int) -> list[dict[str, float]]:
    """One round: per pair, ns per word of each loop and the share of changed words."""
    import numpy as np

    from benchmarks.tensors import data_region
    from pulsectl.codecs import _fast, context
    from pulsectl.codecs._bits import value_plane_bytes

    fast = _fast.native
    if fast is None:
        sys.exit("the compiled loops are not built (pip install -e . with a C compiler)")
    key = context.KEYS["BF16"]
    rows = []
    for old_path, new_path in pairs:
        start, end = data_region(new_path)
        a = np.memmap(old_path, dtype=np.uint8, mode="r")
        b = np.memmap(new_path, dtype=np.uint8, mode="r")
        enc = dec = 0.0
        words = changed = 0
        for at in np.linspace(start, end - BLOCK, nblocks).astype(np.int64):
            at = int(at) // 2 * 2
            old, new = np.array(a[at : at + BLOCK]), np.array(b[at : at + BLOCK])
            pos = np.flatnonzero(old.view(np.uint16) != new.view(np.uint16)).astype(np.int64)
            if pos.size == 0:
                continue
            t = time.thread_time()
            fast.context_encode(old, new, 2, key[0], key[1], pos)
            enc += time.thread_time() - t
            payload = context.encode(old, new, 2, pos, key, 19)
            view, count, shift, bits, keys, ks, counts, unary, remainder, offset = context._parse(
                payload, 2, old.size // 2
            )
            planes = tuple(
                None if p is None else bytes(p) for p in value_plane_bytes(view, offset, count, 2)
            )
            block = old.copy()
            t = time.thread_time()
            fast.context_scatter(block, 2, shift, bits, keys, ks, counts, unary, remainder, planes)
            dec += time.thread_time() - t
            if block.tobytes() != new.tobytes():
                sys.exit(f"context_scatter did not rebuild a block of {new_path}")
            words += old.size // 2
            changed += pos.size
        rows.append(
            {
                "changed": changed / words,
                "context_encode_ns": enc / words * 1e9,
                "context_scatter_ns": dec / words * 1e9,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/pulsectl-bench"))
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", type=Path, default=None)
    ap.add_argument("--import-from", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from benchmarks.chains import ensure_chain, step_path

    pairs = []
    for lr in args.lrs:
        steps = (*RUN_STEPS, *args.ks)
        d = ensure_chain(args.out / "chains", args.preset, lr, max(steps), {0, *steps})
        pairs += [(step_path(d, 0), step_path(d, k)) for k in args.ks]
    if args.import_from:  # one round, for a parent that compares checkouts
        import pulsectl

        if Path(pulsectl.__file__).resolve().parent.parent != args.import_from.resolve():
            sys.exit(f"pulsectl was imported from {pulsectl.__file__}, not {args.import_from}")
        print(json.dumps(measure(pairs, args.blocks)))
        return
    labels = [f"lr {lr:g} k {k}" for lr in args.lrs for k in args.ks]
    names = ["this checkout"] + ([str(args.against)] if args.against else [])
    best: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for name in names:
            if name == "this checkout":
                got = measure(pairs, args.blocks)
            else:
                child = [sys.executable, __file__, "--import-from", str(args.against)]
                child += ["--blocks", str(args.blocks), "--out", str(args.out)]
                child += ["--preset", args.preset, "--ks", *map(str, args.ks)]
                child += ["--lrs", *map(str, args.lrs)]
                done = subprocess.run(child, check=True, capture_output=True, text=True)
                got = json.loads(done.stdout)
            have = best.setdefault(name, got)
            for h, g in zip(have, got, strict=True):
                for k in ("context_encode_ns", "context_scatter_ns"):
                    h[k] = min(h[k], g[k])
    print(f"{'pair':<16} {'changed':>8}  " + "  ".join(f"{n[-24:]:>24}" for n in names))
    for loop in ("context_encode_ns", "context_scatter_ns"):
        print(f"{loop[:-3]} (ns per word, best of {args.rounds})")
        for i, label in enumerate(labels):
            figs = "  ".join(f"{best[n][i][loop]:>24.3f}" for n in names)
            print(f"{label:<16} {best[names[0]][i]['changed']:>8.3%}  {figs}")


if __name__ == "__main__":
    main()
