"""The store interface (a folder or an S3 prefix), its errors, and ``open_store``."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from pathlib import Path

from pulsectl.errors import InputError, IntegrityError, OutputError, UsageError
from pulsectl.hashing import fingerprint_file
from pulsectl.store.layout import StoredFile


class MissingObjectError(InputError):
    """An object the store should hold is not there (deleted, pruned, not yet copied)."""


class ObjectExistsError(OutputError):
    """``create`` found the key taken (another publisher got there first)."""


class StepUnreachableError(IntegrityError):
    """Every way to rebuild the step goes through a missing or damaged object (exit 3)."""


class Store(abc.ABC):
    """Objects under string keys (``steps/00000042.json``...). Writes appear whole or not at all."""

    url: str

    @abc.abstractmethod
    def list(self, prefix: str) -> dict[str, int]:
        """Every key starting with ``prefix`` (keys whose names start with '.' excluded) -> size."""

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """A small object's bytes; MissingObjectError if it is not there."""

    @abc.abstractmethod
    def fetch(self, key: str, dest: Path) -> Path:
        """A local path holding the object: the store's own file for a folder, else ``dest``."""

    @abc.abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Create ``key`` with ``data`` atomically."""

    def create(self, key: str, data: bytes) -> None:
        """Create ``key`` with ``data`` atomically, only if no object has that key
        (ObjectExistsError otherwise): a step manifest is published once, by one publisher.
        Stores that cannot test and create in one step check first (a narrow race)."""
        if self.exists(key):
            where = self.where(key)
            raise ObjectExistsError(f"{where}: already in the store", path=where)
        self.write(key, data)

    @abc.abstractmethod
    def upload(self, source: Path, key: str) -> None:
        """Create ``key`` with the bytes of local file ``source`` atomically."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Remove ``keys`` (missing ones are ignored)."""

    @property
    def ident(self) -> str:
        """A stable identity (the publish cache is keyed by it)."""
        return self.url

    def where(self, key: str) -> str:
        """The object's full name for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    def exists(self, key: str) -> bool:
        parent = key.rsplit("/", 1)[0] + "/" if "/" in key else ""
        return key in self.list(parent)


def open_store(url: str | Path) -> Store:
    """A folder path or an ``s3://bucket/prefix`` URL."""
    text = str(url)
    if text.startswith("s3://"):
        from pulsectl.store.s3 import S3Store

        return S3Store(text)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise UsageError(f"{text}: unsupported store scheme {scheme!r}; give a folder or s3://...")
    from pulsectl.store.folder import FolderStore

    return FolderStore(Path(text))


def fetch_verified(store: Store, stored: StoredFile, dest: Path) -> Path:
    """Fetch one object and check its size and fingerprint against the manifest."""
    path = store.fetch(stored.key, dest)
    size = path.stat().st_size
    if size != stored.size:
        raise IntegrityError(
            f"{store.where(stored.key)}: {size} bytes, but its manifest says {stored.size} "
            "(damaged, truncated or replaced)",
            path=store.where(stored.key),
        )
    actual = fingerprint_file(path)
    if actual != stored.fingerprint:
        raise IntegrityError(
            f"{store.where(stored.key)}: fingerprint {actual}, but its manifest says "
            f"{stored.fingerprint} (damaged or replaced)",
            path=store.where(stored.key),
            expected=stored.fingerprint,
            actual=actual,
        )
    return path
