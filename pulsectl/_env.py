"""The on/off switches pulsectl reads from the environment.

Each takes ``1`` (on) or ``0`` (off); unset or empty, it has its default. The CLI refuses any
other value before it runs a command (``bad_switch``); the library falls back to the default.
Standard library only: ``pulsectl._prehash`` reads one before the heavy imports.
"""

from __future__ import annotations

import os

# Each switch and its default (what unset or empty means).
SWITCHES = {
    "PULSECTL_PREHASH": True,  # hash the inputs in a child process (pulsectl._prehash)
    "PULSECTL_PURE_PYTHON": False,  # numpy instead of the compiled loops (codecs._fast)
}
_VALUES = {"1": True, "0": False}


def switch(name: str) -> bool | None:
    """Whether switch ``name`` is on; None where it is set to something other than 1, 0 or
    nothing."""
    value = os.environ.get(name, "")
    return SWITCHES[name] if value == "" else _VALUES.get(value)


def bad_switch() -> tuple[str, str] | None:
    """The first switch set to a value it does not take, and that value; None if none is."""
    for name in SWITCHES:
        if switch(name) is None:
            return name, os.environ[name]
    return None
