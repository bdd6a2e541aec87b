"""Bit-level pieces shared by the Rice-coded codecs (4-7): unary and fixed-width bit streams,
the Rice parameter, length-prefixed sections and the zigzag value planes, plain or with plane 0
paired (codecs 6 and 7)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pulsectl import _zstd
from pulsectl.codecs import _fast
from pulsectl.errors import CorruptPatchError

if TYPE_CHECKING:
    from collections.abc import Buffer  # Python 3.12+; annotations only

MAX_RICE_K = 31
# The unsigned integer type of each word width: words are compared, moved and scattered as these.
UINT_OF_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_UINT = UINT_OF_WORD
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def add_moves(block: np.ndarray, positions: np.ndarray, moved: np.ndarray, word: int) -> None:
    """``block`` (uint8, writable) with each word at ``positions`` moved by ``moved`` (unsigned,
    wrapping), in place."""
    fast = _fast.native
    if (
        fast is not None
        and block.flags.c_contiguous
        and positions.dtype == np.int64
        and positions.flags.c_contiguous
        and moved.flags.c_contiguous
        and moved.itemsize == word
    ):
        fast.scatter_add(block, positions, moved, word)
        return
    words = block.view(_UINT[word])
    words[positions] += moved.astype(_UINT[word], copy=False)


def best_rice(gaps: np.ndarray) -> int:
    """The Rice parameter k that codes ``gaps`` in the fewest bits."""
    top = max(1, int(gaps.max()).bit_length())
    costs = [rice_cost(gaps, k) for k in range(min(top, MAX_RICE_K) + 1)]
    return int(np.argmin(costs))


def pack_unary(quotients: np.ndarray) -> bytes:
    """Each q as q one-bits then a zero-bit, MSB-first into bytes, zero padding."""
    lengths = quotients + 1
    ends = np.cumsum(lengths)
    bits = np.ones(int(ends[-1]), dtype=np.uint8)
    bits[ends - 1] = 0
    return np.packbits(bits).tobytes()


def unpack_unary(data: memoryview, count: int) -> np.ndarray:
    zeros = unary_ends(data, count)
    return np.diff(zeros, prepend=-1) - 1


def unary_ends(data: memoryview, count: int) -> np.ndarray:
    """The bit index of the zero that ends each of the first ``count`` unary codes.

    The i-th end is the i-th quotient plus all the codes before it: sum(q[:i+1]) + i.
    """
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    zeros = np.flatnonzero(bits == 0)
    if zeros.size < count:
        raise CorruptPatchError("unary stream is too short")
    return zeros[:count]


def pack_bits(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Each value as ``width`` bits, MSB-first, concatenated; zero padding."""
    total = int(widths.sum())
    if total == 0:
        return b""
    ends = np.cumsum(widths)
    bits = np.zeros(total, dtype=np.uint8)
    for j in range(int(widths.max())):
        has = widths > j
        # bit j counted from the least significant end sits at ends - 1 - j
        bits[(ends - 1 - j)[has]] = ((values[has] >> j) & 1).astype(np.uint8)
    return np.packbits(bits).tobytes()


def unpack_bits(data: memoryview, widths: np.ndarray) -> np.ndarray:
    total = int(widths.sum())
    if len(data) != (total + 7) // 8:  # checked before unpacking: 8 bytes of memory per bit
        raise CorruptPatchError("remainder stream has the wrong length")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    out = np.zeros(widths.size, dtype=np.int64)
    if total == 0:
        return out
    ends = np.cumsum(widths)
    for j in range(int(widths.max())):
        has = widths > j
        out[has] |= bits[(ends - 1 - j)[has]].astype(np.int64) << j
    return out


def _fixed_width(k: int) -> int:
    return 8 if k <= 8 else 16 if k <= 16 else 32


def pack_fixed(values: np.ndarray, k: int) -> bytes:
    """Each value (< 2**k, k <= 32) as exactly ``k`` bits, MSB first, concatenated; zero padding."""
    if k == 0 or values.size == 0:
        return b""
    width = _fixed_width(k)
    big = values.astype(f">u{width // 8}")  # each value's bytes, most significant first
    bits = np.unpackbits(big.view(np.uint8)).reshape(values.size, width)
    return np.packbits(bits[:, width - k :].ravel()).tobytes()


def unpack_fixed(data: memoryview, count: int, k: int) -> np.ndarray:
    """``count`` values of exactly ``k`` bits each, MSB first (the inverse of ``pack_fixed``)."""
    if len(data) != (count * k + 7) // 8:
        raise CorruptPatchError("remainder stream has the wrong length")
    if k == 0 or count == 0:
        return np.zeros(count, dtype=np.int64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * k).reshape(count, k)
    width = _fixed_width(k)
    padded = np.zeros((count, width), dtype=np.uint8)
    padded[:, width - k :] = bits
    big = np.packbits(padded.ravel())  # each value's bytes, most significant first
    return big.view(f">u{width // 8}").astype(np.int64)


def take_sized(view: memoryview, offset: int) -> tuple[memoryview, int]:
    """A ``u32 length`` then that many bytes, at ``offset``; returns them and the next offset."""
    if len(view) < offset + 4:
        raise CorruptPatchError("block is truncated")
    (n,) = struct.unpack_from("<I", view, offset)
    offset += 4
    if len(view) < offset + n:
        raise CorruptPatchError("block is truncated")
    return view[offset : offset + n], offset + n


def raw_planes(moved: np.ndarray, word: int) -> list[np.ndarray]:
    """The zigzag byte planes of the moves before compression, plane 0 first."""
    utype, stype = _UINT[word], _SINT[word]
    signed = moved.astype(utype, copy=False).view(stype)
    zigzag = ((signed << 1) ^ (signed >> (8 * word - 1))).view(utype).astype(f"<u{word}")
    return [
        np.ascontiguousarray(zigzag.view(np.uint8).reshape(-1, word)[:, p]) for p in range(word)
    ]


def value_planes(moved: np.ndarray, word: int, level: int) -> list[bytes]:
    """The compressed zigzag byte planes of the moves (b"" for an all-zero plane), all plain:
    codec 3's planes."""
    return [compress_plane(memoryview(plane), level) for plane in raw_planes(moved, word)]


@dataclass(frozen=True)
class Planes:
    """A block's value planes, compressed: ``packed[p]`` is plane p (b"" when all zero), plane
    0 in the paired form when ``paired`` (codecs 6 and 7), else all plain (codecs 3, 4, 5).
    A paired one keeps plane 0 before compression (``raw0``, at ``level``) for ``plain``."""

    packed: list[bytes]
    paired: bool
    raw0: Buffer | None = field(default=None, compare=False, repr=False)
    level: int = field(default=0, compare=False, repr=False)

    def joined(self) -> bytes:
        return join_planes(self.packed)

    def plain(self) -> list[bytes]:
        """The planes with plane 0 plain, as codec 3 (which has no paired form) stores them:
        only plane 0 is compressed again."""
        if not self.paired:
            return self.packed
        assert self.raw0 is not None
        return [compress_plane(memoryview(self.raw0), self.level), *self.packed[1:]]


def compress_planes(raw: Sequence[Buffer], level: int, pair: bool) -> Planes:
    """``raw`` (plane 0 first) compressed, plane 0 paired when ``pair`` and pairing pays. The
    result refers to ``raw[0]`` when paired: use it while that buffer is valid."""
    rest = [compress_plane(memoryview(p), level) for p in raw[1:]]
    packed0 = paired_plane(memoryview(raw[0]), level) if pair else None
    if packed0 is not None:
        return Planes([packed0, *rest], True, raw[0], level)
    return Planes([compress_plane(memoryview(raw[0]), level), *rest], False)


def moves_planes(moved: np.ndarray, word: int, level: int, pair: bool) -> Planes:
    """The value planes of the moves (``new - old``, unsigned), plane 0 paired when ``pair``
    and pairing pays."""
    return compress_planes(raw_planes(moved, word), level, pair)


def change_planes(
    old: np.ndarray,
    new: np.ndarray,
    positions: np.ndarray,
    word: int,
    level: int,
    raw: Sequence[Buffer] | None = None,
    *,
    pair: bool = False,
) -> Planes:
    """The value planes of the moves of the words at ``positions`` from ``old`` to ``new``,
    plane 0 paired when ``pair`` and pairing pays; ``raw``, when given, holds those planes
    uncompressed, plane 0 first (as ``_speedups.changes_into`` lists them)."""
    fast = _fast.native
    if raw is None:
        if fast is None or not (old.flags.c_contiguous and new.flags.c_contiguous):
            utype = _UINT[word]
            moved = new.view(utype)[positions] - old.view(utype)[positions]
            return moves_planes(moved, word, level, pair)
        joined = fast.zigzag_planes(old, new, positions.astype(np.int64, copy=False), word)
        count = positions.size
        raw = [memoryview(joined)[p * count : (p + 1) * count] for p in range(word)]
    return compress_planes(raw, level, pair)


def compress_plane(plane: memoryview, level: int) -> bytes:
    """b"" for an all-zero plane, else one zstd frame."""
    return _zstd.compress_plane(plane, level) if not all_zero(plane) else b""


def all_zero(plane: Buffer) -> bool:
    """Whether every byte of ``plane`` is 0 (``max``: a quarter of the time of ``any``, which
    converts each byte to a bool first)."""
    data = np.frombuffer(plane, np.uint8)
    return not data.size or not data.max()


# Plane 0 in pairs (codecs 6 and 7): bytes a, b become one symbol PAIR_SMALL * a + b when both
# are below PAIR_SMALL, else PAIR_ESCAPE, with a and b in an escape stream. Most moves of an
# Adam step are one unit down or up (zigzag 1 and 2): zstd's Huffman code spends whole bits per
# byte on them, and per pair of them comes close to their entropy (measured with
# benchmarks/planes.py: 0.023-0.048 bytes per change less on the nine benchmark pairs).
PAIR_SMALL = 15
PAIR_ESCAPE = PAIR_SMALL * PAIR_SMALL
# Below this many changes, plane 0 is also compressed plain and the smaller form is kept (the
# paired form spends a length and, with escapes, a second frame); above it pairing wins unless
# most pairs escape.
_PAIR_BOTH_BELOW = 4096


def pair_plane(plane: Buffer) -> tuple[bytes, bytes]:
    """The symbols and the escape bytes of a plane in the paired form."""
    fast = _fast.native
    if fast is not None:
        return fast.pair_plane(plane)
    low = np.frombuffer(plane, dtype=np.uint8)
    padded = np.concatenate([low, np.zeros(low.size % 2, dtype=np.uint8)]).astype(np.int32)
    a, b = padded[0::2], padded[1::2]
    small = (a < PAIR_SMALL) & (b < PAIR_SMALL)
    symbols = np.where(small, PAIR_SMALL * a + b, PAIR_ESCAPE).astype(np.uint8)
    escapes = np.stack([a[~small], b[~small]], axis=1).astype(np.uint8)
    return symbols.tobytes(), escapes.tobytes()


def unpair_plane(symbols: Buffer, escapes: Buffer, count: int) -> bytes:
    """The ``count`` bytes of a plane from its paired form; CorruptPatchError if the two
    streams do not fit together."""
    fast = _fast.native
    if fast is not None:
        return fast.unpair_plane(symbols, escapes, count)
    sym = np.frombuffer(symbols, dtype=np.uint8)
    esc = np.frombuffer(escapes, dtype=np.uint8)
    if sym.size != (count + 1) // 2:
        raise CorruptPatchError("paired plane has the wrong number of symbols")
    escaped = np.flatnonzero(sym == PAIR_ESCAPE)
    if np.any(sym > PAIR_ESCAPE) or esc.size != 2 * escaped.size:
        raise CorruptPatchError("paired plane is damaged")
    out = np.empty(2 * sym.size, dtype=np.uint8)
    out[0::2] = sym // PAIR_SMALL
    out[1::2] = sym % PAIR_SMALL
    out[2 * escaped] = esc[0::2]
    out[2 * escaped + 1] = esc[1::2]
    if count % 2 and out[count]:
        raise CorruptPatchError("paired plane is damaged")
    return out[:count].tobytes()


def paired_plane(plane: memoryview, level: int) -> bytes | None:
    """Plane 0 in the paired form (``u32 symbols_bytes``, the symbols as one zstd frame, then
    the escapes as one zstd frame, or nothing when no pair escaped); None when the plain form
    is as small or smaller, or the plane is all zero."""
    count = len(plane)
    if all_zero(plane):
        return None
    symbols, escapes = pair_plane(plane)
    if len(escapes) > count // 2:  # most pairs escape: pairing would not pay
        return None
    packed_symbols = _zstd.compress_plane(symbols, level)
    packed = b"".join(
        [
            struct.pack("<I", len(packed_symbols)),
            packed_symbols,
            _zstd.compress_plane(escapes, level) if escapes else b"",
        ]
    )
    if count < _PAIR_BOTH_BELOW and len(compress_plane(plane, level)) <= len(packed):
        return None
    return packed


def unpack_paired_plane(data: memoryview, count: int) -> bytes:
    """The ``count`` bytes of plane 0 from its paired form (``paired_plane``)."""
    symbols, offset = take_sized(data, 0)
    nsymbols = (count + 1) // 2
    plane_symbols = _zstd.decompress(symbols, nsymbols)
    # The escape frame says how many bytes it holds (at most two per symbol); unpair_plane
    # checks that they are exactly those of the escape symbols.
    escapes = b""
    if offset < len(data):
        escapes = _zstd.decompress(data[offset:], 2 * nsymbols, at_most=True)
        if not escapes:  # no escape is written as no frame
            raise CorruptPatchError("paired plane has an empty escape frame")
    return unpair_plane(plane_symbols, escapes, count)


def given_moves(moved: np.ndarray | None) -> np.ndarray:
    """``moved`` for an encoder that was given no value planes (it must then have the moves)."""
    if moved is None:
        raise ValueError("moved is needed when values are not given")
    return moved


def join_planes(packed: list[bytes]) -> bytes:
    return struct.pack(f"<{len(packed)}I", *(len(p) for p in packed)) + b"".join(packed)


def rice_cost(gaps: np.ndarray, k: int) -> int:
    """Bits of ``gaps`` Rice-coded with parameter ``k``."""
    return int((gaps >> k).sum()) + gaps.size * (k + 1)


def order0_bits(gaps: np.ndarray) -> float:
    """An estimate of the order-0 entropy of ``gaps`` in bits: the entropy of their bit lengths
    plus the bits below the leading one, taken as uniform."""
    lengths = np.frexp(gaps.astype(np.float64))[1]  # bit length; 0 for a zero gap
    counts = np.bincount(lengths)
    p = counts[counts > 0] / gaps.size
    extra = np.maximum(lengths - 1, 0).sum()
    return float(-(p * np.log2(p)).sum() * gaps.size + extra)


def value_plane_bytes(
    view: memoryview, offset: int, count: int, word: int, paired: bool = False
) -> tuple[bytes | None, ...]:
    """The value planes at ``offset`` (the rest of the payload), decompressed: ``count`` zigzag
    bytes each, plane 0 first, None for a plane that is all zeros; plane 0 is in the paired
    form when ``paired`` (codecs 6 and 7)."""
    if len(view) < offset + 4 * word:
        raise CorruptPatchError("block is shorter than its value table")
    plane_sizes = struct.unpack_from(f"<{word}I", view, offset)
    offset += 4 * word
    if offset + sum(plane_sizes) != len(view):
        raise CorruptPatchError("block value planes do not add up to its length")
    planes: list[bytes | None] = []
    for p, size in enumerate(plane_sizes):
        data = view[offset : offset + size]
        if not size:
            planes.append(None)
        elif p == 0 and paired:
            planes.append(unpack_paired_plane(data, count))
        else:
            planes.append(_zstd.decompress(data, count))
        offset += size
    return tuple(planes)


def unpack_moves(
    view: memoryview, offset: int, count: int, word: int, paired: bool = False
) -> np.ndarray:
    """The value planes at ``offset`` (the rest of the payload) as unsigned moves."""
    planes = value_plane_bytes(view, offset, count, word, paired)
    utype, stype = _UINT[word], _SINT[word]
    fast = _fast.native
    if fast is not None:
        return np.frombuffer(fast.unzigzag(planes, count, word), dtype=f"<u{word}").astype(
            utype, copy=False
        )
    values = np.zeros((count, word), dtype=np.uint8)
    for p, plane in enumerate(planes):
        if plane is not None:
            values[:, p] = np.frombuffer(plane, dtype=np.uint8)
    zigzag = values.view(f"<u{word}").reshape(count).astype(utype)
    signed = (zigzag >> 1).view(stype) ^ -(zigzag & 1).view(stype)
    return signed.view(utype)
