"""Where diff reads tensors from: checkpoint files, or anything else that looks like one.

A *source* is a checkpoint's layout and files (with their parsed safetensors headers) plus a
``read(file_index, offset, nbytes)`` that returns those bytes. ``FileSource`` reads files on disk
with pread; ``pulsectl.torch_api`` provides one over live tensors, so that a patch made from a
state dict is exactly the patch of the file ``save_safetensors`` would write.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from pulsectl import _prehash
from pulsectl._io import map_range, pread_array, pread_into
from pulsectl.checkpoint import Checkpoint, FileEntry, TensorInfo
from pulsectl.errors import InputError, open_files_hint
from pulsectl.hashing import fingerprint_file, new_hasher, update_both
from pulsectl.patch import FileRef

SCAN_CHUNK = 16 * 1024 * 1024


class Source(Protocol):
    layout: Literal["file", "dir"]
    files: tuple[FileEntry, ...]

    def read(self, file_index: int, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes (uint8) of file ``file_index`` from ``offset``."""
        ...

    def find_tensor(self, name: str) -> tuple[FileEntry, TensorInfo] | None: ...

    def file(self, relpath: str) -> FileEntry | None: ...

    def close(self) -> None: ...


class FileSource:
    """A checkpoint on disk, its files opened once for pread and memory maps.

    With ``remember_scans``, ``scan`` hashes each file once and hands later calls the same
    result: for several diffs over the same open files (``diff --blocks``), which must not
    change while it is open. ``name`` (the path as the user gave it; the checkpoint's root by
    default) is what ``str`` gives, for messages."""

    def __init__(
        self, ckpt: Checkpoint, *, remember_scans: bool = False, name: str | None = None
    ) -> None:
        self.ckpt = ckpt
        self.name = str(ckpt.root) if name is None else name
        self.layout = ckpt.layout
        self.files = ckpt.files
        self._fds: list[int] = []
        self.scans: dict[int, tuple[FileRef, dict[str, str]]] | None = (
            {} if remember_scans else None
        )

    def __str__(self) -> str:
        return self.name

    def __enter__(self) -> FileSource:
        self.open()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def open(self) -> None:
        for entry in self.ckpt.files:
            try:
                self._fds.append(os.open(entry.path, os.O_RDONLY))
            except OSError as exc:
                self.close()
                raise InputError(
                    f"{entry.path}: cannot open: {exc.strerror}{open_files_hint(exc)}",
                    path=entry.path,
                ) from exc

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def read(self, file_index: int, offset: int, nbytes: int) -> np.ndarray:
        return pread_array(
            self._fds[file_index], offset, nbytes, str(self.ckpt.files[file_index].path)
        )

    def read_into(self, file_index: int, offset: int, buf: np.ndarray) -> np.ndarray:
        """Fill ``buf`` (uint8) with the bytes of file ``file_index`` from ``offset``."""
        return pread_into(self._fds[file_index], buf, offset, str(self.ckpt.files[file_index].path))

    def view(self, file_index: int, offset: int, nbytes: int) -> np.ndarray | None:
        """The bytes as a read-only array over a memory map, without a copy (or None where
        there is no map to be had, see pulsectl._io.map_range: read them instead)."""
        path = str(self.ckpt.files[file_index].path)
        return map_range(self._fds[file_index], offset, nbytes, path)

    def fd(self, file_index: int) -> int:
        return self._fds[file_index]

    def find_tensor(self, name: str) -> tuple[FileEntry, TensorInfo] | None:
        return self.ckpt.find_tensor(name)

    def file(self, relpath: str) -> FileEntry | None:
        return self.ckpt.file(relpath)


class Stopped(Exception):
    """A scan given a ``stop`` event saw it set."""


def scan(
    source: Source, index: int, stop: threading.Event | None = None
) -> tuple[FileRef, dict[str, str]]:
    """File fingerprint and, for a safetensors file, each tensor's fingerprint, in one pass.

    ``stop``, once set, ends the scan (``Stopped``) at its next chunk of a safetensors file.
    A FileSource made with ``remember_scans`` is scanned once per file.
    """
    scans = getattr(source, "scans", None)
    if scans is None:
        return _scan(source, index, stop)
    if index not in scans:
        scans[index] = _scan(source, index, stop)
    return scans[index]


def _scan(
    source: Source, index: int, stop: threading.Event | None
) -> tuple[FileRef, dict[str, str]]:
    entry = source.files[index]
    if isinstance(source, FileSource) and entry.header is not None:
        # Hashed while the CLI loaded (pulsectl._prehash hashes safetensors files only).
        ahead = _prehash.lookup(source.fd(index), entry.header.raw)
        fps = None if ahead is None else _tensor_fingerprints(entry.header.tensors, ahead)
        if ahead is not None and fps is not None:
            return FileRef(entry.relpath, entry.size, ahead.file), fps
    if entry.header is None:
        if isinstance(source, FileSource):
            return FileRef(entry.relpath, entry.size, fingerprint_file(entry.path)), {}
        data = source.read(index, 0, entry.size)
        h = new_hasher()
        h.update(data)
        return FileRef(entry.relpath, entry.size, h.hexdigest()), {}
    whole = new_hasher()
    whole.update(struct.pack("<Q", len(entry.header.raw)))
    whole.update(entry.header.raw)
    tensors: dict[str, str] = {}
    read_into = getattr(source, "read_into", None)
    view = getattr(source, "view", None)
    buf: np.ndarray | None = None
    for t in entry.header.tensors:
        h = new_hasher()
        for off in range(0, t.nbytes, SCAN_CHUNK):
            n = min(SCAN_CHUNK, t.nbytes - off)
            if stop is not None and stop.is_set():
                raise Stopped
            mapped = None if view is None else view(index, t.start + off, n)
            if mapped is not None:
                chunk = mapped
            elif read_into is not None:  # one buffer, no fresh pages
                if buf is None:
                    buf = np.empty(SCAN_CHUNK, dtype=np.uint8)
                chunk = read_into(index, t.start + off, buf[:n])
            else:
                chunk = source.read(index, t.start + off, n)
            update_both(h, whole, chunk)
        tensors[t.name] = h.hexdigest()
    return FileRef(entry.relpath, entry.size, whole.hexdigest()), tensors


def _tensor_fingerprints(
    tensors: Sequence[TensorInfo], ahead: _prehash.Hashed
) -> dict[str, str] | None:
    """Each tensor's fingerprint from those hashed ahead (pulsectl._prehash), or None if one
    is missing there."""
    fps: dict[str, str] = {}
    for t in tensors:
        fp = ahead.ranges.get((t.start, t.nbytes))
        if fp is None:
            return None
        fps[t.name] = fp
    return fps
