"""Read a (base, target) checkpoint pair as uint16 words per tensor, memory-mapped."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.v31 import Pair
from pulsectl.checkpoint import read_header


def load_pairs(old: Path, new: Path) -> dict[str, Pair]:
    """BF16 tensors of ``old`` and ``new`` by name; both must hold the same tensors."""
    ho, hn = read_header(old), read_header(new)
    mo = np.memmap(old, dtype="<u2", mode="r")
    mn = np.memmap(new, dtype="<u2", mode="r")
    olds = {t.name: t for t in ho.tensors}
    pairs: dict[str, Pair] = {}
    for t in hn.tensors:
        o = olds.get(t.name)
        if o is None or o.shape != t.shape or o.dtype != t.dtype:
            raise ValueError(f"{t.name}: not in {old} with the same dtype and shape")
        if t.dtype != "BF16":
            raise ValueError(f"{t.name}: dtype {t.dtype}; the benchmark expects BF16 checkpoints")
        if o.start % 2 or t.start % 2:
            raise ValueError(f"{t.name}: data not 2-byte aligned")
        n = t.nbytes // 2
        pairs[t.name] = Pair(
            t.name,
            tuple(t.shape),
            mo[o.start // 2 : o.start // 2 + n],
            mn[t.start // 2 : t.start // 2 + n],
        )
    return pairs


def largest_tensor_bytes(path: Path) -> int:
    return max(t.nbytes for t in read_header(path).tensors)


def data_region(path: Path) -> tuple[int, int]:
    """(start, end) byte offsets of the tensor data."""
    h = read_header(path)
    return h.data_start, h.file_size
