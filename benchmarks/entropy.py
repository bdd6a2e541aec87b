"""Empirical entropy of the change stream: what an ideal coder of each model would spend.

All figures are in bits summed over the checkpoint; callers divide by 8 x changes.

order-0 (no knowledge of the base):
  gaps_geometric   each tensor's change mask as i.i.d. Bernoulli(p_t): sum_t n_t H(p_t)
                   (the cost of geometric gaps with the tensor's own rate);
  gaps_empirical   each tensor's gaps (distance to the previous change) coded by their own
                   empirical frequencies;
  values           new - old as int16 (wrapping), by its empirical frequency per tensor.
given the base (the decoder has the base, so it can condition on it):
  mask_by_exponent the change mask with one probability per (tensor, base BF16 exponent):
                   sum over (t, e) of n_te H(m_te / n_te);
  values           as above, per tensor.
Empirical entropies leave out the cost of describing the model (a few counts per tensor), so
they are slightly optimistic bounds for coders that adapt per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from benchmarks.v31 import Pair


def _h_bits(counts: np.ndarray) -> float:
    """sum(-c log2(c/N)) over a count vector: the ideal code length of the sample."""
    c = counts[counts > 0].astype(np.float64)
    total = c.sum()
    if total == 0:
        return 0.0
    return float(-(c * np.log2(c / total)).sum())


def _bernoulli_bits(n: np.ndarray, m: np.ndarray) -> float:
    """sum of n H(m/n) for arrays of trials n and successes m."""
    n = n.astype(np.float64)
    m = m.astype(np.float64)
    keep = (m > 0) & (m < n)
    n, m = n[keep], m[keep]
    return float(-(m * np.log2(m / n) + (n - m) * np.log2((n - m) / n)).sum())


@dataclass
class EntropyBits:
    changed: int = 0
    words: int = 0
    gaps_geometric: float = 0.0
    gaps_empirical: float = 0.0
    values: float = 0.0
    mask_by_exponent: float = 0.0

    def add_tensor(self, pair: Pair) -> None:
        old, new = np.asarray(pair.old), np.asarray(pair.new)
        mask = old != new
        pos = np.flatnonzero(mask)
        m = pos.size
        self.changed += m
        self.words += old.size
        self.gaps_geometric += _bernoulli_bits(np.array([old.size]), np.array([m]))
        if m == 0:
            return
        gaps = np.diff(pos, prepend=-1)
        self.gaps_empirical += _h_bits(np.unique(gaps, return_counts=True)[1])
        moved = (new[pos] - old[pos]).view(np.uint16)  # int16 delta, as its bit pattern
        self.values += _h_bits(np.bincount(moved, minlength=1 << 16))
        exponent = (old >> 7) & 0xFF
        n_e = np.bincount(exponent, minlength=256)
        m_e = np.bincount(exponent[pos], minlength=256)
        self.mask_by_exponent += _bernoulli_bits(n_e, m_e)

    def per_change_bytes(self) -> dict[str, float]:
        """Bytes per changed element for each model and the two totals."""
        per = 8.0 * max(self.changed, 1)
        return {
            "gaps_geometric": self.gaps_geometric / per,
            "gaps_empirical": self.gaps_empirical / per,
            "values": self.values / per,
            "mask_by_exponent": self.mask_by_exponent / per,
            "order0_total": (self.gaps_geometric + self.values) / per,
            "given_base_total": (self.mask_by_exponent + self.values) / per,
        }


def measure(pairs: dict[str, Pair]) -> dict[str, float | int]:
    bits = EntropyBits()
    for pair in pairs.values():
        bits.add_tensor(pair)
    return {"changed": bits.changed, "words": bits.words, **bits.per_change_bytes()}
