"""The codecs' compiled inner loops alone, in nanoseconds per word, on real 8 MiB blocks.

    python benchmarks/loops.py [--out DIR] [--lrs 1e-6 1e-5] [--ks 1 16] [--blocks 4]
                               [--rounds 5] [--against OTHER_CHECKOUT]

For each chain pair (the chains of benchmarks/run.py, built or reused in OUT/chains) it takes
``--blocks`` evenly spaced 8 MiB blocks of the data region and times, on each, the codec loops
that the default level spends its time in, ``rice_encode`` (diff: the Rice streams of the
changed positions) and ``rice_scatter`` (apply: codec 5's streams and raw value planes decoded
into a copy of the base block), and those of `--level max`, ``context_encode`` and
``context_scatter`` (codec 4, likewise), with the payloads made beforehand. Figures are CPU
time of this thread (not wall time: other work on a shared machine moves that more), the best
of ``--rounds`` calls on each block, summed over the blocks and divided by their words.

``--against DIR`` loads the compiled extension of another checkout DIR (built in place:
``python setup.py build_ext --inplace``) into this process beside this checkout's, and calls
the two in turn on the same block, round by round: the way to measure a change to
pulsectl/_speedups.c against the code before it. Both must give the same streams and payloads
and the same rebuilt blocks. (Timing the other checkout in a child process instead, as this
script once did, moved figures of identical code by up to a fifth between the two on a shared
2-core machine; calls in turn in one process agree within a few per cent.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's idle BLAS threads spin otherwise

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LOOPS = ("rice_encode", "rice_scatter", "context_encode", "context_scatter")


def load_extension(checkout: Path) -> Any:
    """The compiled extension of another checkout, under a name of its own."""
    found = sorted((checkout / "pulsectl").glob("_speedups*.so")) + sorted(
        (checkout / "pulsectl").glob("_speedups*.pyd")
    )
    if not found:
        sys.exit(
            f"{checkout}/pulsectl has no compiled extension: build it in place there "
            "(python setup.py build_ext --inplace)"
        )
    spec = importlib.util.spec_from_file_location("pulsectl_against._speedups", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from pulsectl.errors import CorruptPatchError

    module.set_corrupt_error(CorruptPatchError)
    return module


def measure(
    pairs: list[tuple[Path, Path]], nblocks: int, rounds: int, builds: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per pair: the share of changed words, and ns per word of each loop of each build."""
    import numpy as np

    from benchmarks.chains import sample_blocks

    rows = []
    for old_path, new_path in pairs:
        spent = {loop: dict.fromkeys(builds, 0.0) for loop in LOOPS}
        words = changed = 0
        for old, new in sample_blocks(old_path, new_path, nblocks):
            pos = np.flatnonzero(old.view(np.uint16) != new.view(np.uint16)).astype(np.int64)
            if pos.size == 0:
                continue
            best = _time_block(old, new, pos, rounds, builds, new_path)
            for loop in LOOPS:
                for name in builds:
                    spent[loop][name] += best[loop][name]
            words += old.size // 2
            changed += pos.size
        row: dict[str, Any] = {"changed": changed / words}
        for loop in LOOPS:
            row[loop] = {n: v / words * 1e9 for n, v in spent[loop].items()}
        rows.append(row)
    return rows


def _time_block(
    old: Any, new: Any, pos: Any, rounds: int, builds: dict[str, Any], new_path: Path
) -> dict[str, dict[str, float]]:
    """The best CPU seconds of each loop of each build on one block (BF16 words); exits if
    two builds disagree or a scatter does not rebuild ``new``."""
    import numpy as np

    from pulsectl.codecs import context
    from pulsectl.codecs._bits import value_plane_bytes

    key = context.KEYS["BF16"]
    payload, _ = context.encode(old, new, 2, pos, key, 19)
    view, count, shift, bits, keys, ks, counts, unary, remainder, offset = context._parse(
        payload, 2, old.size // 2
    )
    planes = tuple(
        None if p is None else bytes(p) for p in value_plane_bytes(view, offset, count, 2)
    )
    # Codec 5's value planes before compression: the zigzag bytes of the moves.
    moved = (new.view(np.uint16)[pos] - old.view(np.uint16)[pos]).view(np.int16)
    zigzag = ((moved << 1) ^ (moved >> 15)).view(np.uint16)
    raw = ((zigzag & 0xFF).astype(np.uint8).tobytes(), (zigzag >> 8).astype(np.uint8).tobytes())
    block = old.copy()
    best = {loop: dict.fromkeys(builds, float("inf")) for loop in LOOPS}
    first: dict[str, Any] = {}

    def note(loop: str, name: str, since: float, got: Any = None) -> None:
        best[loop][name] = min(best[loop][name], time.thread_time() - since)
        if got is not None and first.setdefault(loop, got) != got:
            sys.exit(f"{loop} of {name} gave other bytes on {new_path}")
        if loop.endswith("scatter") and block.tobytes() != new.tobytes():
            sys.exit(f"{loop} of {name} did not rebuild a block of {new_path}")

    for _ in range(rounds):
        for name, fast in builds.items():
            t = time.thread_time()
            k, rice_unary, rice_remainder = streams = fast.rice_encode(pos)
            note("rice_encode", name, t, streams)
            block[:] = old
            t = time.thread_time()
            fast.rice_scatter(block, rice_unary, rice_remainder, pos.size, k, raw, 2)
            note("rice_scatter", name, t)
            t = time.thread_time()
            got = fast.context_encode(old, new, 2, key[0], key[1], pos)
            note("context_encode", name, t, tuple(bytes(part) for part in got))
            block[:] = old
            t = time.thread_time()
            fast.context_scatter(block, 2, shift, bits, keys, ks, counts, unary, remainder, planes)
            note("context_scatter", name, t)
    return best


def main() -> None:
    from benchmarks.chains import RUN_LRS, run_pairs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/pulsectl-bench"))
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--lrs", type=float, nargs="+", default=list(RUN_LRS))
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", type=Path, default=None)
    args = ap.parse_args()

    from pulsectl.cli.entry import _keep_freed_memory
    from pulsectl.codecs import _fast

    _keep_freed_memory()  # as the command-line tool does: no fresh pages for each block's buffers
    if _fast.native is None:
        sys.exit("the compiled loops are not built (pip install -e . with a C compiler)")
    builds = {"this checkout": _fast.native}
    if args.against:
        builds[str(args.against)] = load_extension(args.against)
    pairs = run_pairs(args.out / "chains", args.preset, args.lrs, args.ks)
    rows = measure([(old, new) for _, old, new in pairs], args.blocks, args.rounds, builds)
    labels = [label for label, _, _ in pairs]
    names = list(builds)
    print(f"{'pair':<16} {'changed':>8}  " + "  ".join(f"{n[-24:]:>24}" for n in names))
    for loop in LOOPS:
        print(f"{loop} (ns per word, best of {args.rounds} per block)")
        for label, row in zip(labels, rows, strict=True):
            figs = "  ".join(f"{row[loop][n]:>24.3f}" for n in names)
            print(f"{label:<16} {row['changed']:>8.3%}  {figs}")


if __name__ == "__main__":
    main()
