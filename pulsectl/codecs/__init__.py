"""Block codecs: how one block of an item's bytes is stored in a frame.

A block is at most ``block_bytes`` of one tensor (or blob). Each block names its codec, so codecs
can improve without a new container. Codec ids are part of the format (docs/FORMAT.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pulsectl.codecs import context, delta, raw, rice
from pulsectl.errors import CorruptPatchError

CODEC_COPY = 0  # identical to the base block; empty payload
CODEC_STORE = 1  # the new bytes verbatim
CODEC_ZSTD = 2  # the new bytes, one zstd frame
CODEC_DELTA = 3  # changed positions and word differences (pulsectl.codecs.delta)
CODEC_CONTEXT = 4  # the same, positions grouped by the base word's exponent (codecs.context)
CODEC_RICE = 5  # codec 3 with Rice-coded gaps (codecs.rice)

CODEC_NAMES = {
    CODEC_COPY: "copy",
    CODEC_STORE: "store",
    CODEC_ZSTD: "zstd",
    CODEC_DELTA: "delta",
    CODEC_CONTEXT: "context",
    CODEC_RICE: "rice",
}

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
    if positions is None:
        positions = delta.find_changes(old, new, word)
    if positions.size == 0:
        return EncodedBlock(CODEC_COPY, b"", 0)
    moved = new.view(_UINT[word])[positions] - old.view(_UINT[word])[positions]
    # With the context codec on (`--level max`) codecs 3 and 5 are only its fallback: probing
    # them at a fast zstd level saves half of the encoding time and rarely changes the choice.
    probe = min(level, _PROBE_LEVEL) if key is not None else level
    best = EncodedBlock(
        CODEC_DELTA, delta.encode_moves(positions, moved, word, probe), positions.size
    )
    payload = rice.encode_moves(positions, moved, word, probe)
    if len(payload) < len(best.payload):
        best = EncodedBlock(CODEC_RICE, payload, positions.size)
    if key is not None:
        payload = context.encode(old, new, word, positions, key, level)
        if len(payload) < len(best.payload):
            best = EncodedBlock(CODEC_CONTEXT, payload, positions.size)
    if positions.size > _DENSE_FRACTION * nwords:
        # Changed words are mostly random mantissa bits: a high zstd level buys nothing on them
        # and costs seconds per block, so the raw alternative is probed at a fast level.
        alt = _smallest_raw(new, min(level, _PROBE_LEVEL), positions.size)
        if len(alt.payload) < len(best.payload):
            best = alt
    if len(best.payload) >= new.size:
        best = EncodedBlock(CODEC_STORE, new.tobytes(), positions.size)
    return best


def _smallest_raw(new: np.ndarray, level: int, changed: int) -> EncodedBlock:
    packed = raw.compress(new, level)
    if len(packed) < new.size:
        return EncodedBlock(CODEC_ZSTD, packed, changed)
    return EncodedBlock(CODEC_STORE, new.tobytes(), changed)


def decode_moves(
    codec: int, payload: bytes, old: np.ndarray, word: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """For a delta block (codecs 3, 4, 5): its changed word positions and their moves
    (``new - old``, unsigned), so the caller can scatter them itself (e.g. on a GPU).
    None for the other codecs."""
    nwords = old.size // word
    if codec == CODEC_DELTA:
        return delta.decode_moves(payload, word, nwords)
    if codec == CODEC_RICE:
        return rice.decode_moves(payload, word, nwords)
    if codec == CODEC_CONTEXT:
        return context.decode_moves(old, payload, word)
    return None


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
    if codec == CODEC_DELTA:
        if old is None:
            raise CorruptPatchError("delta block for an item that has no base")
        return delta.decode(old, payload, word)
    if codec == CODEC_RICE:
        if old is None:
            raise CorruptPatchError("rice block for an item that has no base")
        return rice.decode(old, payload, word)
    if codec == CODEC_CONTEXT:
        if old is None:
            raise CorruptPatchError("context block for an item that has no base")
        return context.decode(old, payload, word)
    raise CorruptPatchError(f"unknown block codec {codec}")
