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


def decompress(data: bytes | memoryview, size: int) -> bytes:
    """Decompress one frame that must hold exactly ``size`` bytes."""
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        params = zstandard.get_frame_parameters(data)
        if params.content_size != size:
            raise CorruptPatchError(
                f"zstd frame holds {params.content_size} bytes, expected {size}"
            )
        out = dctx.decompress(data, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptPatchError(f"damaged zstd data: {exc}") from exc
    if len(out) != size:
        raise CorruptPatchError(f"zstd frame holds {len(out)} bytes, expected {size}")
    return out
