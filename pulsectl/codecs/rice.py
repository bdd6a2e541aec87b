"""The Rice delta codec (codec id 5, and 6 with value plane 0 paired): codec 3's changes with
the gaps Rice-coded.

Changed words of an Adam step are scattered about evenly, so their gaps are close to
geometric. One Rice parameter fits such gaps within a few hundredths of a bit of their entropy,
where byte planes pay for their mostly-zero high planes (zstd's Huffman stage spends at least
a bit per byte). The values are codec 3's zigzag planes; codec 6 stores plane 0 in pairs
(``_bits.paired_plane``), its only difference.

Payload layout (little-endian), mirrored in docs/FORMAT.md:
  u32 count, u8 word, u8 rice_k (0..31), u16 reserved (0),
  u32 unary_bytes, unary stream, u32 remainder_bytes, remainder stream,
  word x u32 value plane sizes, value planes (plane 0 paired in codec 6).
"""

from __future__ import annotations

import struct

import numpy as np

from pulsectl.codecs import _fast
from pulsectl.codecs._bits import (
    MAX_RICE_K,
    Planes,
    add_moves,
    best_rice,
    given_moves,
    join_planes,
    pack_fixed,
    pack_unary,
    take_sized,
    unary_ends,
    unpack_fixed,
    unpack_moves,
    value_plane_bytes,
    value_planes,
)
from pulsectl.errors import CorruptPatchError

_HEAD = struct.Struct("<IBBH")


def encode_moves(
    positions: np.ndarray,
    moved: np.ndarray | None,
    word: int,
    level: int,
    *,
    gaps: np.ndarray | None = None,
    k: int | None = None,
    values: Planes | None = None,
    streams: tuple[int, bytes, bytes] | None = None,
) -> bytes:
    """Payload for words at ``positions`` (sorted, non-empty) that moved by ``moved``: codec 6's
    when ``values.paired``, else codec 5's (always, without ``values``).

    ``gaps``, ``k``, ``values`` (from ``_bits.change_planes`` or ``moves_planes``) and
    ``streams`` (from ``rice_streams``) may be given when the caller has them already."""
    if streams is None:
        streams = rice_streams(positions, gaps=gaps, k=k)
    k, unary, remainder = streams
    return b"".join(
        [
            _HEAD.pack(positions.size, word, k, 0),
            struct.pack("<I", len(unary)),
            unary,
            struct.pack("<I", len(remainder)),
            remainder,
            values.joined()
            if values is not None
            else join_planes(value_planes(given_moves(moved), word, level)),
        ]
    )


def rice_streams(
    positions: np.ndarray, *, gaps: np.ndarray | None = None, k: int | None = None
) -> tuple[int, bytes, bytes]:
    """The Rice parameter (the fewest bits; the smallest on a tie, unless ``k`` is given), the
    unary stream and the remainder stream of the gaps between ``positions``."""
    fast = _fast.native
    if fast is not None and k is None and positions.flags.c_contiguous:
        k, unary, remainder = fast.rice_encode(positions.astype(np.int64, copy=False))
        return k, unary, remainder
    if gaps is None:
        gaps = np.diff(positions, prepend=-1) - 1
    if k is None:
        k = best_rice(gaps)
    return k, pack_unary(gaps >> k), pack_fixed(gaps & ((1 << k) - 1), k)


def rice_size(positions: np.ndarray) -> tuple[int, int, int]:
    """What ``rice_streams`` would give, as (k, unary bytes, remainder bytes), without
    writing the streams where the compiled loops are built."""
    fast = _fast.native
    if fast is not None and positions.flags.c_contiguous:
        return fast.rice_size(positions.astype(np.int64, copy=False))
    k, unary, remainder = rice_streams(positions)
    return k, len(unary), len(remainder)


def _streams(
    payload: bytes, word: int, nwords: int
) -> tuple[memoryview, int, int, memoryview, memoryview, int]:
    """A Rice delta payload's parts: (view, count, k, unary, remainder, offset of the planes)."""
    view = memoryview(payload)
    if len(payload) < _HEAD.size:
        raise CorruptPatchError("rice block is shorter than its header")
    count, pword, k, reserved = _HEAD.unpack_from(payload, 0)
    if pword != word or k > MAX_RICE_K or reserved:
        raise CorruptPatchError("rice block header is damaged")
    if not 0 < count <= nwords:
        raise CorruptPatchError(f"rice block claims {count} changes in {nwords} words")
    unary, offset = take_sized(view, _HEAD.size)
    remainder, offset = take_sized(view, offset)
    return view, count, k, unary, remainder, offset


def add_in_place(block: np.ndarray, payload: bytes, word: int, paired: bool = False) -> bool:
    """Apply a Rice delta payload to ``block`` (uint8, writable) in place with the compiled
    loop, which never holds the positions and moves as arrays (on a 34%-dense 1 GB pair these
    passes were half of apply's CPU time). False, ``block`` untouched, where that loop is not
    available: use ``decode_moves``. On a damaged payload ``block`` may be partly patched."""
    fast = _fast.native
    if fast is None or not block.flags.c_contiguous or not block.flags.writeable:
        return False
    view, count, k, unary, remainder, offset = _streams(payload, word, block.size // word)
    planes = value_plane_bytes(view, offset, count, word, paired)
    fast.rice_scatter(block, unary, remainder, count, k, planes, word)
    return True


def decode_moves(
    payload: bytes, word: int, nwords: int, paired: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The positions (int64) and moves (unsigned) of a Rice delta payload (no base needed);
    ``paired`` for codec 6."""
    view, count, k, unary, remainder, offset = _streams(payload, word, nwords)
    fast = _fast.native
    if fast is not None:
        positions = np.frombuffer(fast.rice_decode(unary, remainder, count, k, nwords), np.int64)
        return positions, unpack_moves(view, offset, count, word, paired)
    # Quotients are at most the gaps, which add up to less than nwords: read no further.
    ends = unary_ends(unary[: (count + nwords + 7) // 8], count)
    rems = unpack_fixed(remainder, count, k)
    # position i = sum over j <= i of (q[j] << k) + r[j] + 1, minus 1; the unary code ends give
    # sum(q[:i+1]) = ends[i] - i without a pass of their own, and with k = 0 they are the answer.
    if k == 0:
        positions = ends
    else:
        index = np.arange(count, dtype=np.int64)
        positions = ((ends - index) << k) + np.cumsum(rems) + index
    if positions[-1] >= nwords:
        raise CorruptPatchError("rice block points past the end of its block")
    return positions, unpack_moves(view, offset, count, word, paired)


def decode(old: np.ndarray, payload: bytes, word: int, paired: bool = False) -> np.ndarray:
    """Rebuild the new block (uint8) from the base block and a Rice delta payload (codec 6's
    when ``paired``)."""
    out = old.copy()
    if not add_in_place(out, payload, word, paired):
        positions, moved = decode_moves(payload, word, old.size // word, paired)
        add_moves(out, positions, moved, word)
    return out
