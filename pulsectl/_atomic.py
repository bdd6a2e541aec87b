"""Outputs that appear whole or not at all: temp file in the target folder, then rename."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pulsectl.errors import OutputError

TEMP_MARK = ".pulsectl-tmp-"


def check_target(path: Path, force: bool, what: str = "output") -> None:
    """Refuse to clobber an existing path unless ``force``; refuse a missing folder."""
    if path.exists() and not force:
        raise OutputError(f"{path}: {what} exists; pass -f to overwrite", path=path)
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"{path}: folder {parent} does not exist", path=path)


def temp_path(path: Path) -> Path:
    """A fresh hidden name in the folder of ``path`` (not created)."""
    try:  # creating it is the first write to the folder: read-only, full, no permission
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
    check_target(path, force)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
    except OSError as exc:
        raise os_error(exc, path) from exc
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f, _removed_on_sigbus(tmp):
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        remove(tmp)
        raise os_error(exc, path) from exc
    except BaseException:
        remove(tmp)
        raise


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
