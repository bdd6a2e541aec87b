"""Per-thread zstd contexts (zstandard's compressor objects are not thread-safe)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import zstandard

from pulsectl.errors import CorruptPatchError

if TYPE_CHECKING:
    import numpy as np

_local = threading.local()


def compress(data: bytes | memoryview | np.ndarray, level: int) -> bytes:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=False)
    return cctx.compress(memoryview(data))


# Value planes (the zigzag bytes of the moves) are nearly memoryless: a few small values with
# skewed frequencies. zstd's match search finds little in them and its levels 1-3 spend time on
# it for larger output; a fast strategy with a tiny hash table and long minimum matches leaves
# them to zstd's literal Huffman stage. Measured on the value planes of nine benchmark blocks:
# 12% smaller and 2.7x faster than level 3, 5% smaller and 1.8x faster than level 1.
# Above level 3 a plane gets the smaller of these parameters' frame and the level's own: the
# level's own frames alone were 9-10% larger at levels 4-10, 4% at 11-12 and 0-1% above, which
# made patches at levels 4-18 larger than at the default level (the 655 value planes of the demo
# pairs 0->1, 0->4 and a denser one: 368,301 bytes with these parameters, 404,754 at level 9,
# 365,639 at 19; the smaller of the two per frame: 368,247 at 9, 362,607 at 19). These
# parameters cost a fifth to a third of level 4's time on the same planes.
PLANE_FAST_LEVEL = 3  # levels up to this one compress value planes with the parameters below
_PLANE_PARAMS = {
    "window_log": 17,
    "hash_log": 6,
    "chain_log": 6,
    "search_log": 1,
    "min_match": 7,
    "target_length": 0,
    "strategy": zstandard.STRATEGY_FAST,
    "write_content_size": 1,  # the reader checks each frame's size
    "write_checksum": 0,  # blocks carry their own checksum
}


def compress_plane(data: bytes | memoryview | np.ndarray, level: int) -> bytes:
    """One zstd frame of a value plane: the literal-oriented parameters up to level
    ``PLANE_FAST_LEVEL``; above it, the smaller of their frame and the level's own (the level's
    own parameters alone give larger frames on these bytes, see above)."""
    cctx = getattr(_local, "plane_cctx", None)
    if cctx is None:
        params = zstandard.ZstdCompressionParameters(**_PLANE_PARAMS)
        cctx = _local.plane_cctx = zstandard.ZstdCompressor(compression_params=params)
    fast = cctx.compress(memoryview(data))
    if level <= PLANE_FAST_LEVEL:
        return fast
    own = compress(data, level)
    return own if len(own) <= len(fast) else fast


def decompress(data: bytes | memoryview, size: int, *, at_most: bool = False) -> bytes:
    """Decompress one frame that must hold exactly ``size`` bytes (with ``at_most``: any number
    up to ``size``, as its header says) and be all of ``data``: bytes after it, a second frame
    among them, are damage (docs/FORMAT.md), not something to skip."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        params = zstandard.get_frame_parameters(data)
        if at_most and 0 <= params.content_size <= size:
            size = params.content_size
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            raise CorruptPatchError(f"zstd frame does not state its size (expected {size})")
        if params.content_size != size:
            raise CorruptPatchError(
                f"zstd frame holds {params.content_size} bytes, expected {size}"
            )
        out = dctx.decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptPatchError(f"damaged zstd data: {exc}") from exc
    if len(out) != size:
        raise CorruptPatchError(f"zstd frame holds {len(out)} bytes, expected {size}")
    return out
