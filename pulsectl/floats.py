"""Exact float32 <-> bfloat16 conversion on raw bit patterns (numpy only).

Finite values and infinities round to nearest, ties to even, exactly as torch does: overflow
goes to infinity, subnormals are kept (no flush to zero), the sign of zero is kept.

NaN has no single answer, because torch itself is not consistent about it. ``x.to(bfloat16)``
on a contiguous CPU tensor (the vectorised kernel) turns every NaN into 0xFFFF; a 0-d or
strided CPU tensor (the scalar path) gives 0x7FC0; CUDA gives 0x7FFF. The default here is the
first, the word ``torch.from_numpy(x).to(torch.bfloat16)`` writes for a float32 array;
``nan=None`` keeps the sign and the top payload bits and sets the quiet bit instead (what the
x86 VCVTNEPS2BF16 instruction does).
"""

from __future__ import annotations

import numpy as np

BF16_NAN_TORCH_CPU = 0xFFFF
"""NaN word of torch's vectorised CPU cast (contiguous tensors): the default."""
BF16_NAN_TORCH_SCALAR = 0x7FC0
"""NaN word of torch's scalar CPU cast (0-d and strided tensors)."""
BF16_NAN_CUDA = 0x7FFF
"""NaN word of the CUDA cast (``__float2bfloat16``)."""

_CHUNK = 1 << 20  # elements per pass: keeps temporaries at a few MiB
_ABS_MASK = np.uint32(0x7FFF_FFFF)
_INF_BITS = np.uint32(0x7F80_0000)
_QUIET_BIT = np.uint16(0x0040)


def f32_to_bf16(x: np.ndarray, *, nan: int | None = BF16_NAN_TORCH_CPU) -> np.ndarray:
    """Round float32 values to bfloat16 words (uint16, same shape), ties to even.

    ``x`` may be float32 or its uint32 bit patterns. ``nan`` is the word written for every
    NaN, or None to keep sign and payload (quietened). See the module docstring.
    """
    if x.dtype not in (np.float32, np.uint32):
        raise TypeError(f"f32_to_bf16 needs float32 or uint32 bit patterns, got {x.dtype}")
    if nan is not None and not 0 <= nan <= 0xFFFF:
        raise ValueError(f"nan must be a 16-bit word, got {nan:#x}")
    bits = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    out = np.empty(bits.shape, dtype=np.uint16)
    tmp = np.empty(min(bits.size, _CHUNK), dtype=np.uint32)
    nan_mask = np.empty(tmp.shape, dtype=bool)
    for start in range(0, bits.size, _CHUNK):
        src = bits[start : start + _CHUNK]
        t = tmp[: src.size]
        m = nan_mask[: src.size]
        # bias = 0x7FFF + lowest kept bit; adding it and truncating rounds to nearest even.
        np.right_shift(src, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, src, out=t)  # wraps only for NaN patterns, which are replaced below
        np.right_shift(t, 16, out=t)
        dst = out[start : start + src.size]
        dst[...] = t
        np.bitwise_and(src, _ABS_MASK, out=t)
        np.greater(t, _INF_BITS, out=m)
        if m.any():
            if nan is None:
                dst[m] = (src[m] >> 16).astype(np.uint16) | _QUIET_BIT
            else:
                dst[m] = nan
    return out.reshape(x.shape)


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    """Widen bfloat16 words (uint16) to float32 exactly; NaN payloads are kept."""
    if b.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 needs uint16 bfloat16 words, got {b.dtype}")
    out = b.astype(np.uint32)
    np.left_shift(out, 16, out=out)
    return out.view(np.float32)
