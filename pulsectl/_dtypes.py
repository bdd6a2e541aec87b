"""The safetensors dtypes pulsectl knows: element size and the word width used for diffs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # as spelled in a safetensors header
    bits: int  # bits per element
    word: int  # bytes per word compared and delta-coded (1, 2, 4 or 8)
    is_float: bool

    def nbytes(self, numel: int) -> int:
        """Bytes taken by ``numel`` elements (sub-byte types are packed)."""
        total_bits = numel * self.bits
        return (total_bits + 7) // 8


def _d(name: str, bits: int, word: int, is_float: bool) -> DType:
    return DType(name, bits, word, is_float)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _d("BOOL", 8, 1, False),
        _d("U8", 8, 1, False),
        _d("I8", 8, 1, False),
        _d("F8_E5M2", 8, 1, True),
        _d("F8_E4M3", 8, 1, True),
        _d("F8_E8M0", 8, 1, True),
        _d("F8_E4M3FNUZ", 8, 1, True),  # AMD's FP8 (MI300): one NaN, no -0, bias one higher
        _d("F8_E5M2FNUZ", 8, 1, True),
        _d("F4", 4, 1, True),
        _d("F6_E2M3", 6, 1, True),
        _d("F6_E3M2", 6, 1, True),
        _d("I16", 16, 2, False),
        _d("U16", 16, 2, False),
        _d("F16", 16, 2, True),
        _d("BF16", 16, 2, True),
        _d("I32", 32, 4, False),
        _d("U32", 32, 4, False),
        _d("F32", 32, 4, True),
        _d("C64", 64, 4, True),
        _d("I64", 64, 8, False),
        _d("U64", 64, 8, False),
        _d("F64", 64, 8, True),
    )
}
