"""Outputs that appear whole or not at all: temp file in the target folder, then rename."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, BinaryIO

from pulsectl.errors import OutputError

TEMP_MARK = ".pulsectl-tmp-"


def check_target(path: Path, force: bool, what: str = "output") -> None:
    """Refuse to clobber an existing path unless ``force``; refuse a missing folder."""
    if path.exists() and not force:
        raise OutputError(f"{path}: {what} exists; pass -f to overwrite", path=path)
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"{path}: folder {parent} does not exist", path=path)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while inside; one that arrives is acted on when leaving.

    For the steps between creating a temp file and recording it for removal: an interrupt (a
    KeyboardInterrupt, raised at whatever line runs when the signal comes) between the two
    would leave the file behind. Python runs signal handlers in the main thread only, so
    elsewhere this holds nothing back, and needs not.
    """
    sigs = (signal.SIGINT, signal.SIGTERM)
    # (None: a handler set outside Python, which cannot be put back: left alone.)
    if threading.current_thread() is not threading.main_thread() or any(
        signal.getsignal(s) is None for s in sigs
    ):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous: dict[int, Any] = {}
    try:
        for s in sigs:
            previous[s] = signal.signal(s, hold)
        yield
    finally:
        for num, handler in previous.items():
            signal.signal(num, handler)
        if held:
            _deliver(held[0], previous[held[0]])


def _deliver(signum: int, handler: Any) -> None:
    """Act on a held signal as its handler would have."""
    if callable(handler):
        handler(signum, None)  # Python's SIGINT handler, pulsectl's SIGTERM one: they raise
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)


def temp_path(path: Path) -> Path:
    """A fresh hidden name in the folder of ``path`` (not created)."""
    # Creating it is the first write to the folder (read-only, full, no permission?). It is
    # removed again before an interrupt can end this function.
    with interrupts_deferred():
        try:
            fd, name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
        except OSError as exc:
            raise os_error(exc, path) from exc
        os.close(fd)
        os.unlink(name)
    return Path(name)


def os_error(exc: OSError, path: Path) -> OutputError:
    """Turn a write failure into one clear line."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            f"{path}: no space left on device; free some space or write the output elsewhere",
            path=path,
        )
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return OutputError(
            f"{path}: cannot write ({exc.strerror}); write the output elsewhere", path=path
        )
    return OutputError(f"{path}: cannot write: {exc.strerror}", path=path)


@contextlib.contextmanager
def atomic_file(path: Path, force: bool, durable: bool = False) -> Iterator[BinaryIO]:
    """Yield a temp file beside ``path``; on success it replaces ``path``, else it is removed.

    The rename is atomic for every other process whatever happens to this one (a kill leaves the
    old file or the new one). ``durable`` also fsyncs before the rename, so that a power loss
    cannot leave an empty file behind the new name.
    """
    if path.is_dir():
        raise OutputError(f"{path}: is a folder; give a file path for the output", path=path)
    check_target(path, force)
    tmp: Path | None = None
    out: BinaryIO | None = None
    try:
        # The temp file is created and known to the handlers below before an interrupt can
        # stop this function.
        with interrupts_deferred():
            try:
                fd, name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
            except OSError as exc:
                raise os_error(exc, path) from exc
            tmp = Path(name)
            out = os.fdopen(fd, "wb")
        with out as f, _removed_on_sigbus(tmp):
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        discard(out, tmp)
        raise os_error(exc, path) from exc
    except BaseException:
        discard(out, tmp)
        raise


def discard(out: BinaryIO | None, tmp: Path | None) -> None:
    """Close a temp file's handle and remove the file, where there are any; never raises."""
    if out is not None:
        with contextlib.suppress(OSError):
            out.close()
    if tmp is not None:
        remove(tmp)


@contextlib.contextmanager
def _removed_on_sigbus(path: Path) -> Iterator[None]:
    """While inside, an input that gets shorter under a memory-mapped read (which ends the
    process, see pulsectl._io.map_range) removes ``path`` first."""
    from pulsectl.codecs._fast import native

    token = -1 if native is None else native.add_cleanup(os.fsencode(path))
    try:
        yield
    finally:
        if native is not None and token >= 0:
            native.remove_cleanup(token)


def install(tmp: Path, path: Path) -> None:
    """Move a finished temp file or folder to ``path`` (replacing what is there).

    A folder cannot be renamed over a folder, so where the system can (Linux) the two are
    swapped in one step and ``path`` is at every moment the old folder or the new one; a kill
    -9 before the old one is removed leaves it under a temp name. Elsewhere: two renames, the
    first undone if the second fails or is interrupted.
    """
    if tmp.is_dir() and path.exists():
        if _exchange(tmp, path):
            remove(tmp)  # now the old folder
            return
        old = temp_path(path)
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)
            raise
        remove(old)
    else:
        os.replace(tmp, path)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # old kernel or file system
        return False
    raise OSError(err, os.strerror(err), str(b))


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def remove(path: Path) -> None:
    """Remove a file or folder if it exists; never raises."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
