"""apply: a base checkpoint and a chain of patches in, the exact target checkpoint out.

base fingerprint checked against the first patch (nothing written before that)
  -> for each patch: PatchReader (file or pipe, frame by frame)
     -> blocks decoded on a worker pool against the base (pread)
     -> files written in order to a temp path in OUT's folder, hashed as written
     -> trailer: file checksum and every target fingerprint checked
  -> the verified temp renamed to OUT
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pulsectl._atomic import check_target, install, os_error, remove, temp_path
from pulsectl._io import default_workers, overlapped_map, window_for
from pulsectl.checkpoint import Checkpoint, TensorInfo
from pulsectl.codecs import decode_block, decode_moves
from pulsectl.errors import CorruptPatchError, IntegrityError, OutputError, UsageError
from pulsectl.format import (
    BLOCK_PAYLOAD_SLACK,
    PatchReader,
    PatchSource,
    blocks_in,
    open_patch,
    read_trailer_at_end,
)
from pulsectl.hashing import checkpoint_fingerprint, fingerprint_range, new_hasher
from pulsectl.inventory import file_refs, fingerprint_of
from pulsectl.patch import (
    FileRef,
    Item,
    PatchHeader,
    PatchTrailer,
    TargetFile,
    header_from_json,
    trailer_from_json,
)
from pulsectl.sources import FileSource, scan

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ApplySummary:
    output: Path
    target_fingerprint: str
    patches: int
    target_bytes: int


def read_header(reader: PatchReader) -> PatchHeader:
    return header_from_json(reader.header, reader.name)


def apply_patches(
    base: str | Path,
    patches: Sequence[PatchSource],
    out: str | Path | None = None,
    *,
    in_place: bool = False,
    force: bool = False,
    workers: int | None = None,
    progress: Progress | None = None,
    stdin: BinaryIO | None = None,
    durable: bool = False,
    device: str | None = None,
) -> ApplySummary:
    """Apply ``patches`` in order to ``base`` and write the verified result to ``out``.

    The result appears at ``out`` only once verified (temp file, then rename); ``durable`` also
    fsyncs it before the rename. ``device`` (a torch device name) scatters the decoded changes
    into the base blocks there; None does it with numpy.
    """
    base_path = Path(base)
    if not patches:
        raise UsageError("no patch given")
    if sum(1 for p in patches if isinstance(p, (str, Path)) and str(p) == "-") > 1:
        raise UsageError("standard input ('-') can be given as a patch only once")
    if in_place:
        if out is not None and Path(out).resolve() != base_path.resolve():
            raise UsageError("--in-place writes to BASE; do not give -o as well")
        out_path = base_path
    else:
        if out is None:
            raise UsageError("give -o OUT, or --in-place to update BASE")
        out_path = Path(out)
        if out_path.exists() and out_path.resolve() == base_path.resolve():
            raise UsageError(f"{out_path} is BASE; use --in-place to update it")
        check_target(out_path, force)
    workers = workers or default_workers()

    with contextlib.ExitStack() as stack:
        opened: list[tuple[PatchReader | None, PatchSource]] = []
        for source in patches:
            if isinstance(source, (str, Path)) and str(source) == "-":
                opened.append((None, source))  # read its header when its turn comes
                continue
            reader, stream = open_patch(source)
            if isinstance(source, (str, Path)):
                stack.callback(stream.close)
            opened.append((reader, source))
        _check_chain(opened)

        current = Checkpoint.open(base_path)
        first = opened[0][0] or open_patch(opened[0][1], stdin)[0]
        opened[0] = (first, opened[0][1])
        first_header = read_header(first)
        if current.layout != first_header.layout:
            raise IntegrityError(
                f"{base_path}: wrong base for {first.name}: it is a "
                f"{'file' if current.layout == 'file' else 'folder'}, the patch is for a "
                f"{'single file' if first_header.layout == 'file' else 'folder'}; "
                "apply the patch to the checkpoint it was made from",
                path=str(base_path),
            )
        if first_header.scope == "tensors":
            # A block patch binds its own tensors only: no need to hash the whole base.
            refs: list[FileRef] = []
            current_fp = ""
            _check_block_base(first_header, current, base_path, first.name)
        else:
            refs = file_refs(current)
            current_fp = fingerprint_of(current, refs)
            if current_fp != first_header.base_fingerprint:
                raise _wrong_base(first_header, current, refs, base_path, first.name)
        _check_space(out_path, first_header.target_bytes)

        temps: list[Path] = []
        try:
            for batch in _batches(opened, first_header):
                i = batch[0]
                maybe_reader, source = opened[i]
                reader = maybe_reader or open_patch(source, stdin)[0]
                header = first_header if i == 0 else read_header(reader)
                parts = [(reader, header)]
                if header.scope == "tensors":
                    # Block patches of disjoint tensors are applied together, in one pass.
                    parts += [(r, read_header(r)) for r, _ in (opened[j] for j in batch[1:]) if r]
                    for r, h in parts:
                        if (r, h) != (first, first_header):
                            _check_block_base(h, current, base_path, r.name)
                elif header.base_fingerprint != current_fp or [
                    (r.path, r.size, r.fingerprint) for r in header.base_files
                ] != [(r.path, r.size, r.fingerprint) for r in refs]:
                    raise IntegrityError(
                        f"{reader.name}: patch chain out of order: this patch expects base "
                        f"{header.base_fingerprint}, but the previous patch produced {current_fp}; "
                        "give the patches in the order they were made, with none missing",
                        path=reader.name,
                        expected=header.base_fingerprint,
                        actual=current_fp,
                    )
                if i > 0:  # every target of a chain must fit, not only the first
                    _check_space(out_path, header.target_bytes)
                dest = temp_path(out_path)
                temps.append(dest)
                last = batch[-1] == len(opened) - 1
                refs, current_fp = _apply_parts(
                    parts, current, dest, workers, progress, durable and last, device
                )
                if len(temps) > 1:
                    remove(temps.pop(0))
                current = Checkpoint.open(dest)
            try:
                install(temps[-1], out_path)
            except OSError as exc:
                raise os_error(exc, out_path) from exc
        except BaseException:
            for tmp in temps:
                remove(tmp)
            raise
    return ApplySummary(out_path, current_fp, len(patches), sum(r.size for r in refs))


def _batches(
    opened: list[tuple[PatchReader | None, PatchSource]], first_header: PatchHeader
) -> list[list[int]]:
    """Group runs of block patches (same layout, disjoint tensors) to apply in one pass."""
    batches: list[list[int]] = []
    names: set[str] = set()
    files: Any = None
    for i, (reader, _) in enumerate(opened):
        header = first_header if i == 0 else (read_header(reader) if reader else None)
        if header is None or header.scope != "tensors":
            batches.append([i])
            files = None
            continue
        mine = {item.name or "" for item in header.items}
        layout = [(f.path, f.header.raw if f.header else f.size) for f in header.files]
        if files is not None and layout == files and not (mine & names):
            batches[-1].append(i)
            names |= mine
        else:
            batches.append([i])
            names, files = mine, layout
    return batches


def _check_chain(opened: list[tuple[PatchReader | None, PatchSource]]) -> None:
    """Before anything is written: each patch file's base must be its predecessor's target."""
    for (prev, _), (nxt, _) in zip(opened, opened[1:], strict=False):
        if prev is None or nxt is None:
            continue
        if "scope" in prev.header or "scope" in nxt.header:
            continue  # block patches bind tensors, not checkpoints: checked tensor by tensor
        stream = prev._stream  # noqa: SLF001 - a file we opened ourselves
        if not stream.seekable():
            continue
        here = stream.tell()
        trailer = read_trailer_at_end(stream, prev.name)
        stream.seek(here)
        produced = (
            trailer.get("target", {}).get("fingerprint")
            if isinstance(trailer.get("target"), dict)
            else None
        )
        expected = read_header(nxt).base_fingerprint
        if produced != expected:
            raise IntegrityError(
                f"{nxt.name}: patch chain out of order: it expects base {expected}, but "
                f"{prev.name} produces {produced}; give the patches in the order they were "
                "made, with none missing",
                path=nxt.name,
                expected=expected,
                actual=str(produced),
            )


def _apply_one(
    reader: PatchReader,
    header: PatchHeader,
    base: Checkpoint,
    dest: Path,
    workers: int,
    progress: Progress | None,
    durable: bool = False,
) -> tuple[list[FileRef], str]:
    """Write the target of one patch to ``dest`` and verify it.

    Returns the written files' refs and the target's fingerprint.
    """
    return _apply_parts([(reader, header)], base, dest, workers, progress, durable)


def _apply_parts(
    parts: list[tuple[PatchReader, PatchHeader]],
    base: Checkpoint,
    dest: Path,
    workers: int,
    progress: Progress | None,
    durable: bool = False,
    device: str | None = None,
) -> tuple[list[FileRef], str]:
    """Write ``dest`` in one pass from one full patch, or from block patches of disjoint tensors.

    Block patches are read side by side, each front to back, taking each tensor's frame from
    the patch that has it; every other byte comes from BASE.
    """
    first = parts[0][1]
    partial = first.scope == "tensors"
    bb = first.block_bytes
    owner: dict[str, tuple[int, int]] = {}  # block patches: tensor name -> (part, item index)
    if partial:
        for p, (_, h) in enumerate(parts):
            for i, item in enumerate(h.items):
                owner[item.name or ""] = (p, i)
        schedule = [
            owner[t.name]
            for f in first.files
            if f.header is not None
            for t in f.header.tensors
            if t.name in owner
        ]
    else:
        schedule = [(0, i) for i in range(len(first.items))]
    base_tensors: list[dict[str, TensorInfo]] = [
        {t.name: t for t in e.header.tensors} if e.header is not None else {} for e in base.files
    ]

    def base_start(p: int, index: int) -> int | None:
        reader, header = parts[p]
        item = header.items[index]
        if item.base_file is None:
            return None
        if item.base_name is None:
            found_size = base.files[item.base_file].size
            start = 0
        else:
            info = base_tensors[item.base_file].get(item.base_name)
            if info is None:
                raise CorruptPatchError(
                    f"{reader.name}: item {item.label!r} refers to a base tensor that is not there"
                )
            found_size, start = info.nbytes, info.start
        if found_size != item.nbytes:
            raise CorruptPatchError(
                f"{reader.name}: item {item.label!r} and its base differ in size", tensor=item.name
            )
        return start

    total = first.target_bytes
    with FileSource(base) as base_fds:

        def tasks() -> Iterator[Callable[[], np.ndarray]]:
            for p, index in schedule:
                reader, header = parts[p]
                item = header.items[index]
                nblocks = blocks_in(item.nbytes, bb)
                reader.read_frame(index, nblocks)
                start = base_start(p, index)
                for b in range(nblocks):
                    size = min(bb, item.nbytes - b * bb)
                    where = f"tensor {item.label!r} block {b}"
                    block = reader.read_block(bb + BLOCK_PAYLOAD_SLACK, where)
                    yield _decode_task(
                        block.codec,
                        block.payload,
                        item.word,
                        size,
                        base_fds,
                        item.base_file,
                        None if start is None else start + b * bb,
                        reader.name,
                        item.name,
                        device,
                    )

        # Reading the patch (often a pipe), decoding and writing overlap (ParaBlock).
        results = overlapped_map(tasks(), workers, window_for(workers, bb))
        computed_files: list[FileRef] = []
        item_fps: dict[tuple[int, int], str] = {}  # block patches: each tensor's fingerprint
        done = 0
        step = 0  # position in the schedule

        def write_item(f: BinaryIO, whole: Any) -> int:
            nonlocal step, done
            p, index = schedule[step]
            item = parts[p][1].items[index]
            h = new_hasher() if partial else None
            for _ in range(blocks_in(item.nbytes, bb)):
                data = next(results)
                f.write(memoryview(data))
                whole.update(data)
                if h is not None:
                    h.update(data)
                done += data.size
                if progress is not None:
                    progress(done, total)
            if h is not None:
                item_fps[(p, index)] = h.hexdigest()
            step += 1
            return item.nbytes

        def next_is_in(file_index: int) -> bool:
            if step >= len(schedule):
                return False
            p, index = schedule[step]
            return parts[p][1].items[index].file == file_index

        if first.layout == "dir":
            dest.mkdir()
        for file_index, tfile in enumerate(first.files):
            path = _output_path(dest, first.layout, tfile.path)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Only whole files are hashed while writing; the per-tensor fingerprints are
            # recomputed from the written file only if a file does not match (to name the tensor).
            whole = new_hasher()
            written = 0
            try:
                with open(path, "wb") as f:
                    if tfile.header is not None:
                        prefix = struct.pack("<Q", len(tfile.header.raw)) + tfile.header.raw
                        f.write(prefix)
                        whole.update(prefix)
                        written += len(prefix)
                    if partial:
                        # Block patches: their tensors decoded, every other byte from BASE.
                        for name, offset, size in _spans(tfile, base, file_index):
                            if name is not None and name in owner:
                                written += write_item(f, whole)
                                continue
                            for data in _copy_chunks(base_fds, file_index, offset, size):
                                f.write(memoryview(data))
                                whole.update(data)
                                written += data.size
                    else:
                        while next_is_in(file_index):
                            written += write_item(f, whole)
                    f.flush()
                    if durable:
                        os.fsync(f.fileno())
            except OSError as exc:
                raise os_error(exc, path) from exc
            computed_files.append(FileRef(tfile.path, written, whole.hexdigest()))
        # An item list that ends before the last file's items would leave results unread.
        if step != len(schedule) or next(results, None) is not None:
            raise CorruptPatchError(f"{parts[0][0].name}: items are not in file order")

    target_fp = checkpoint_fingerprint(
        first.layout, ((r.path, r.size, r.fingerprint) for r in computed_files)
    )
    for p, (reader, header) in enumerate(parts):
        trailer = trailer_from_json(reader.read_trailer(), header, reader.name)
        if partial:
            # The rest of the checkpoint is BASE's: only the patched tensors can be checked.
            for index, (item, want) in enumerate(zip(header.items, trailer.items, strict=True)):
                got = item_fps[(p, index)]
                if got != want.fingerprint:
                    raise _tensor_mismatch(reader.name, item, want.fingerprint, got)
        elif [(r.path, r.size, r.fingerprint) for r in computed_files] != [
            (r.path, r.size, r.fingerprint) for r in trailer.target_files
        ] or target_fp != trailer.target_fingerprint:
            raise _wrong_output(reader.name, header, trailer, dest, target_fp)
    return computed_files, target_fp


def _check_block_base(header: PatchHeader, base: Checkpoint, base_path: Path, patch: str) -> None:
    """A block patch applies when BASE has its layout and every tensor it reads is as expected."""
    hint = "apply the patch to the checkpoint it was made from"
    same = [e.relpath for e in base.files] == [f.path for f in header.files] and all(
        (e.header.raw if e.header else None) == (f.header.raw if f.header else None)
        for e, f in zip(base.files, header.files, strict=True)
    )
    if not same:
        raise IntegrityError(
            f"{base_path}: wrong base for {patch}: its files or tensor layout differ from the "
            f"block patch's; {hint}",
            path=str(base_path),
        )
    with FileSource(base) as source:
        for item in header.items:
            assert item.base_file is not None and item.base_name is not None
            found = base.find_tensor(item.base_name)
            assert found is not None
            info = found[1]
            h = new_hasher()
            for off in range(0, info.nbytes, _HASH_CHUNK):
                h.update(
                    source.read(
                        item.base_file, info.start + off, min(_HASH_CHUNK, info.nbytes - off)
                    )
                )
            have = h.hexdigest()
            if have != item.base_fingerprint:
                raise IntegrityError(
                    f"{base_path}: wrong base for {patch}: tensor {item.base_name!r} has "
                    f"fingerprint {have}, the block patch expects {item.base_fingerprint} (stale "
                    f"or already applied?); {hint}",
                    path=str(base_path),
                    tensor=item.base_name,
                    expected=item.base_fingerprint,
                    actual=have,
                )


_HASH_CHUNK = 16 * 1024 * 1024


def _spans(
    tfile: TargetFile, base: Checkpoint, file_index: int
) -> list[tuple[str | None, int, int]]:
    """(tensor name, offset in BASE's file, size) of each tensor of a file, in file order.

    A block patch leaves the layout as it is, so these are also the offsets in the output.
    """
    entry = base.files[file_index]
    if tfile.header is None:
        return [(None, 0, entry.size)]
    return [(t.name, t.start, t.nbytes) for t in tfile.header.tensors]


def _copy_chunks(
    source: FileSource, file_index: int, offset: int, nbytes: int
) -> Iterator[np.ndarray]:
    for off in range(0, nbytes, _HASH_CHUNK):
        yield source.read(file_index, offset + off, min(_HASH_CHUNK, nbytes - off))


def _tensor_mismatch(name: str, item: Item, want: str, got: str) -> IntegrityError:
    return IntegrityError(
        f"{name}: tensor {item.label!r} came out with fingerprint {got}, the patch says "
        f"{want}; the output was discarded",
        path=name,
        tensor=item.name,
        expected=want,
        actual=got,
    )


def _output_path(dest: Path, layout: str, relpath: str) -> Path:
    return dest if layout == "file" else dest / relpath


def _wrong_output(
    name: str, header: PatchHeader, trailer: PatchTrailer, dest: Path, target_fp: str
) -> IntegrityError:
    """Name the first tensor of the written output whose fingerprint is not the patch's."""
    for item, want in zip(header.items, trailer.items, strict=True):
        tfile = header.files[item.file]
        got = fingerprint_range(
            _output_path(dest, header.layout, tfile.path), item.start, item.nbytes
        )
        if got != want.fingerprint:
            return _tensor_mismatch(name, item, want.fingerprint, got)
    return IntegrityError(
        f"{name}: output fingerprint {target_fp} differs from the patch's target "
        f"{trailer.target_fingerprint}; the output was discarded",
        path=name,
        expected=trailer.target_fingerprint,
        actual=target_fp,
    )


def _decode_task(
    codec: int,
    payload: bytes,
    word: int,
    size: int,
    base_fds: FileSource,
    base_file: int | None,
    base_offset: int | None,
    patch_name: str,
    tensor: str | None,
    device: str | None = None,
) -> Callable[[], np.ndarray]:
    def run() -> np.ndarray:
        old = None
        if base_file is not None and base_offset is not None:
            old = base_fds.read(base_file, base_offset, size)
        try:
            moves = None
            if device is not None and old is not None:
                moves = decode_moves(codec, payload, old, word)
            if moves is not None:
                from pulsectl.device import apply_moves

                assert old is not None and device is not None
                out = apply_moves(old, moves[0], moves[1], word, device)
            else:
                out = decode_block(codec, payload, old, size, word)
        except CorruptPatchError as exc:
            raise CorruptPatchError(
                f"{patch_name}: tensor {tensor or '<file>'!r}: {exc}",
                path=patch_name,
                tensor=tensor,
            ) from exc
        if out.size != size:
            raise CorruptPatchError(f"{patch_name}: tensor {tensor!r}: block has the wrong size")
        return out

    return run


def _check_space(out: Path, need: int) -> None:
    try:
        st = os.statvfs(out.parent)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise OutputError(
            f"{out}: the patch's target needs {need:,} bytes but {out.parent} has {free:,} "
            "free; free some space or write the output elsewhere",
            path=out,
        )


def _wrong_base(
    header: PatchHeader, base: Checkpoint, refs: list[FileRef], base_path: Path, patch: str
) -> IntegrityError:
    """Name the first file, and in it the first tensor, that differs from the patch's base."""
    hint = "apply the patch to the checkpoint it was made from"
    expected = {f.path: (i, f) for i, f in enumerate(header.base_files)}
    actual = {r.path: r for r in refs}
    for path in sorted(set(expected) | set(actual)):
        label = str(base_path / path) if path else str(base_path)
        if path not in actual:
            return IntegrityError(
                f"{label}: wrong base for {patch}: file is missing; {hint}", path=label
            )
        if path not in expected:
            return IntegrityError(
                f"{label}: wrong base for {patch}: file is not part of the patch's base; {hint}",
                path=label,
            )
        index, want = expected[path]
        got = actual[path]
        if want.fingerprint == got.fingerprint:
            continue
        entry = base.file(path)
        if entry is not None and entry.header is not None:
            with FileSource(base) as source:
                _, tensor_fps = scan(source, base.files.index(entry))
            for item in header.items:
                if item.base_file == index and item.base_name is not None:
                    have = tensor_fps.get(item.base_name)
                    if have != item.base_fingerprint:
                        return IntegrityError(
                            f"{label}: wrong base for {patch}: tensor {item.base_name!r} has "
                            f"fingerprint {have}, the patch expects {item.base_fingerprint}; "
                            f"{hint}",
                            path=label,
                            tensor=item.base_name,
                            expected=item.base_fingerprint,
                            actual=have,
                        )
        return IntegrityError(
            f"{label}: wrong base for {patch}: file fingerprint {got.fingerprint}, the patch "
            f"expects {want.fingerprint}; {hint}",
            path=label,
            expected=want.fingerprint,
            actual=got.fingerprint,
        )
    return IntegrityError(
        f"{base_path}: wrong base for {patch}: fingerprint differs from "
        f"{header.base_fingerprint}; {hint}",
        path=str(base_path),
        expected=header.base_fingerprint,
    )
