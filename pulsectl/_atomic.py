"""Outputs that appear whole or not at all: temp file in the target folder, then rename."""

from __future__ import annotations

import contextlib
import errno
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
    fd, name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
    os.close(fd)
    os.unlink(name)
    return Path(name)


def os_error(exc: OSError, path: Path) -> OutputError:
    """Turn a write failure into one clear line."""
    if exc.errno == errno.ENOSPC:
        return OutputError(f"{path}: no space left on device", path=path)
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return OutputError(f"{path}: cannot write ({exc.strerror})", path=path)
    return OutputError(f"{path}: cannot write: {exc.strerror}", path=path)


@contextlib.contextmanager
def atomic_file(path: Path, force: bool) -> Iterator[BinaryIO]:
    """Yield a temp file beside ``path``; on success it replaces ``path``, else it is removed."""
    check_target(path, force)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}{TEMP_MARK}", dir=path.parent)
    except OSError as exc:
        raise os_error(exc, path) from exc
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        remove(tmp)
        raise os_error(exc, path) from exc
    except BaseException:
        remove(tmp)
        raise


def install(tmp: Path, path: Path) -> None:
    """Move a finished temp file or folder to ``path`` (replacing what is there)."""
    if tmp.is_dir() and path.exists():
        old = temp_path(path)
        os.replace(path, old)
        os.replace(tmp, path)
        remove(old)
    else:
        os.replace(tmp, path)


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
