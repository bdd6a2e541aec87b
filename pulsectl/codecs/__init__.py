"""Block codecs: how one block of an item's bytes is stored in a frame.

A block is at most ``block_bytes`` of one tensor (or blob). Each block names its codec, so codecs
can improve without a new container. Codec ids are part of the format (docs/FORMAT.md).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from pulsectl.codecs import _fast, context, delta, raw, rice
from pulsectl.codecs._bits import change_planes, order0_bits, rice_cost
from pulsectl.errors import CorruptPatchError, FormatError

CODEC_COPY = 0  # identical to the base block; empty payload
CODEC_STORE = 1  # the new bytes verbatim
CODEC_ZSTD = 2  # the new bytes, one zstd frame
CODEC_DELTA = 3  # changed positions and word differences (pulsectl.codecs.delta)
CODEC_CONTEXT = 4  # the same, positions grouped by the base word's exponent (codecs.context)
CODEC_RICE = 5  # codec 3 with Rice-coded gaps (codecs.rice)
CODEC_RICE_PAIRED = 6  # codec 5 with value plane 0 in pairs (codecs._bits.paired_plane)
CODEC_CONTEXT_PAIRED = 7  # codec 4 likewise

CODEC_NAMES = {
    CODEC_COPY: "copy",
    CODEC_STORE: "store",
    CODEC_ZSTD: "zstd",
    CODEC_DELTA: "delta",
    CODEC_CONTEXT: "context",
    CODEC_RICE: "rice",
    CODEC_RICE_PAIRED: "rice-paired",
    CODEC_CONTEXT_PAIRED: "context-paired",
}

# The delta codecs: each stores the changed words' moves (new - old); the paired ones store value
# plane 0 in pairs, otherwise as their plain twin.
DELTA_CODECS = (CODEC_DELTA, CODEC_CONTEXT, CODEC_RICE, CODEC_RICE_PAIRED, CODEC_CONTEXT_PAIRED)
_PLAIN_OF = {CODEC_RICE_PAIRED: CODEC_RICE, CODEC_CONTEXT_PAIRED: CODEC_CONTEXT}


def plain_codec(codec: int) -> tuple[int, bool]:
    """A codec id as (its plain twin's id, whether plane 0 is paired): (5, True) for 6."""
    return _PLAIN_OF.get(codec, codec), codec in _PLAIN_OF


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

_PROBE_LEVEL = 3

# Above this fraction of changed words the raw codecs are tried as well.
_DENSE_FRACTION = 0.05


@dataclass(frozen=True)
class EncodedBlock:
    codec: int
    payload: bytes
    changed: int  # words that differ from the base; every word when there is no base


def encode_block(
    old: np.ndarray | None,
    new: np.ndarray,
    word: int,
    level: int,
    key: tuple[int, int] | None = None,
    positions: np.ndarray | None = None,
) -> EncodedBlock:
    """Encode ``new`` (uint8) against ``old`` (uint8, same length, or None) in the smallest codec.

    ``key`` (the exponent field of the dtype, see ``context.KEYS``) enables the context codec.
    ``positions``, when given, are the changed words already found (e.g. on a GPU).
    """
    nwords = new.size // word
    if old is None:
        return _smallest_raw(new, level, nwords)
    raw_planes = None  # the value planes before compression, when found with the changes
    if positions is None:
        if _fast.native is not None and old.flags.c_contiguous and new.flags.c_contiguous:
            positions, raw_planes = _list_changes(old, new, word)
        else:
            positions = delta.find_changes(old, new, word)
    if positions.size == 0:
        return EncodedBlock(CODEC_COPY, b"", 0)
    # With the context codec on (`--level max`) codecs 3 and 5 are only its fallback: probing
    # them at a fast zstd level saves half of the encoding time and rarely changes the choice.
    probe = min(level, _PROBE_LEVEL) if key is not None else level
    best = None
    context_block = None
    fits = None  # whether one Rice parameter codes the gaps well (codec 3 is tried if not)
    if key is not None:
        payload, paired = context.encode(old, new, word, positions, key, level, pair=True)
        codec = CODEC_CONTEXT_PAIRED if paired else CODEC_CONTEXT
        context_block = EncodedBlock(codec, payload, positions.size)
        # Codec 4 stores the moves of codec 5 in another order, with planes compressed alike.
        # When its positions take no more bytes than codec 5's gaps would (nearly always: a
        # word's exponent tells how likely it is to change), codec 5 would only lose: it is
        # not built, which saves a third of the encoding time of `--level max`; nor are its
        # gap streams, only measured.
        k, unary_bytes, remainder_bytes = rice.rice_size(positions)
        fits = _rice_fits(positions, k)
        if fits and context.position_bytes(payload) <= unary_bytes + remainder_bytes:
            best = context_block
    if best is None:
        streams = rice.rice_streams(positions)
        if fits is None:
            fits = _rice_fits(positions, streams[0])
        values = change_planes(old, new, positions, word, probe, raw_planes, pair=True)
        best = EncodedBlock(
            CODEC_RICE_PAIRED if values.paired else CODEC_RICE,
            rice.encode_moves(positions, None, word, probe, values=values, streams=streams),
            positions.size,
        )
        if not fits:
            # Gaps far from geometric (runs, rows, strides): codec 3's zstd planes can find them.
            payload = delta.encode_moves(positions, None, word, probe, values=values.plain())
            if len(payload) < len(best.payload):
                best = EncodedBlock(CODEC_DELTA, payload, positions.size)
        if context_block is not None and len(context_block.payload) < len(best.payload):
            best = context_block
    if positions.size > _DENSE_FRACTION * nwords and _raw_might_win(new, len(best.payload)):
        # Changed words are mostly random mantissa bits: a high zstd level buys nothing on them
        # and costs seconds per block, so the raw alternative is probed at a fast level.
        alt = _smallest_raw(new, min(level, _PROBE_LEVEL), positions.size)
        if len(alt.payload) < len(best.payload):
            best = alt
    if len(best.payload) >= new.size:
        best = EncodedBlock(CODEC_STORE, new.tobytes(), positions.size)
    return best


# Each thread lists changes into buffers of its own, kept from block to block: fresh buffers
# for each block cost page faults and a copy, a fifth of the default level's encoding time
# when a third of the words change.
_listing = threading.local()


def _list_changes(
    old: np.ndarray, new: np.ndarray, word: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The positions of the words that differ and the raw zigzag planes of their moves
    (``_speedups.changes_into``), as views of this thread's buffers: valid until the thread
    lists again, so they must not outlive the block's encoding."""
    fast = _fast.native
    assert fast is not None
    need = new.size // word + 1
    positions = getattr(_listing, "positions", None)
    if positions is None or positions.size < need:
        positions = _listing.positions = np.empty(need, dtype=np.int64)
        _listing.planes = None
    cap = positions.size
    planes = getattr(_listing, "planes", None)
    if planes is None or planes.size < word * cap:
        planes = _listing.planes = np.empty(word * cap, dtype=np.uint8)
    count = fast.changes_into(old, new, word, positions, planes)
    return positions[:count], [planes[p * cap : p * cap + count] for p in range(word)]


# Codec 3 is tried only when Rice coding spends this much more than the gaps' order-0 entropy.
_RICE_SLACK = 1.1
_ESTIMATE_SAMPLE = 1 << 13
# Up to this many changes, Rice coding is taken without the check (which cost ~25 us a block,
# a quarter of diff's time on a checkpoint of 50,000 small tensors).
_FEW = 64


def _rice_fits(positions: np.ndarray, k: int) -> bool:
    """Whether one Rice parameter codes the gaps between ``positions`` close to their order-0
    entropy.

    The gaps of an Adam step's changes are close to geometric, where Rice coding is within a
    few hundredths of a bit of the entropy and codec 3 is never smaller (measured: rice alone
    is within 0.2% of the better of the two on every pair of the benchmark). Clustered or
    strided changes have a much lower entropy than Rice coding reaches.
    """
    if positions.size <= _FEW:
        return True  # a few dozen bytes of gaps: codec 3's planes would not pay their frames
    if positions.size > _ESTIMATE_SAMPLE:  # an estimate: every n-th gap is enough
        at = np.arange(0, positions.size, positions.size // _ESTIMATE_SAMPLE)
        before = positions[np.maximum(at - 1, 0)]
        before[0] = -1
        gaps = positions[at] - before - 1
    else:
        gaps = np.diff(positions, prepend=-1) - 1
    return rice_cost(gaps, k) <= _RICE_SLACK * order0_bits(gaps) + 64


# Four slices of 16 KiB, one from the middle of each quarter of the block, judge it better
# than one slice of 512 KiB did, at an eighth of the cost: the single slice took 1.05 ms per
# 8 MiB block (0.13 s per GB of a diff over 5% changed), the four 0.14 ms.
_SAMPLE_BYTES = 16 * 1024
_SAMPLES = 4


def _raw_might_win(new: np.ndarray, best: int) -> bool:
    """Whether compressing the whole block could beat ``best`` bytes, judged from a sample.

    Compressing a dense block whole costs more than encoding its changes; a few slices of it,
    compressed at the fastest level, tell whether the block is compressible at all (BF16
    weights are not much: their low mantissa bits are random).
    """
    if new.size <= 2 * _SAMPLES * _SAMPLE_BYTES:
        return True
    packed = 0
    for i in range(_SAMPLES):
        at = ((2 * i + 1) * new.size // (2 * _SAMPLES)) & ~7
        packed += len(raw.compress(new[at : at + _SAMPLE_BYTES], 1))
    estimate = packed * (new.size / (_SAMPLES * _SAMPLE_BYTES))
    return estimate < 1.25 * best


def _smallest_raw(new: np.ndarray, level: int, changed: int) -> EncodedBlock:
    packed = raw.compress(new, level)
    if len(packed) < new.size:
        return EncodedBlock(CODEC_ZSTD, packed, changed)
    return EncodedBlock(CODEC_STORE, new.tobytes(), changed)


def decode_moves(
    codec: int, payload: bytes, old: np.ndarray, word: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """For a delta block (codecs 3-7): its changed word positions and their moves
    (``new - old``, unsigned), so the caller can scatter them itself (e.g. on a GPU).
    None for the other codecs."""
    nwords = old.size // word
    codec, paired = plain_codec(codec)
    if codec == CODEC_DELTA:
        return delta.decode_moves(payload, word, nwords)
    if codec == CODEC_RICE:
        return rice.decode_moves(payload, word, nwords, paired)
    if codec == CODEC_CONTEXT:
        return context.decode_moves(old, payload, word, paired)
    return None


def patch_in_place(codec: int, payload: bytes, old: np.ndarray, word: int) -> bool:
    """Apply a delta block to ``old`` (uint8, writable) in place where a compiled loop does it
    in one pass (codecs 5 and 6, the default level's, and 4 and 7, ``--level max``'s), or
    numpy a chunk of changes at a time (codec 3, whose whole-block decoding holds ~15 times
    the block); False,
    ``old`` untouched, otherwise: then use ``decode_moves`` or ``decode_block``. On a damaged
    payload ``old`` may be partly patched."""
    codec, paired = plain_codec(codec)
    if codec == CODEC_RICE:
        return rice.add_in_place(old, payload, word, paired)
    if codec == CODEC_CONTEXT:
        return context.add_in_place(old, payload, word, paired)
    if codec == CODEC_DELTA:
        return delta.add_in_place(old, payload, word)
    return False


def decode_block(
    codec: int, payload: bytes, old: np.ndarray | None, nbytes: int, word: int
) -> np.ndarray:
    """Rebuild a block's ``nbytes`` new bytes (uint8 array) from its payload and the base block."""
    if codec == CODEC_COPY:
        if old is None:
            raise CorruptPatchError("copy block for an item that has no base")
        if payload:
            raise CorruptPatchError("copy block carries a payload")
        return old
    if codec == CODEC_STORE:
        if len(payload) != nbytes:
            raise CorruptPatchError(f"stored block has {len(payload)} bytes, expected {nbytes}")
        return np.frombuffer(payload, dtype=np.uint8)
    if codec == CODEC_ZSTD:
        return raw.decompress(payload, nbytes)
    if codec not in DELTA_CODECS:
        raise unknown_codec(codec)
    if old is None:
        raise CorruptPatchError(f"{CODEC_NAMES[codec]} block for an item that has no base")
    plain, paired = plain_codec(codec)
    if plain == CODEC_DELTA:
        return delta.decode(old, payload, word)
    if plain == CODEC_RICE:
        return rice.decode(old, payload, word, paired)
    return context.decode(old, payload, word, paired)


def unknown_codec(codec: int) -> FormatError:
    """A codec id this build does not know, in a block whose checksum holds: new codecs come
    as new ids (docs/FORMAT.md), so the patch is most likely a newer pulsectl's (exit 1, as an
    unknown version is; not 3, which would have a pipeline fetch it again and again)."""
    return FormatError(
        f"unknown block codec {codec}: made by a newer pulsectl? this one is "
        f"{_version()}: upgrade it to read the patch"
    )


def _version() -> str:
    from pulsectl import __version__

    return __version__


def check_block(codec: int, payload: bytes, nbytes: int, has_base: bool) -> None:
    """What can be checked of a block without the base bytes: a known codec that fits the
    item (a delta or copy block needs a base), a copy block's empty payload, a stored block's
    size and a zstd frame's declared size. For ``inspect --check``; decoding checks the rest."""
    if codec not in CODEC_NAMES:
        raise unknown_codec(codec)
    if not has_base and (codec == CODEC_COPY or codec in DELTA_CODECS):
        raise CorruptPatchError(f"{CODEC_NAMES[codec]} block for an item that has no base")
    if codec == CODEC_COPY and payload:
        raise CorruptPatchError("copy block carries a payload")
    if codec == CODEC_STORE and len(payload) != nbytes:
        raise CorruptPatchError(f"stored block has {len(payload)} bytes, expected {nbytes}")
    if codec == CODEC_ZSTD:
        import zstandard

        try:
            size = zstandard.frame_content_size(payload)
        except zstandard.ZstdError:
            size = -2
        if size != nbytes:
            raise CorruptPatchError(f"zstd block does not declare its {nbytes} bytes")
