"""The outputs put in place (renamed to their names) while the CLI runs a command, so that an
interrupt that arrives after the last rename is not reported as leaving nothing written.

Small and standard library only: the CLI imports it at start, for every command.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

_paths: list[Path] | None = None  # None: not recording (a library caller)
_done: list[str] | None = None  # what else has happened that an interrupt cannot undo


@contextlib.contextmanager
def recording() -> Iterator[list[Path]]:
    """While inside, record each output put in place in the list yielded, in order, and each
    ``done`` event."""
    global _paths, _done
    saved, _paths = _paths, []
    saved_done, _done = _done, []
    try:
        yield _paths
    finally:
        _paths, _done = saved, saved_done


def done(event: str) -> None:
    """Something that stays done whatever happens next: an interrupt after it is reported as
    ``interrupted <event>`` (``after step 3 was published to STORE``), the latest event
    first, instead of saying that nothing was written."""
    if _done is not None:
        _done.append(event)


def events() -> list[str]:
    """The ``done`` events recorded so far, in order."""
    return list(_done or ())


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
