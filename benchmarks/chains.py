"""Checkpoint chains for the benchmark, built with pulsectl's generator and cached on disk.

One chain per learning rate: ``<root>/<preset>/lr<lr>/step_000.safetensors`` .. The generator
writes every step; only the steps a benchmark pair needs are kept (0 and each k), so a
qwen2.5-0.5b chain costs ~4 GB of disk instead of ~17 GB. A ``chain.json`` marker is written
last, so an interrupted build is redone and a finished one is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsectl.synth
from pulsectl.synth import generate_chain

MARKER = "chain.json"
LOCK = "building.pid"

# The learning rates and step distances that benchmarks/run.py diffs. A cached chain is reused
# only if it keeps every step asked for, so scripts that time other pairs of the same chains
# (loops.py, planes.py) ask for these steps too, or they would rebuild them.
RUN_LRS = (1e-6, 3e-6, 1e-5)
RUN_KS = (1, 4, 16)
BLOCK = 8 << 20  # pulsectl diff's default block size


def generator_digest() -> str:
    """Hash of the generator's source, so a changed generator invalidates cached chains."""
    return hashlib.sha256(Path(pulsectl.synth.__file__).read_bytes()).hexdigest()[:16]


def _wait_for_other_builder(d: Path) -> None:
    """Another process building this chain (e.g. started by hand) finishes first."""
    lock = d / LOCK
    while lock.exists():
        try:
            os.kill(int(lock.read_text()), 0)
        except (ProcessLookupError, ValueError, FileNotFoundError):
            return
        print(f"  waiting for {d} (being built by pid {lock.read_text()})", file=sys.stderr)
        time.sleep(10)


def step_path(chain_dir: Path, step: int) -> Path:
    return chain_dir / f"step_{step:03d}.safetensors"


def chain_dir(root: Path, preset: str, lr: float) -> Path:
    return root / preset / f"lr{lr:g}"


def ensure_chain(
    root: Path, preset: str, lr: float, steps: int, keep: set[int], seed: int = 0
) -> Path:
    """Build (or reuse) the chain for ``lr`` and return its folder."""
    d = chain_dir(root, preset, lr)
    want = {
        "preset": preset,
        "lr": lr,
        "steps": steps,
        "seed": seed,
        "generator": generator_digest(),
        "keep": sorted(keep),
    }
    marker = d / MARKER
    _wait_for_other_builder(d)
    if marker.exists():
        have = json.loads(marker.read_text())
        if (
            all(have.get(k) == v for k, v in want.items() if k != "keep")
            and set(have["keep"]) >= keep
            and all(step_path(d, s).exists() for s in keep)
        ):
            return d
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"  [{preset} lr={lr:g}] checkpoint {done}/{total}", file=sys.stderr, flush=True)
        written = done - 1
        if written not in keep:  # prune as we go so the disk never holds the whole chain
            step_path(d, written).unlink(missing_ok=True)

    d.mkdir(parents=True, exist_ok=True)
    lock = d / LOCK
    lock.write_text(str(os.getpid()))
    try:
        generate_chain(d, shape=preset, steps=steps, lr=lr, seed=seed, progress=progress)
    finally:
        lock.unlink(missing_ok=True)
    want["generate_s"] = round(time.perf_counter() - t0, 1)
    marker.write_text(json.dumps(want, indent=2) + "\n")
    return d


def run_pairs(
    root: Path, preset: str, lrs: list[float], ks: list[int]
) -> list[tuple[str, Path, Path]]:
    """(label, step 0, step k) for each learning rate and k, from the chains of run.py (built
    or reused under ``root``)."""
    pairs = []
    for lr in lrs:
        steps = (*RUN_KS, *ks)
        d = ensure_chain(root, preset, lr, max(steps), {0, *steps})
        pairs += [(f"lr {lr:g} k {k}", step_path(d, 0), step_path(d, k)) for k in ks]
    return pairs


def sample_blocks(old: Path, new: Path, nblocks: int) -> Iterator[tuple[Any, Any]]:
    """``nblocks`` evenly spaced blocks of BLOCK bytes of a pair's data region (whole 2-byte
    words), as uint8 arrays of their own."""
    import numpy as np

    from benchmarks.tensors import data_region

    start, end = data_region(new)
    a = np.memmap(old, dtype=np.uint8, mode="r")
    b = np.memmap(new, dtype=np.uint8, mode="r")
    for at in np.linspace(start, end - BLOCK, nblocks).astype(np.int64):
        at = int(at) // 2 * 2
        yield np.array(a[at : at + BLOCK]), np.array(b[at : at + BLOCK])


if __name__ == "__main__":  # python benchmarks/chains.py ROOT PRESET LR [LR...]
    root, preset, *lrs = sys.argv[1:]
    for lr in lrs:
        print(ensure_chain(Path(root), preset, float(lr), 16, {0, 1, 4, 16}))
