"""The settings pulsectl reads from the environment.

Switches take ``1`` (on) or ``0`` (off); ``PULSECTL_SIMD`` takes one of ``SIMD_LEVELS``. Unset or
empty, each has its default. The CLI refuses any other value before it runs a command
(``bad_setting``); the library falls back to the default. Standard library only:
``pulsectl._prehash`` reads one before the heavy imports.
"""

from __future__ import annotations

import os

# Each switch and its default (what unset or empty means).
SWITCHES = {
    "PULSECTL_PREHASH": True,  # hash the inputs in a child process (pulsectl._prehash)
    "PULSECTL_PURE_PYTHON": False,  # numpy instead of the compiled loops (codecs._fast)
    "PULSECTL_NO_AVX512": False,  # PULSECTL_SIMD=avx2, kept for older scripts (codecs._fast)
    "PULSECTL_DEBUG": False,  # tracebacks on errors, as -v (cli)
}
_VALUES = {"1": True, "0": False}
SIMD = "PULSECTL_SIMD"
SIMD_LEVELS = ("avx512", "avx2", "portable")  # the most loops first (codecs._fast)


def switch(name: str) -> bool | None:
    """Whether switch ``name`` is on; None where it is set to something other than 1, 0 or
    nothing."""
    value = os.environ.get(name, "")
    return SWITCHES[name] if value == "" else _VALUES.get(value)


def simd_level() -> str | None:
    """``PULSECTL_SIMD``: one of ``SIMD_LEVELS``, "" when unset or empty, None when set to
    anything else."""
    value = os.environ.get(SIMD, "")
    return value if value in ("", *SIMD_LEVELS) else None


def bad_setting() -> tuple[str, str, str] | None:
    """The first setting with a value it does not take: its name, that value and what it
    takes; None if every one is unset or valid."""
    for name, default in SWITCHES.items():
        if switch(name) is None:
            what = f"give 1 (on) or 0 (off), or unset it ({'on' if default else 'off'} by default)"
            return name, os.environ[name], what
    if simd_level() is None:
        levels = ", ".join(SIMD_LEVELS[:-1]) + f" or {SIMD_LEVELS[-1]}"
        what = f"give {levels}, or unset it (the most this CPU has)"
        return SIMD, os.environ[SIMD], what
    return None
