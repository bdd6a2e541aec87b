"""ParaBlock benchmark: a patch arriving over a rate-limited link, received then applied
(sequential) against applied while it streams in (overlapped), and block patches.

    python benchmarks/overlap.py [--size-mb 1024] [--rates 2,5,match,25,100,400] [--out DIR]

It writes a pair of BF16 checkpoints (N(0, 0.02) weights, ~1% of the words moved by one unit,
like one RL step), makes the patch, then for each rate R (MB/s) measures:

- transfer: the patch pushed through a pipe at R (a paced writer process), read to a file;
- compute: `pulsectl apply` from a local file (measured beside each rate);
- sequential: transfer, then apply from the file;
- overlapped: `pulsectl apply BASE -` reading the paced pipe;
- ideal: max(transfer, compute).

The rate `match` is the one at which transfer takes as long as compute (the patch's size over
the median of three local applies, measured first), where overlap saves the most: the fixed
rates alone would miss that case whenever `apply` gets faster or slower.

and, once, a chain of block patches (`diff --blocks 4`) against the single patch. Results go
to stdout as a table and to OUT/overlap.json; with `--doc docs/OVERLAP.md`, as the Markdown
that README quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import measure  # noqa: E402
from pulsectl.checkpoint import save_safetensors  # noqa: E402

PACER = r"""
import sys, time
path, rate = sys.argv[1], float(sys.argv[2]) * 1e6
chunk = 64 * 1024
out = sys.stdout.buffer
start = time.perf_counter()
sent = 0
with open(path, "rb") as f:
    while True:
        data = f.read(chunk)
        if not data:
            break
        out.write(data)
        out.flush()
        sent += len(data)
        delay = start + sent / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
"""


def make_pair(root: Path, size_mb: int, seed: int = 0) -> tuple[Path, Path]:
    """Two single-file checkpoints of 4096-wide BF16 matrices, ~1% of words moved by +-1."""
    a, b = root / "a.safetensors", root / "b.safetensors"
    if a.exists() and b.exists():
        return a, b
    rng = np.random.default_rng(seed)
    # 4096 x 4096 matrices, or at least 4 smaller ones: `diff --blocks 4` below needs 4 layers
    # (below 128 MB there were fewer, and the run ended in a traceback).
    words = size_mb * 1024 * 1024 // 2
    layers = max(4, words // (4096 * 4096))
    rows = max(1, min(4096, words // (layers * 4096)))
    per_tensor = rows * 4096
    old: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    new: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for i in range(layers):
        w = rng.normal(0, 0.02, per_tensor).astype(np.float32).view(np.uint32)
        words = ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16)
        moved = words.copy()
        mask = rng.random(per_tensor) < 0.01
        moved[mask] += np.where(rng.random(int(mask.sum())) < 0.5, 1, 0xFFFF).astype(np.uint16)
        name = f"model.layers.{i}.mlp.up_proj.weight"
        old[name] = ("BF16", (rows, 4096), words)
        new[name] = ("BF16", (rows, 4096), moved)
    save_safetensors(a, old)
    save_safetensors(b, new)
    return a, b


def settle(*outputs: Path) -> None:
    """Every timed run starts alike: no old output to unlink, no dirty pages to write back."""
    for path in outputs:
        path.unlink(missing_ok=True)
    os.sync()


def run(cmd: list[str], **kw) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    return time.perf_counter() - t0


def paced(patch: Path, rate: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PACER, str(patch), str(rate)], stdout=subprocess.PIPE
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument(
        "--rates",
        default="2,5,match,25,100,400",
        help="MB/s, comma-separated; `match`: the rate at which transfer takes as long as apply",
    )
    parser.add_argument(
        "--out", type=Path, default=Path(tempfile.gettempdir()) / "pulsectl-bench" / "overlap"
    )
    parser.add_argument("--repeat", type=int, default=7, help="runs per figure (median kept)")
    parser.add_argument(
        "--doc", type=Path, help="also write the results as Markdown here (docs/OVERLAP.md)"
    )
    args = parser.parse_args()
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    pulsectl = shutil.which("pulsectl") or sys.exit("pulsectl is not on PATH (pip install -e .)")

    measure.byte_compile_pulsectl()  # pulsectl's .pyc files, as an installed tool has them
    a, b = make_pair(args.out, args.size_mb)
    patch = args.out / "p.pulse"
    run([pulsectl, "-q", "diff", str(a), str(b), "-o", str(patch), "-f"])
    out = args.out / "out.safetensors"
    received = args.out / "received.pulse"
    for f in (a, b, patch):
        f.read_bytes()  # page cache, as for every run below

    def in_turn(*fns: Callable[[], float]) -> list[list[float]]:
        """``--repeat`` runs of each, taken in turn in every round (so a machine that drifts
        during the benchmark moves all four figures of a rate alike), each list sorted."""
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(args.repeat):
            for fn, got in zip(fns, times, strict=True):
                settle(out, received)
                got.append(fn())
        return [sorted(got) for got in times]

    def median(runs: list[float]) -> float:
        return runs[len(runs) // 2]

    def apply_local() -> float:
        return run([pulsectl, "-q", "apply", str(a), str(patch), "-o", str(out), "-f"])

    apply_local()  # warm-up: the first apply after writing the inputs runs slower
    rates = []
    for r in args.rates.split(","):
        if r.strip() == "match":
            computes = []
            for _ in range(3):
                settle(out, received)
                computes.append(apply_local())
            rates.append(round(patch.stat().st_size / 1e6 / sorted(computes)[1], 1))
        else:
            rates.append(float(r))
    rows = []
    for rate in rates:

        def transfer(rate: float = rate) -> float:
            t0 = time.perf_counter()
            with paced(patch, rate) as proc, open(received, "wb") as f:
                shutil.copyfileobj(proc.stdout, f)
            return time.perf_counter() - t0

        def sequential(rate: float = rate) -> float:
            t0 = time.perf_counter()
            with paced(patch, rate) as proc, open(received, "wb") as f:
                shutil.copyfileobj(proc.stdout, f)
            run([pulsectl, "-q", "apply", str(a), str(received), "-o", str(out), "-f"])
            return time.perf_counter() - t0

        def overlapped(rate: float = rate) -> float:
            t0 = time.perf_counter()
            with paced(patch, rate) as proc:
                subprocess.run(
                    [pulsectl, "-q", "apply", str(a), "-", "-o", str(out), "-f"],
                    stdin=proc.stdout,
                    check=True,
                )
            return time.perf_counter() - t0

        runs = in_turn(apply_local, transfer, sequential, overlapped)
        compute, t, s, o = map(median, runs)
        assert out.read_bytes() == b.read_bytes()
        ideal = max(t, compute)
        rows.append(
            {
                "rate_mb_s": rate,
                "transfer_s": t,
                "compute_s": compute,
                "sequential_s": s,
                "overlapped_s": o,
                "ideal_s": ideal,
                "overlapped_over_ideal": o / ideal,
                "saving_vs_sequential": 1 - o / s,
                "runs_s": dict(
                    zip(("compute", "transfer", "sequential", "overlapped"), runs, strict=True)
                ),
            }
        )

    blocks_prefix = args.out / "blk.pulse"
    run([pulsectl, "-q", "diff", str(a), str(b), "--blocks", "4", "-o", str(blocks_prefix), "-f"])
    block_files = sorted(args.out.glob("blk.*.pulse"))
    chain_cmd = [pulsectl, "-q", "apply", str(a), *map(str, block_files), "-o", str(out), "-f"]
    one, chain = map(median, in_turn(apply_local, lambda: run(chain_cmd)))
    assert out.read_bytes() == b.read_bytes()
    result = {
        "size_bytes": a.stat().st_size,
        "patch_bytes": patch.stat().st_size,
        "cores": os.cpu_count(),
        "repeat": args.repeat,
        "in_turn": True,
        "rates": rows,
        "blocks": {
            "patches": len(block_files),
            "bytes": sum(f.stat().st_size for f in block_files),
            "one_patch_apply_s": one,
            "block_chain_apply_s": chain,
        },
    }
    (args.out / "overlap.json").write_text(json.dumps(result, indent=2))
    print(f"checkpoint {result['size_bytes']:,} bytes, patch {result['patch_bytes']:,} bytes")
    heads = ("MB/s", "transfer", "compute", "sequential", "overlapped", "ideal", "ovl/ideal")
    print(" ".join(f"{h:>10}" for h in heads) + f" {'saved':>6}")
    for r in rows:
        keys = ("transfer_s", "compute_s", "sequential_s", "overlapped_s", "ideal_s")
        cells = [f"{r['rate_mb_s']:>10g}"] + [f"{r[k]:>10.2f}" for k in keys]
        cells += [f"{r['overlapped_over_ideal']:>10.2f}", f"{r['saving_vs_sequential']:>6.0%}"]
        print(" ".join(cells))
    blk = result["blocks"]
    print(
        f"blocks: {blk['patches']} patches, {blk['bytes']:,} bytes; apply one patch "
        f"{blk['one_patch_apply_s']:.2f}s, the block chain {blk['block_chain_apply_s']:.2f}s"
    )
    print(f"raw results: {args.out / 'overlap.json'}")
    if args.doc is not None:
        args.doc.write_text(_markdown(result, sys.argv[1:], time.time() - started))
        print(f"wrote {args.doc}")


def _markdown(result: dict, argv: list[str], seconds: float) -> str:
    """docs/OVERLAP.md: the table above, with the machine, the date and the command."""
    import platform

    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()
    lines = [
        "# Overlap (ParaBlock)",
        "",
        "Generated by `benchmarks/overlap.py`; do not edit by hand, rerun it.",
        "",
        f"- Date: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}",
        f"- Machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}",
        f"- pulsectl git {rev or 'unknown'}",
        f"- Reproduce: `python benchmarks/overlap.py {' '.join(argv)}` (from the repository "
        f"root, in the project's venv); {seconds / 60:.1f} min",
        "",
        f"A checkpoint of {result['size_bytes']:,} bytes (BF16 4096-wide matrices, about 1% of "
        f"the words moved by one unit) and its patch of {result['patch_bytes']:,} bytes. For "
        "each link rate: *transfer* is the patch pushed through a pipe at that rate and read to "
        "a file; *compute* is `pulsectl apply` from a local file; *sequential* is transfer then "
        "apply; *overlapped* is `pulsectl apply BASE -` reading the paced pipe; *ideal* is "
        f"max(transfer, compute). Seconds, medians of {result['repeat']} runs taken in turn; "
        "*saved* is 1 - overlapped / sequential. `match` is the rate at which transfer takes "
        "as long as compute.",
        "",
        "| MB/s | transfer s | compute s | sequential s | overlapped s | ideal s | "
        "overlapped / ideal | saved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rates"]:
        lines.append(
            f"| {r['rate_mb_s']:g} | {r['transfer_s']:.2f} | {r['compute_s']:.2f} | "
            f"{r['sequential_s']:.2f} | {r['overlapped_s']:.2f} | {r['ideal_s']:.2f} | "
            f"{r['overlapped_over_ideal']:.2f}x | {r['saving_vs_sequential']:.0%} |"
        )
    blk = result["blocks"]
    lines += [
        "",
        f"Block patches (`diff --blocks 4`): {blk['patches']} patches, {blk['bytes']:,} bytes "
        f"in all; applying the one patch took {blk['one_patch_apply_s']:.2f} s, the block "
        f"patches together {blk['block_chain_apply_s']:.2f} s (medians).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
