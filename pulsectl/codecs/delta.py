"""The sparse word-delta codec (codec id 3).

Per block: the positions of changed words as gaps, and for each the difference of the raw
words ``new - old`` modulo 2**(8*word), zigzag-mapped so small moves of either sign are small
numbers. Gaps and values are split into byte planes (least significant first); each plane that
is not all zero is one zstd frame. Most changed BF16 words move by one unit in the last place,
so the value planes are nearly constant and the high gap planes nearly empty.

Payload layout (little-endian), mirrored in docs/FORMAT.md:
  u32 count, u8 gap_bytes (1..4), u8 word (1, 2, 4, 8), u16 reserved (0),
  (gap_bytes + word) x u32 plane sizes (0: the plane is all zero bytes),
  the planes: gap planes first, then value planes.
"""

from __future__ import annotations

import struct

import numpy as np

from pulsectl import _zstd
from pulsectl.codecs import _fast
from pulsectl.codecs._bits import add_moves, given_moves, value_planes
from pulsectl.errors import CorruptPatchError

_HEAD = struct.Struct("<IBBH")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def find_changes(old: np.ndarray, new: np.ndarray, word: int) -> np.ndarray:
    """Indices (int64) of the words of ``new`` whose bytes differ from ``old``."""
    fast = _fast.native
    if fast is not None and old.flags.c_contiguous and new.flags.c_contiguous:
        return np.frombuffer(fast.changes(old, new, word), dtype=np.int64)
    utype = _UINT[word]
    return np.flatnonzero(old.view(utype) != new.view(utype))


def encode(old: np.ndarray, new: np.ndarray, word: int, positions: np.ndarray, level: int) -> bytes:
    """Payload for the changed words at ``positions`` (sorted, non-empty)."""
    utype = _UINT[word]
    moved = new.view(utype)[positions] - old.view(utype)[positions]  # wraps modulo 2**bits
    return encode_moves(positions, moved, word, level)


def encode_moves(
    positions: np.ndarray,
    moved: np.ndarray | None,
    word: int,
    level: int,
    *,
    gaps: np.ndarray | None = None,
    values: list[bytes] | None = None,
) -> bytes:
    """Payload for words at ``positions`` (sorted, non-empty) that moved by ``moved``.

    ``moved`` holds ``new - old`` modulo 2**(8*word) as unsigned ``word``-byte integers.
    ``gaps`` and ``values`` (from ``_bits.value_planes``) may be given when the caller has them.
    """
    count = positions.size
    if gaps is None:
        gaps = np.diff(positions, prepend=-1) - 1
    max_gap = int(gaps.max())
    gap_bytes = max(1, (max_gap.bit_length() + 7) // 8)
    gaps32 = gaps.astype("<u4")
    planes = [_plane(gaps32, 4, p) for p in range(gap_bytes)]
    packed = [b"" if not plane.any() else _zstd.compress(plane, level) for plane in planes]
    packed += values if values is not None else value_planes(given_moves(moved), word, level)
    head = _HEAD.pack(count, gap_bytes, word, 0) + struct.pack(
        f"<{len(packed)}I", *(len(p) for p in packed)
    )
    return head + b"".join(packed)


def decode(old: np.ndarray, payload: bytes, word: int) -> np.ndarray:
    """Rebuild the new block (uint8) from the base block and a delta payload."""
    positions, moved = decode_moves(payload, word, old.size // word)
    out = old.copy()
    add_moves(out, positions, moved, word)
    return out


def decode_moves(payload: bytes, word: int, nwords: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions (int64) and moves (``new - old``, unsigned) a delta payload holds.

    Needs no base: this is what ``squash`` composes.
    """
    if len(payload) < _HEAD.size:
        raise CorruptPatchError("delta block is shorter than its header")
    count, gap_bytes, pword, reserved = _HEAD.unpack_from(payload, 0)
    if pword != word or not 1 <= gap_bytes <= 4 or reserved:
        raise CorruptPatchError("delta block header is damaged")
    if not 0 < count <= nwords:
        raise CorruptPatchError(f"delta block claims {count} changes in {nwords} words")
    nplanes = gap_bytes + word
    sizes_end = _HEAD.size + 4 * nplanes
    if len(payload) < sizes_end:
        raise CorruptPatchError("delta block is shorter than its plane table")
    sizes = struct.unpack_from(f"<{nplanes}I", payload, _HEAD.size)
    if sizes_end + sum(sizes) != len(payload):
        raise CorruptPatchError("delta block plane sizes do not add up to its length")
    view = memoryview(payload)
    offset = sizes_end
    gaps = np.zeros((count, 4), dtype=np.uint8)
    values = np.zeros((count, word), dtype=np.uint8)
    for p, size in enumerate(sizes):
        if size:
            plane = np.frombuffer(_zstd.decompress(view[offset : offset + size], count), np.uint8)
            if p < gap_bytes:
                gaps[:, p] = plane
            else:
                values[:, p - gap_bytes] = plane
        offset += size
    steps = gaps.view("<u4").reshape(count).astype(np.int64) + 1
    positions = np.cumsum(steps) - 1
    if positions[-1] >= nwords:
        raise CorruptPatchError("delta block points past the end of its block")
    utype, stype = _UINT[word], _SINT[word]
    zigzag = values.view(f"<u{word}").reshape(count).astype(utype)
    signed = (zigzag >> 1).view(stype) ^ -(zigzag & 1).view(stype)
    return positions, signed.view(utype)


def _plane(values: np.ndarray, width: int, index: int) -> np.ndarray:
    """Byte ``index`` (0 = least significant) of each little-endian ``width``-byte value."""
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, width)[:, index])
