"""Where pulsectl's bytes go: gap planes, value planes and block headers of its delta codec.

Re-encodes each tensor block by block with pulsectl's own codec functions (same block size and
level as ``pulsectl diff``) and reads the plane sizes from each payload's header. This leans on
internals (pulsectl.codecs.delta's payload layout), so any failure only drops the breakdown.
"""

from __future__ import annotations

import struct

import numpy as np

from benchmarks.v31 import Pair


def measure(pairs: dict[str, Pair], level: int | None = None) -> dict[str, int]:
    from pulsectl.codecs import delta
    from pulsectl.diff import DEFAULT_LEVEL
    from pulsectl.format import DEFAULT_BLOCK_BYTES

    level = DEFAULT_LEVEL if level is None else level

    head = struct.Struct("<IBBH")
    totals = {
        "blocks": 0,
        "delta_blocks": 0,
        "gap_plane_bytes": 0,
        "value_plane_bytes": 0,
        "payload_header_bytes": 0,
        "changed": 0,
    }
    per_block = DEFAULT_BLOCK_BYTES // 2
    for pair in pairs.values():
        old8 = np.asarray(pair.old).view(np.uint8)
        new8 = np.asarray(pair.new).view(np.uint8)
        for a in range(0, pair.old.size, per_block):
            b = min(pair.old.size, a + per_block)
            o, n = old8[2 * a : 2 * b], new8[2 * a : 2 * b]
            totals["blocks"] += 1
            pos = delta.find_changes(o, n, 2)
            if pos.size == 0:
                continue
            payload = delta.encode(o, n, 2, pos, level)
            count, gap_bytes, word, _ = head.unpack_from(payload, 0)
            sizes = struct.unpack_from(f"<{gap_bytes + word}I", payload, head.size)
            totals["delta_blocks"] += 1
            totals["changed"] += count
            totals["gap_plane_bytes"] += sum(sizes[:gap_bytes])
            totals["value_plane_bytes"] += sum(sizes[gap_bytes:])
            totals["payload_header_bytes"] += head.size + 4 * len(sizes)
    return totals
