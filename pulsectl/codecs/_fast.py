"""The compiled inner loops (``pulsectl._speedups``), or None to use numpy.

The extension is built at install when a C compiler is present; every function in it gives the
bytes of the numpy code it replaces (the tests run both and compare). ``PULSECTL_PURE_PYTHON=1``
turns it off, e.g. to rule it out when chasing a bug (0 or unset: on; the CLI refuses other
values, the library warns and leaves it on).

On x86-64 CPUs with AVX-512 (with VBMI and VBMI2) a few loops run in an AVX-512 version, chosen at
import (finding changes, Rice coding and decoding, the context codec's dense walks, pairing value
planes); on those with AVX2 but not AVX-512, finding changes and pairing run in AVX2 versions.
Where the AVX2 loops run and PDEP is fast (Intel, AMD from Zen 3), `--level max` blocks of BF16
words are applied, and encoded from 1 change in 28 words, by the select walk, which finds their
changes 64 words at a time.
``PULSECTL_SIMD=avx512|avx2|portable`` allows at most those loops (same bytes; the tests run
each set this CPU has); ``PULSECTL_NO_AVX512=1`` is ``PULSECTL_SIMD=avx2``.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from pulsectl._env import SIMD_LEVELS, simd_level, switch
from pulsectl.errors import CorruptPatchError


def _load() -> ModuleType | None:
    pure = switch("PULSECTL_PURE_PYTHON")
    if pure is None:  # (the CLI refuses it before it gets here)
        print(
            f"pulsectl: warning: PULSECTL_PURE_PYTHON={os.environ['PULSECTL_PURE_PYTHON']!r} is "
            "not 0 or 1; ignored",
            file=sys.stderr,
        )
    if pure:
        return None
    if sys.byteorder != "little":  # the C loops read little-endian words as native integers
        return None
    try:
        import pulsectl._speedups as _speedups
    except ImportError:
        return None
    _speedups.set_corrupt_error(CorruptPatchError)
    level = simd_level()
    if level is None:  # the CLI refuses it before a command runs (cli.app._check_environment)
        print(
            f"pulsectl: warning: PULSECTL_SIMD={os.environ['PULSECTL_SIMD']!r} is not one of "
            f"{', '.join(SIMD_LEVELS)}; ignored",
            file=sys.stderr,
        )
        level = ""
    if not level and switch("PULSECTL_NO_AVX512"):
        level = "avx2"
    if level:
        _speedups.simd(level)
    return _speedups


native = _load()


def describe() -> str:
    """Which inner loops this process runs, for ``pulsectl --version`` and bug reports."""
    if native is not None:
        return f"compiled, {native.simd(None)}"
    if switch("PULSECTL_PURE_PYTHON"):
        return "numpy (PULSECTL_PURE_PYTHON is set)"
    return "numpy (the C extension was not built: no C compiler at install?)"
