"""Raw codecs: the new bytes, stored or zstd-compressed."""

from __future__ import annotations

import numpy as np

from pulsectl import _zstd


def compress(new: np.ndarray, level: int) -> bytes:
    return _zstd.compress(memoryview(new), level)


def decompress(payload: bytes, nbytes: int) -> np.ndarray:
    return np.frombuffer(_zstd.decompress(payload, nbytes), dtype=np.uint8)
