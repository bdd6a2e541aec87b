"""The outputs put in place (renamed to their names) while the CLI runs a command, so that an
interrupt that arrives after the last rename is not reported as leaving nothing written.

Small and standard library only: the CLI imports it at start, for every command.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_paths: list[Path] | None = None  # None: not recording (a library caller)


@contextlib.contextmanager
def recording() -> Iterator[list[Path]]:
    """While inside, record each output put in place in the list yielded, in order."""
    global _paths
    saved, _paths = _paths, []
    try:
        yield _paths
    finally:
        _paths = saved


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """While inside, record nothing: the renames are a store's own objects or caches, not an
    output the user named (an interrupt there is not 'after OUT was written')."""
    global _paths
    saved, _paths = _paths, None
    try:
        yield
    finally:
        _paths = saved


def record(path: Path) -> None:
    """``path`` was just put in place (``pulsectl._atomic`` calls this as it renames)."""
    if _paths is not None:
        _paths.append(path)
