"""What a patch holds, read without the checkpoints: for `inspect`, `verify` and scripts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from pulsectl.checkpoint import Checkpoint, TensorInfo
from pulsectl.codecs import check_block
from pulsectl.errors import FormatError, IntegrityError, PulseError, UsageError
from pulsectl.format import (
    BLOCK_PAYLOAD_SLACK,
    FORMAT_VERSION,
    blocks_in,
    open_patch,
    read_trailer_at_end,
)
from pulsectl.inventory import fingerprint_of
from pulsectl.patch import PatchHeader, PatchTrailer, header_from_json, trailer_from_json

INFO_SCHEMA = 1  # version of the JSON that `pulsectl inspect --json` prints


@dataclass(frozen=True)
class PatchInfo:
    name: str
    size: int | None  # bytes of the patch (None when it came from a pipe and was not read whole)
    header: PatchHeader
    trailer: PatchTrailer
    checked: bool  # every block checksum and the file checksum were verified

    @property
    def changed_words(self) -> int:
        return sum(r.changed for r in self.trailer.items)

    @property
    def total_words(self) -> int:
        return sum(i.nbytes // i.word for i in self.header.items)

    def to_json(self) -> dict[str, Any]:
        """The `inspect --json` object (its keys are stable: scripts read them)."""
        tensors = []
        infos: dict[tuple[int, str], TensorInfo] = {
            (f, t.name): t
            for f, tfile in enumerate(self.header.files)
            if tfile.header is not None
            for t in tfile.header.tensors
        }
        for item, result in zip(self.header.items, self.trailer.items, strict=True):
            tfile = self.header.files[item.file]
            entry: dict[str, Any] = {
                "name": item.name,
                "file": tfile.path,
                "dtype": None,
                "shape": None,
                "nbytes": item.nbytes,
                "words": item.nbytes // item.word,
                "from_base": item.base_file is not None,
                "changed_words": result.changed,
                "encoded_bytes": result.encoded,
                "base_fingerprint": item.base_fingerprint,
                "fingerprint": result.fingerprint,
            }
            if tfile.header is not None and item.name is not None:
                info = infos[(item.file, item.name)]
                entry["dtype"], entry["shape"] = info.dtype, list(info.shape)
            tensors.append(entry)
        total = self.total_words
        return {
            "schema": INFO_SCHEMA,
            "patch": self.name,
            "format_version": FORMAT_VERSION,
            "patch_bytes": self.size,
            "checked": self.checked,
            "writer": self.header.writer,
            "layout": self.header.layout,
            "scope": self.header.scope,
            "block_bytes": self.header.block_bytes,
            "base": {
                "fingerprint": self.header.base_fingerprint,
                "files": [f.to_json() for f in self.header.base_files],
            },
            "target": {
                "fingerprint": self.trailer.target_fingerprint,
                "bytes": self.header.target_bytes,
                "files": [f.to_json() for f in self.trailer.target_files],
            },
            "changed_words": self.changed_words,
            "total_words": total,
            "density": self.changed_words / total if total else 0.0,
            "tensors": tensors,
        }


def read_patch_info(source: str | Path | BinaryIO, *, check: bool = False) -> PatchInfo:
    """Header and trailer of a patch. ``check`` (or a pipe) reads it whole, verifying checksums."""
    reader, stream = open_patch(source)
    try:
        header = header_from_json(reader.header, reader.name)
        seekable = _seekable(stream)
        if seekable and not check:
            trailer_json = read_trailer_at_end(stream, reader.name)
            size = stream.seek(0, os.SEEK_END)
        else:
            for index, item in enumerate(header.items):
                nblocks = blocks_in(item.nbytes, header.block_bytes)
                reader.read_frame(index, nblocks)
                for b in range(nblocks):
                    where = f"tensor {item.label!r} block {b}"
                    block = reader.read_block(header.block_bytes + BLOCK_PAYLOAD_SLACK, where)
                    if check:  # what can be told without the base (a pipe: checksums only)
                        size = min(header.block_bytes, item.nbytes - b * header.block_bytes)
                        try:
                            check_block(
                                block.codec, block.payload, size, item.base_file is not None
                            )
                        except PulseError as exc:
                            raise type(exc)(f"{reader.name}: {where}: {exc.message}") from None
            trailer_json = reader.read_trailer()
            size = reader.offset + 16
        trailer = trailer_from_json(trailer_json, header, reader.name)
        return PatchInfo(reader.name, size, header, trailer, checked=not seekable or check)
    finally:
        if isinstance(source, (str, Path)) and str(source) != "-":
            stream.close()


def verify_checkpoint(
    checkpoint: str | Path, *, patch: str | Path | None = None, fingerprint: str | None = None
) -> str:
    """Check that ``checkpoint`` is ``patch``'s target (or has ``fingerprint``); returns it."""
    if (patch is None) == (fingerprint is None):
        raise UsageError("give exactly one of --patch and --hash", option="--patch")
    if patch is not None:
        info = read_patch_info(patch)
        if info.header.scope == "tensors":
            return _verify_block(checkpoint, info)
        expected = info.trailer.target_fingerprint
        what = f"the target of {patch}"
        base = info.header.base_fingerprint
    else:
        assert fingerprint is not None
        expected = fingerprint.strip().lower()
        if len(expected) != 32 or any(c not in "0123456789abcdef" for c in expected):
            raise UsageError(
                f"--hash {fingerprint!r} is not a 32-digit hex fingerprint", option="--hash"
            )
        what = "the expected fingerprint"
        base = None
    actual = fingerprint_of(_open_checked(checkpoint, what))
    if actual != expected:
        # The commonest miss in a pipeline: checking the checkpoint before the patch is applied.
        hint = "; it is the patch's base: apply the patch to it first" if actual == base else ""
        raise IntegrityError(
            f"{checkpoint}: fingerprint {actual} is not {what} ({expected}){hint}",
            path=str(checkpoint),
            expected=expected,
            actual=actual,
        )
    return actual


def _open_checked(checkpoint: str | Path, what: str) -> Checkpoint:
    """CKPT, opened; a malformed one (a truncated download) is not what was expected: exit 3,
    as for any other checkpoint that is not it."""
    try:
        return Checkpoint.open(checkpoint)
    except FormatError as exc:
        raise IntegrityError(
            f"{checkpoint}: is not {what}: it is not a readable checkpoint ({exc.message})",
            path=str(checkpoint),
        ) from None


def _verify_block(checkpoint: str | Path, info: PatchInfo) -> str:
    """A block patch's target is its tensors: check those, whatever the rest holds, in the
    layout (files and headers) the block patch keeps, as apply requires of its base."""
    from pulsectl.apply import same_block_layout
    from pulsectl.sources import FileSource, scan

    ckpt = _open_checked(checkpoint, f"the target of {info.name}")
    if not same_block_layout(info.header, ckpt):
        raise IntegrityError(
            f"{checkpoint}: is not the target of {info.name}: its files or tensor layout "
            "differ from the block patch's",
            path=str(checkpoint),
        )
    with FileSource(ckpt) as source:
        fps: dict[str, str] = {}
        for index, entry in enumerate(ckpt.files):
            if entry.header is not None:
                fps.update(scan(source, index)[1])
    for item, want in zip(info.header.items, info.trailer.items, strict=True):
        got = fps.get(item.name or "")
        if got != want.fingerprint:
            raise IntegrityError(
                f"{checkpoint}: tensor {item.name!r} has fingerprint {got}, the block patch "
                f"{info.name} makes {want.fingerprint}",
                path=str(checkpoint),
                tensor=item.name,
                expected=want.fingerprint,
                actual=got,
            )
    return fingerprint_of(ckpt)


def _seekable(stream: BinaryIO) -> bool:
    try:
        return stream.seekable()
    except (AttributeError, OSError, ValueError):
        return False
