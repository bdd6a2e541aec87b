"""Fingerprints of a checkpoint's files and tensors (one read pass per file)."""

from __future__ import annotations

import os
import struct

from pulsectl._io import pread_array
from pulsectl.checkpoint import Checkpoint, FileEntry
from pulsectl.hashing import checkpoint_fingerprint, fingerprint_file, new_hasher
from pulsectl.patch import FileRef

SCAN_CHUNK = 16 * 1024 * 1024


def file_refs(ckpt: Checkpoint) -> list[FileRef]:
    """``FileRef`` (path, size, fingerprint) of every file, in checkpoint order."""
    return [FileRef(e.relpath, e.size, fingerprint_file(e.path)) for e in ckpt.files]


def fingerprint_of(ckpt: Checkpoint, refs: list[FileRef] | None = None) -> str:
    """The checkpoint fingerprint (see pulsectl.hashing)."""
    refs = file_refs(ckpt) if refs is None else refs
    return checkpoint_fingerprint(ckpt.layout, ((r.path, r.size, r.fingerprint) for r in refs))


def scan_file(entry: FileEntry) -> tuple[FileRef, dict[str, str]]:
    """File fingerprint and, for a safetensors file, each tensor's fingerprint, in one pass."""
    if entry.header is None:
        return FileRef(entry.relpath, entry.size, fingerprint_file(entry.path)), {}
    whole = new_hasher()
    whole.update(struct.pack("<Q", len(entry.header.raw)))
    whole.update(entry.header.raw)
    tensors: dict[str, str] = {}
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        for t in entry.header.tensors:
            h = new_hasher()
            for off in range(0, t.nbytes, SCAN_CHUNK):
                chunk = pread_array(
                    fd, t.start + off, min(SCAN_CHUNK, t.nbytes - off), str(entry.path)
                )
                h.update(chunk)
                whole.update(chunk)
            tensors[t.name] = h.hexdigest()
    finally:
        os.close(fd)
    return FileRef(entry.relpath, entry.size, whole.hexdigest()), tensors
