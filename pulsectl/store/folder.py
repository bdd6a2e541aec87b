"""A store in a local (or mounted) folder: plain files, each written to a temp name then renamed."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from pulsectl import _placed
from pulsectl._atomic import atomic_file, os_error, remove, temp_path
from pulsectl.errors import InputError
from pulsectl.store.base import MissingObjectError, ObjectExistsError, Store

COPY_CHUNK = 16 * 1024 * 1024


class FolderStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    @property
    def ident(self) -> str:
        return str(self.root.resolve())

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def where(self, key: str) -> str:
        return str(self._path(key))

    def list(self, prefix: str) -> dict[str, int]:
        if not self.root.is_dir():
            what = (
                "is a file, not a store folder"
                if self.root.exists()
                else "store folder does not exist"
            )
            raise InputError(f"{self.root}: {what}", path=self.root)
        top = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(top) if top else self.root
        found: dict[str, int] = {}
        if not start.is_dir():
            return found
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith("."):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    try:
                        found[key] = os.stat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:
                        continue  # removed while listing (prune)
        return found

    def read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise MissingObjectError(
                f"{self.where(key)}: not in the store", path=self.where(key)
            ) from None
        except OSError as exc:
            raise InputError(
                f"{self.where(key)}: cannot read: {exc.strerror}", path=self.where(key)
            ) from exc

    def fetch(self, key: str, dest: Path) -> Path:
        path = self._path(key)
        if not path.is_file():
            raise MissingObjectError(f"{path}: not in the store", path=path)
        return path

    def write(self, key: str, data: bytes) -> None:
        path = self._make_parent(key)
        with _placed.unrecorded(), atomic_file(path, force=True) as f:
            f.write(data)

    def create(self, key: str, data: bytes) -> None:
        """Written to a temp file, then hard-linked to its name, which fails if the name is
        taken: a rename would replace it."""
        path = self._make_parent(key)
        tmp = temp_path(path)
        try:
            try:
                with open(tmp, "xb") as f:
                    f.write(data)
            except OSError as exc:
                raise os_error(exc, path) from exc
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ObjectExistsError(f"{path}: already in the store", path=path) from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise os_error(exc, path) from exc
                super().create(key, data)  # a file system without hard links
        finally:
            remove(tmp)

    def upload(self, source: Path, key: str) -> None:
        path = self._make_parent(key)
        with _placed.unrecorded(), atomic_file(path, force=True) as f, open(source, "rb") as src:
            while chunk := src.read(COPY_CHUNK):
                f.write(chunk)

    def delete(self, keys: Iterable[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise os_error(exc, path) from exc
            parents.add(path.parent)
        # Remove folders left empty (folder anchors), never the store's own top folders.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and parent.parent != self.root:
                try:
                    parent.rmdir()
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                        break
                    raise
                parent = parent.parent

    def _make_parent(self, key: str) -> Path:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise os_error(exc, path.parent) from exc
        return path
