"""Where pulsectl's bytes go: positions, value planes, payload headers and whole blocks.

Re-encodes each tensor block by block with ``pulsectl.codecs.encode_block`` (the block size and
level of ``pulsectl diff``, so the same codec choices) and splits each payload by its layout:
the position streams (Rice streams of codecs 5 and 6, gap planes of codec 3), the value planes
(with the paired plane 0's length of codec 6), the fixed headers and length fields, and blocks
stored whole (codecs 1 and 2). This leans on internals (the payload layouts), so any failure only
drops the breakdown.
"""

from __future__ import annotations

import struct

import numpy as np

from benchmarks.v31 import Pair


def split(codec: int, payload: bytes, word: int) -> dict[str, int]:
    """One block's payload as positions, values, headers and whole-block bytes."""
    from pulsectl.codecs import (
        CODEC_DELTA,
        CODEC_RICE,
        CODEC_STORE,
        CODEC_ZSTD,
        plain_codec,
        rice,
    )

    plain, _ = plain_codec(codec)
    if plain in (CODEC_STORE, CODEC_ZSTD):
        return {"whole": len(payload)}
    if plain == CODEC_DELTA:
        head = struct.Struct("<IBBH")
        _, gap_bytes, _, _ = head.unpack_from(payload, 0)
        sizes = struct.unpack_from(f"<{gap_bytes + word}I", payload, head.size)
        positions = sum(sizes[:gap_bytes])
    elif plain == CODEC_RICE:
        _, _, _, unary, remainder, offset = rice._streams(payload, word, 1 << 62)
        positions = len(unary) + len(remainder)
        sizes = struct.unpack_from(f"<{word}I", payload, offset)
    else:
        raise ValueError(f"codec {codec} is not one the default level writes")
    values = sum(sizes[-word:])
    return {
        "positions": positions,
        "values": values,
        "headers": len(payload) - positions - values,
    }


def measure(pairs: dict[str, Pair], level: int | None = None) -> dict[str, int]:
    from pulsectl.codecs import encode_block
    from pulsectl.diff import DEFAULT_LEVEL
    from pulsectl.format import DEFAULT_BLOCK_BYTES

    level = DEFAULT_LEVEL if level is None else level
    totals = dict.fromkeys(
        ("blocks", "delta_blocks", "positions", "values", "headers", "whole", "changed"), 0
    )
    per_block = DEFAULT_BLOCK_BYTES // 2
    for pair in pairs.values():
        old8 = np.asarray(pair.old).view(np.uint8)
        new8 = np.asarray(pair.new).view(np.uint8)
        for a in range(0, pair.old.size, per_block):
            b = min(pair.old.size, a + per_block)
            block = encode_block(old8[2 * a : 2 * b], new8[2 * a : 2 * b], 2, level)
            totals["blocks"] += 1
            totals["changed"] += block.changed
            if not block.payload:
                continue
            parts = split(block.codec, block.payload, 2)
            totals["delta_blocks"] += "positions" in parts
            for name, size in parts.items():
                totals[name] += size
    return totals
