"""Switching the compiled loops (pulsectl/_speedups.c) off and on, for tests that compare them
with numpy and their AVX-512 and AVX2 versions with the portable ones."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pulsectl.codecs import _fast


@contextmanager
def pure_numpy() -> Iterator[None]:
    """The codecs without the compiled loops while inside (``_fast.native`` is None)."""
    saved = _fast.native
    _fast.native = None
    try:
        yield
    finally:
        _fast.native = saved


def simd_modes() -> Iterator[str]:
    """Run the loop body with each set of loops this CPU has: the AVX-512 ones, the AVX2 ones,
    then the portable ones; the extension must be built."""
    native = _fast.native
    assert native is not None
    saved = native.simd(None)
    seen: set[str] = set()
    try:
        for level in ("avx512", "avx2", "portable"):
            loops = native.simd(level)
            if loops not in seen:
                seen.add(loops)
                yield loops
    finally:
        native.simd(saved)
