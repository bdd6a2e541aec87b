"""Switching the compiled loops (pulsectl/_speedups.c) off and on, for tests that compare them
with numpy and their AVX-512 versions with the portable ones."""

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
    """Run the loop body with the AVX-512 loops (where this CPU has them), then the portable
    ones; the extension must be built."""
    native = _fast.native
    assert native is not None
    saved = native.simd(None)
    try:
        for on in (True, False):
            yield native.simd(on)
    finally:
        native.simd(saved == "avx512")
