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
    gaps32 = _gaps32(positions) if gaps is None else gaps.astype("<u4")
    max_gap = int(gaps32.max())
    gap_bytes = max(1, (max_gap.bit_length() + 7) // 8)
    planes = [_plane(gaps32, 4, p) for p in range(gap_bytes)]
    packed = [b"" if not plane.any() else _zstd.compress(plane, level) for plane in planes]
    packed += values if values is not None else value_planes(given_moves(moved), word, level)
    head = _HEAD.pack(count, gap_bytes, word, 0) + struct.pack(
        f"<{len(packed)}I", *(len(p) for p in packed)
    )
    return head + b"".join(packed)


def _gaps32(positions: np.ndarray) -> np.ndarray:
    """The gap before each of the sorted ``positions`` (the first counted from -1) as u4 (a
    block has fewer than 2**32 words), without int64 temporaries: np.diff's took ~100 MiB for
    an 8 MiB block whose words all changed."""
    out = np.empty(positions.size, "<u4")
    out[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=out[1:], casting="unsafe")
    out[1:] -= 1
    return out


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
    count, gap_planes, value_planes = _planes(payload, word, nwords)
    positions, moved = _moves(gap_planes, value_planes, word, -1)
    if positions[-1] >= nwords:
        raise CorruptPatchError("delta block points past the end of its block")
    return positions, moved


# Changes turned into positions and moves at a time by ``add_in_place``: ~30 bytes of
# temporaries each, so 8 MiB, where the whole block's took ~120 MiB for an 8 MiB block of
# BF16 words that all moved (an apply -j16 of such blocks held 2 GB).
_CHUNK = 1 << 18


def add_in_place(old: np.ndarray, payload: bytes, word: int) -> bool:
    """Apply a delta payload to ``old`` (uint8, writable) in place, a chunk of changes at a
    time; on a damaged payload ``old`` may be partly patched (as ``codecs.patch_in_place``)."""
    nwords = old.size // word
    count, gap_planes, value_planes = _planes(payload, word, nwords)
    before = -1
    for start in range(0, count, _CHUNK):
        stop = min(count, start + _CHUNK)
        positions, moved = _moves(
            [p[start:stop] for p in gap_planes],
            [p[start:stop] for p in value_planes],
            word,
            before,
        )
        if positions[-1] >= nwords:
            raise CorruptPatchError("delta block points past the end of its block")
        add_moves(old, positions, moved, word)
        before = int(positions[-1])
    return True


def _planes(
    payload: bytes, word: int, nwords: int
) -> tuple[int, list[np.ndarray], list[np.ndarray]]:
    """A delta payload's change count and its gap and value planes (``count`` bytes each; a
    plane stored as size 0 is zeros)."""
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
    planes = []
    zeros = None
    for size in sizes:
        if size:
            data = _zstd.decompress(view[offset : offset + size], count)
            planes.append(np.frombuffer(data, np.uint8))
        else:
            zeros = np.zeros(count, np.uint8) if zeros is None else zeros
            planes.append(zeros)
        offset += size
    return count, planes[:gap_bytes], planes[gap_bytes:]


def _moves(
    gap_planes: list[np.ndarray], value_planes: list[np.ndarray], word: int, before: int
) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, the first after ``before``) and unsigned moves from plane slices."""
    steps = gap_planes[0].astype(np.int64)
    for p, plane in enumerate(gap_planes[1:], start=1):
        if plane.any():
            steps |= plane.astype(np.int64) << (8 * p)
    steps += 1
    positions = np.cumsum(steps)
    positions += before
    utype, stype = _UINT[word], _SINT[word]
    zigzag = value_planes[0].astype(utype)
    for p, plane in enumerate(value_planes[1:], start=1):
        if plane.any():
            zigzag |= plane.astype(utype) << utype(8 * p)
    signed = (zigzag >> utype(1)).view(stype) ^ -(zigzag & utype(1)).view(stype)
    return positions, signed.view(utype)


def _plane(values: np.ndarray, width: int, index: int) -> np.ndarray:
    """Byte ``index`` (0 = least significant) of each little-endian ``width``-byte value."""
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, width)[:, index])
