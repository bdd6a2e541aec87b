"""The context delta codec (codec id 4, and 7 with value plane 0 paired), used by
``--level max``.

The receiver holds the base, so anything computed from it is free. A word's chance of changing
depends mostly on its exponent: an Adam step is about the same size everywhere, while the BF16
rounding step (one unit in the last place) doubles with each exponent. This codec groups the
block's words by a *key* read from the base word (its exponent field), so each group has its own
change rate, and codes, per group, the gaps between changed words with a Rice code whose
parameter fits that group's rate. Values are coded as in codec 3, in the same order, so that
runs of similar moves sit together.

Both directions run in the compiled loops where they are built (``_speedups.context_encode``
and ``context_scatter``, which applies a payload to the base block in place); the numpy code
is their reference and the fallback, and gives the same bytes.

Payload layout (little-endian), mirrored in docs/FORMAT.md:
  u32 count, u8 word, u8 key_shift, u8 key_bits, u8 reserved (0),
  u16 contexts, u16 reserved (0), u32 table_bytes, the context table as one zstd frame of
  contexts x 7 bytes: all u16 keys (ascending), then all u8 rice_k, then all u32 changes,
  u32 unary_bytes, unary stream, u32 remainder_bytes, remainder stream,
  word x u32 value plane sizes, value planes (plane 0 paired in codec 7: ``_bits.paired_plane``).
"""

from __future__ import annotations

import struct

import numpy as np

from pulsectl import _zstd
from pulsectl.codecs import _fast
from pulsectl.codecs._bits import (
    MAX_RICE_K,
    add_moves,
    best_rice,
    compress_planes,
    moves_planes,
    pack_bits,
    pack_unary,
    take_sized,
    unpack_bits,
    unpack_moves,
    unpack_unary,
    value_plane_bytes,
)
from pulsectl.errors import CorruptPatchError

# The value planes are compressed with the default level's literal-oriented settings, not at
# the level of `--level max` (19), which took 10-60 times as long for planes 4-18% smaller. On
# the nine 1 GB benchmark pairs `--level max` diffs took 3.9-67 s with level 19 and the numpy
# encoder, 1.1-4.4 s with these settings and the compiled one; its patches grew 2.7-7.0%
# (0.275-0.300x the v3.1 layout -> 0.290-0.315x; the bound of #3 is 0.33x).
PLANE_LEVEL = _zstd.PLANE_FAST_LEVEL

_HEAD = struct.Struct("<IBBBBHH")
_CTX_BYTES = 7  # per context: u16 key, u8 rice_k, u32 changes (stored column by column)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

# Exponent fields (shift, bits) of the float dtypes, on the word the codec sees.
KEYS: dict[str, tuple[int, int]] = {
    "BF16": (7, 8),
    "F16": (10, 5),
    "F32": (23, 8),
    "C64": (23, 8),
    "F64": (52, 11),
    "F8_E4M3": (3, 4),
    "F8_E5M2": (2, 5),
    "F8_E4M3FNUZ": (3, 4),
    "F8_E5M2FNUZ": (2, 5),
}


def keys_of(old: np.ndarray, word: int, key: tuple[int, int]) -> np.ndarray:
    """The context key of every base word: its bits [shift, shift + bits)."""
    shift, bits = key
    words = old.view(_UINT[word])
    field = (words >> _UINT[word](shift)) & _UINT[word]((1 << bits) - 1)
    return field.astype(np.uint8 if bits <= 8 else np.uint16)


def encode(
    old: np.ndarray,
    new: np.ndarray,
    word: int,
    positions: np.ndarray,
    key: tuple[int, int],
    level: int,
    pair: bool = False,
) -> tuple[bytes, bool]:
    """Payload for the changed words at ``positions`` (sorted, non-empty), and whether its value
    plane 0 is paired (codec 7; only when ``pair`` and pairing pays), else codec 4's."""
    fast = _fast.native if old.flags.c_contiguous and new.flags.c_contiguous else None
    if fast is not None:
        raw_table, unary, remainder, raw_planes = fast.context_encode(
            old, new, word, key[0], key[1], positions.astype(np.int64, copy=False)
        )
        count = positions.size
        planes = [memoryview(raw_planes)[p * count : (p + 1) * count] for p in range(word)]
        values = compress_planes(planes, min(level, PLANE_LEVEL), pair)
        payload = _payload(count, word, key, raw_table, unary, remainder, values.joined(), level)
        return payload, values.paired
    return _encode_numpy(old, new, word, positions, key, level, pair)


def _payload(
    count: int,
    word: int,
    key: tuple[int, int],
    raw_table: bytes,
    unary: bytes,
    remainder: bytes,
    values: bytes,
    level: int,
) -> bytes:
    """A payload from its parts: the context table before compression, the unary and
    remainder streams, and the value planes already joined (``join_planes``)."""
    table = _zstd.compress(raw_table, level)
    parts = [
        _HEAD.pack(count, word, key[0], key[1], 0, len(raw_table) // _CTX_BYTES, 0),
        struct.pack("<I", len(table)),
        table,
        struct.pack("<I", len(unary)),
        unary,
        struct.pack("<I", len(remainder)),
        remainder,
        values,
    ]
    return b"".join(parts)


def _encode_numpy(
    old: np.ndarray,
    new: np.ndarray,
    word: int,
    positions: np.ndarray,
    key: tuple[int, int],
    level: int,
    pair: bool = False,
) -> tuple[bytes, bool]:
    """``encode`` without the compiled loops (the reference its C path is tested against)."""
    fast = _fast.native if old.flags.c_contiguous else None
    found = None  # each change's rank, in position order, when the compiled loop finds them
    if fast is not None:
        # One pass over the block counts each key's words so far: a change's rank.
        positions = positions.astype(np.int64, copy=False)
        found, _ = fast.context_ranks(old, word, key[0], key[1], positions)
        change_keys = keys_of(old.view(_UINT[word])[positions].view(np.uint8), word, key)
    else:
        keys = keys_of(old, word, key)
        change_keys = keys[positions]
    order = np.argsort(change_keys, kind="stable")  # contexts ascending, positions within
    positions, change_keys = positions[order], change_keys[order]
    present, first, counts = np.unique(change_keys, return_index=True, return_counts=True)
    if found is not None:
        ranks = np.frombuffer(found, dtype=np.int64)[order]
    else:
        perm, starts, sizes = _group(keys, key[1])
        ranks = np.empty(positions.size, dtype=np.int64)
        for e, lo, n in zip(present, first, counts, strict=True):
            # A stable sort keeps each context's words in position order: ranks by bisection.
            group = perm[starts[e] : starts[e] + sizes[e]]
            ranks[lo : lo + n] = np.searchsorted(group, positions[lo : lo + n])
    # Gaps restart at each context: the first change of a context counts from rank -1.
    prev = np.concatenate(([-1], ranks[:-1]))
    prev[first] = -1
    gaps = ranks - prev - 1
    ks = np.empty(present.size, dtype=np.uint8)
    for i, (lo, n) in enumerate(zip(first, counts, strict=True)):
        ks[i] = best_rice(gaps[lo : lo + n])
    raw_table = present.astype("<u2").tobytes() + ks.tobytes() + counts.astype("<u4").tobytes()
    per_change_k = np.repeat(ks, counts).astype(np.int64)
    unary = pack_unary(gaps >> per_change_k)
    remainder = pack_bits(gaps & ((1 << per_change_k) - 1), per_change_k)
    utype = _UINT[word]
    moved = new.view(utype)[positions] - old.view(utype)[positions]
    values = moves_planes(moved, word, min(level, PLANE_LEVEL), pair)
    payload = _payload(
        positions.size, word, key, raw_table, unary, remainder, values.joined(), level
    )
    return payload, values.paired


def position_bytes(payload: bytes) -> int:
    """Bytes of a context payload before its value planes: header, table and gap streams."""
    view = memoryview(payload)
    offset = _HEAD.size
    for _ in range(3):  # the context table, the unary and the remainder streams
        _, offset = take_sized(view, offset)
    return offset


def decode(old: np.ndarray, payload: bytes, word: int, paired: bool = False) -> np.ndarray:
    """Rebuild the new block (uint8) from the base block and a context-delta payload (codec
    7's when ``paired``)."""
    out = old.copy()
    if not add_in_place(out, payload, word, paired):
        positions, moved = decode_moves(old, payload, word, paired)
        add_moves(out, positions, moved, word)
    return out


def add_in_place(block: np.ndarray, payload: bytes, word: int, paired: bool = False) -> bool:
    """Apply a context payload to ``block`` (uint8, writable: the base block) in place with the
    compiled loop, which finds each change's position and adds its move in one pass over the
    block. False, ``block`` untouched, where that loop is not available: use ``decode_moves``.
    On a damaged payload ``block`` may be partly patched."""
    fast = _fast.native
    if fast is None or not block.flags.c_contiguous or not block.flags.writeable:
        return False
    view, count, shift, bits, present, ks, counts, unary, remainder, offset = _parse(
        payload, word, block.size // word
    )
    planes = value_plane_bytes(view, offset, count, word, paired)
    fast.context_scatter(block, word, shift, bits, present, ks, counts, unary, remainder, planes)
    return True


def _parse(
    payload: bytes, word: int, nwords: int
) -> tuple[
    memoryview, int, int, int, np.ndarray, np.ndarray, np.ndarray, memoryview, memoryview, int
]:
    """A context payload's parts, its table checked: (view, count, shift, bits, keys, ks,
    counts (int64 each), unary, remainder, offset of the value planes)."""
    view = memoryview(payload)
    if len(payload) < _HEAD.size:
        raise CorruptPatchError("context block is shorter than its header")
    count, pword, shift, bits, r1, ncontexts, r2 = _HEAD.unpack_from(payload, 0)
    if pword != word or r1 or r2 or not 1 <= bits <= 16 or shift + bits > 8 * word:
        raise CorruptPatchError("context block header is damaged")
    if not 0 < count <= nwords or not 0 < ncontexts <= min(count, 1 << bits):
        raise CorruptPatchError(f"context block claims {count} changes in {nwords} words")
    packed_table, offset = take_sized(view, _HEAD.size)
    table = np.frombuffer(_zstd.decompress(packed_table, ncontexts * _CTX_BYTES), dtype=np.uint8)
    present = table[: 2 * ncontexts].view("<u2").astype(np.int64)
    ks = table[2 * ncontexts : 3 * ncontexts].astype(np.int64)
    counts = table[3 * ncontexts :].view("<u4").astype(np.int64)
    if (
        np.any(np.diff(present) <= 0)
        or present[-1] >= 1 << bits
        or np.any(ks > MAX_RICE_K)
        or np.any(counts == 0)
        or int(counts.sum()) != count
    ):
        raise CorruptPatchError("context block table is damaged")
    unary, offset = take_sized(view, offset)
    remainder, offset = take_sized(view, offset)
    return view, count, shift, bits, present, ks, counts, unary, remainder, offset


def decode_moves(
    old: np.ndarray, payload: bytes, word: int, paired: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The positions (found with the base's keys) and moves of a context-delta payload (codec
    7's when ``paired``)."""
    nwords = old.size // word
    view, count, shift, bits, present, ks, counts, unary, remainder, offset = _parse(
        payload, word, nwords
    )
    per_change_k = np.repeat(ks, counts)
    # Every quotient is at most its gap and the gaps of a valid block add up to less than
    # nwords, so the first count 0-bits lie in the first count + nwords bits: read no further
    # (a hostile stream of block_bytes + 1 MiB would otherwise unpack to 64 times its size).
    quotients = unpack_unary(unary[: (count + nwords + 7) // 8], count)
    rems = unpack_bits(remainder, per_change_k)
    gaps = (quotients << per_change_k) | rems
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    # Ranks restart at each context: a cumulative sum with the totals of earlier contexts removed.
    steps = gaps + 1
    total = np.cumsum(steps)
    base = np.repeat(total[first] - steps[first], counts)
    ranks = total - base - 1
    fast = _fast.native
    if fast is not None and old.flags.c_contiguous:
        keyed = np.repeat(present, counts)
        found = fast.context_positions(old, word, shift, bits, keyed, ranks)
        return np.frombuffer(found, dtype=np.int64), unpack_moves(view, offset, count, word, paired)
    keys = keys_of(old, word, (shift, bits))
    perm, starts, sizes = _group(keys, bits)
    last = first + counts - 1
    if np.any(ranks[last] >= sizes[present]):
        raise CorruptPatchError("context block points past the end of a context")
    positions = perm[np.repeat(starts[present], counts) + ranks]
    return positions, unpack_moves(view, offset, count, word, paired)


def decode_moves_only(payload: bytes, word: int, nwords: int, paired: bool = False) -> np.ndarray:
    """The moves (``new - old``, unsigned) of a context payload of a block of ``nwords``
    words, without the base.

    Their positions need the base words; the moves alone give statistics (``stats PATCH``).
    """
    view = memoryview(payload)
    if len(payload) < _HEAD.size:
        raise CorruptPatchError("context block is shorter than its header")
    count, pword, _, bits, r1, ncontexts, r2 = _HEAD.unpack_from(payload, 0)
    if pword != word or r1 or r2 or not 1 <= bits <= 16 or count == 0 or ncontexts == 0:
        raise CorruptPatchError("context block header is damaged")
    if count > nwords:
        raise CorruptPatchError(f"context block claims {count} changes in {nwords} words")
    offset = _HEAD.size
    for _ in range(3):  # the context table, the unary and the remainder streams
        _, offset = take_sized(view, offset)
    return unpack_moves(view, offset, count, word, paired)


def _group(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stable order of the words by key, and each key's start and size in that order."""
    perm = np.argsort(keys, kind="stable")
    sizes = np.bincount(keys, minlength=1 << bits)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return perm, starts, sizes
