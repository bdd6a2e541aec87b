"""Fingerprints of a checkpoint's files (per-tensor ones: pulsectl.sources.scan)."""

from __future__ import annotations

from pulsectl.checkpoint import Checkpoint
from pulsectl.hashing import checkpoint_fingerprint, fingerprint_file
from pulsectl.patch import FileRef

SCAN_CHUNK = 16 * 1024 * 1024


def file_refs(ckpt: Checkpoint) -> list[FileRef]:
    """``FileRef`` (path, size, fingerprint) of every file, in checkpoint order."""
    return [FileRef(e.relpath, e.size, fingerprint_file(e.path)) for e in ckpt.files]


def fingerprint_of(ckpt: Checkpoint, refs: list[FileRef] | None = None) -> str:
    """The checkpoint fingerprint (see pulsectl.hashing)."""
    refs = file_refs(ckpt) if refs is None else refs
    return checkpoint_fingerprint(ckpt.layout, ((r.path, r.size, r.fingerprint) for r in refs))
