"""apply: a base checkpoint and a chain of patches in, the exact target checkpoint out.

base files checked against the first patch
  -> for each patch: PatchReader (file or pipe, frame by frame, on its own thread)
     -> workers: base block read (pread, reused buffers), decoded, written at its offset
        in a temp path in OUT's folder (pwrite)
     -> this thread, in order: each base tensor hashed and checked against the patch's
        base_fingerprint, each output file hashed
     -> trailer: file checksum and every target fingerprint checked
  -> the verified temp renamed to OUT (a failure anywhere removes the temp)
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pulsectl._atomic import (
    check_folder_target,
    check_target,
    file_path,
    install,
    naming_output,
    os_error,
    refuse_inside_folder_input,
    remove,
    same_file,
    temp_path,
)
from pulsectl._io import BufferPool, default_workers, overlapped_map, pwrite_all, window_for
from pulsectl.checkpoint import Checkpoint, SafetensorsHeader, TensorInfo, refuse_special_file
from pulsectl.codecs import decode_block, decode_moves, patch_in_place
from pulsectl.codecs._bits import add_moves
from pulsectl.device import check_name
from pulsectl.errors import (
    CorruptPatchError,
    FormatError,
    IntegrityError,
    OutputError,
    PulseError,
    UsageError,
)
from pulsectl.format import (
    BLOCK_PAYLOAD_SLACK,
    MAGIC,
    PatchReader,
    PatchSource,
    blocks_in,
    open_patch,
    read_trailer_at_end,
    refuse_terminal_input,
)
from pulsectl.hashing import checkpoint_fingerprint, fingerprint_range, new_hasher
from pulsectl.patch import (
    FileRef,
    Item,
    PatchHeader,
    PatchTrailer,
    TargetFile,
    chain_out_of_order,
    header_from_json,
    trailer_from_json,
)
from pulsectl.sources import FileSource

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ApplySummary:
    output: Path
    target_fingerprint: str
    patches: int
    target_bytes: int


def read_header(reader: PatchReader) -> PatchHeader:
    return header_from_json(reader.header, reader.name)


class _Headers:
    """Each patch's header, validated once however often it is asked for; the safetensors
    headers the patches store are parsed once for all (block patches of one update each store
    the whole checkpoint's)."""

    def __init__(self) -> None:
        self._headers: dict[PatchReader, PatchHeader] = {}  # readers hash by identity
        self._stored: dict[bytes, SafetensorsHeader] = {}

    def __call__(self, reader: PatchReader) -> PatchHeader:
        if reader not in self._headers:
            self._headers[reader] = header_from_json(reader.header, reader.name, self._stored)
        return self._headers[reader]


def _open_late(
    source: PatchSource, stdin: BinaryIO | None, stack: contextlib.ExitStack
) -> PatchReader:
    """A patch read only when its turn comes ('-', a named pipe); a pipe is closed at the end."""
    reader, stream = open_patch(source, stdin)
    if isinstance(source, (str, Path)) and str(source) != "-":
        stack.callback(stream.close)
    return reader


def _is_pipe(source: str | Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(source).st_mode)
    except OSError:
        return False


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
    on_wait: Callable[[str], None] | None = None,
) -> ApplySummary:
    """Apply ``patches`` in order to ``base`` and write the verified result to ``out``.

    The result appears at ``out`` only once verified (temp file, then rename); ``durable`` also
    fsyncs it before the rename. ``device`` (a torch device name) scatters the decoded changes
    into the base blocks there; None does it with numpy. With ``in_place``, runs that update
    the same BASE take turns (``on_wait`` is told when this one has to wait).
    """
    with naming_output(Path(base) if in_place else Path(out) if out is not None else None):
        return _apply_patches(
            base,
            patches,
            out,
            in_place=in_place,
            force=force,
            workers=workers,
            progress=progress,
            stdin=stdin,
            durable=durable,
            device=device,
            on_wait=on_wait,
        )


def _apply_patches(
    base: str | Path,
    patches: Sequence[PatchSource],
    out: str | Path | None,
    *,
    in_place: bool,
    force: bool,
    workers: int | None,
    progress: Progress | None,
    stdin: BinaryIO | None,
    durable: bool,
    device: str | None,
    on_wait: Callable[[str], None] | None,
) -> ApplySummary:
    base_path = Path(base)
    check_name(device)
    if not patches:
        raise UsageError("no patch given")
    dashes = sum(1 for p in patches if isinstance(p, (str, Path)) and str(p) == "-")
    if dashes > 1:
        raise UsageError("standard input ('-') can be given as a patch only once")
    if dashes and stdin is None:
        refuse_terminal_input()  # before any work on the patches ahead of it
    refuse_special_file(base_path)  # a named pipe would wait in the --in-place lock's open()
    if _is_patch(base_path):
        raise UsageError(
            f"{base}: BASE is a .pulse patch; give the checkpoint first, then the patches "
            "(pulsectl apply BASE PATCH... -o OUT)"
        )
    if in_place:
        if out is not None and Path(out).resolve() != base_path.resolve():
            raise UsageError(
                "--in-place writes to BASE; do not give -o as well", option="--in-place"
            )
        out_path = base_path
    else:
        if out is None:
            raise UsageError("give -o OUT, or --in-place to update BASE", option="-o")
        out_path = Path(out)  # drops a trailing '/': see file_path below
        if out_path.exists() and out_path.resolve() == base_path.resolve():
            raise UsageError(f"{out_path} is BASE; use --in-place to update it")
        refuse_inside_folder_input(out_path, [base_path], "output")
        for n, source in enumerate(patches, 1):
            if isinstance(source, (str, Path)) and same_file(out_path, source):
                raise UsageError(
                    f"{out_path} is patch {n} of this apply; the checkpoint would replace it, "
                    "even with -f: write the output elsewhere"
                )
        if not out_path.is_dir():  # a folder is checked once the patch says what it makes
            check_target(out_path, force)
    workers = workers or default_workers()

    with contextlib.ExitStack() as stack:
        if in_place:
            stack.enter_context(_updating(base_path, on_wait))
        opened: list[tuple[PatchReader | None, PatchSource]] = []
        for source in patches:
            if isinstance(source, (str, Path)) and (str(source) == "-" or _is_pipe(source)):
                # Read its header when its turn comes: a pipe's writer may be the one that
                # writes the patches before it (`mkfifo`, one producer), and would wait.
                opened.append((None, source))
                continue
            reader, stream = open_patch(source)
            if isinstance(source, (str, Path)):
                stack.callback(stream.close)
            opened.append((reader, source))
        headers = _Headers()
        _check_chain(opened, headers)

        current = Checkpoint.open(base_path)
        first = opened[0][0] or _open_late(opened[0][1], stdin, stack)
        opened[0] = (first, opened[0][1])
        first_header = headers(first)
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
            # Each base tensor is checked against the patch while it is read (one pass).
            refs = list(first_header.base_files)
            current_fp = first_header.base_fingerprint
            _check_base_files(first_header, current, base_path, first.name)
        if first_header.layout == "file" and out is not None and not in_place:
            file_path(out, "patched checkpoint")  # 'runs/': a folder, for a single file
        if out_path.is_dir() and not in_place:
            if first_header.layout == "file":
                raise OutputError(
                    f"{out_path}: is a folder, and the patch makes a single file; give the "
                    "file's path (-o FOLDER/model.safetensors)",
                    path=out_path,
                )
            check_target(out_path, force)
            check_folder_target(
                out_path, [base_path, *(Path(p) for p in patches if isinstance(p, (str, Path)))]
            )
        _check_space(out_path, first_header.target_bytes)

        temps: list[Path] = []
        try:
            for batch in _batches(opened, first_header, headers):
                i = batch[0]
                maybe_reader, source = opened[i]
                reader = maybe_reader or _open_late(source, stdin, stack)
                header = first_header if i == 0 else headers(reader)
                parts = [(reader, header)]
                if header.scope == "tensors":
                    # Block patches of disjoint tensors are applied together, in one pass.
                    parts += [(r, headers(r)) for r, _ in (opened[j] for j in batch[1:]) if r]
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
                try:
                    refs, current_fp = _apply_parts(
                        parts, current, dest, workers, progress, durable and last, device
                    )
                except IntegrityError as exc:
                    if current.root == base_path:
                        raise
                    # The base of this batch is the temp that the patches before it wrote:
                    # name it as the user knows it.
                    earlier = opened[i - 1][0]
                    raise _as_left_by(exc, current.root, base_path, earlier) from exc
                if len(temps) > 1:
                    remove(temps[0])  # then forget it: an interrupt in between still removes it
                    del temps[0]
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


@contextlib.contextmanager
def _updating(base: Path, on_wait: Callable[[str], None] | None) -> Iterator[None]:
    """Hold an advisory lock on ``base`` (a file or folder) while --in-place replaces it.

    Two in-place updates of one checkpoint (one per arriving block patch, say) would each read
    the old BASE and the second rename would drop the first's changes; with the lock the second
    waits, then reads what the first wrote. The lock is on the inode the path names; if the
    path names another one by the time it is held (the other run renamed its result into
    place), it is taken again on that one. Systems without flock (Windows) do without.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    told = False
    while True:
        try:
            fd = os.open(base, os.O_RDONLY)
        except OSError:
            yield  # a missing or unreadable BASE is reported by the code that reads it
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None and not told:
                    on_wait(f"{base}: another pulsectl is updating it; waiting for it to finish")
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
        except OSError as exc:
            # No lock here (NFS wants a file opened for writing, some file systems have none):
            # go on as before the lock existed, and say so.
            os.close(fd)
            if on_wait is not None:
                on_wait(
                    f"{base}: cannot lock it ({exc.strerror or exc}); another `apply --in-place` "
                    "of it at the same time would not wait for this one"
                )
            yield
            return
        except BaseException:
            os.close(fd)
            raise
        try:
            now: os.stat_result | None = os.stat(base)
        except OSError:
            now = None  # between the two renames of a system without renameat2: look again
        if now is not None and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        os.close(fd)


def _as_left_by(
    exc: IntegrityError, temp: Path, base: Path, earlier: PatchReader | None
) -> IntegrityError:
    """``exc`` about a file of ``temp`` (the result of the earlier patches of a chain) with
    that file named as BASE as ``earlier``, the patch before, left it."""
    label = f"{base} (as {earlier.name if earlier else 'the patch before'} left it)"
    path = (exc.path or "").replace(str(temp), label, 1)
    return type(exc)(
        exc.message.replace(str(temp), label, 1),
        path=path or None,
        tensor=exc.tensor,
        expected=exc.expected,
        actual=exc.actual,
    )


def _batches(
    opened: list[tuple[PatchReader | None, PatchSource]],
    first_header: PatchHeader,
    headers: Callable[[PatchReader], PatchHeader] = read_header,
) -> list[list[int]]:
    """Group runs of block patches (same layout, disjoint tensors) to apply in one pass."""
    batches: list[list[int]] = []
    names: set[str] = set()
    files: Any = None
    for i, (reader, _) in enumerate(opened):
        header = first_header if i == 0 else (headers(reader) if reader else None)
        if header is None or header.scope != "tensors":
            batches.append([i])
            files = None
            continue
        mine = {item.name or "" for item in header.items}
        # One pass reads every part's blocks with one block size: parts made with another
        # (DiffOptions.block_bytes, another writer) go in a pass of their own.
        layout = [header.block_bytes] + [
            (f.path, f.header.raw if f.header else f.size) for f in header.files
        ]
        if files is not None and layout == files and not (mine & names):
            batches[-1].append(i)
            names |= mine
        else:
            batches.append([i])
            names, files = mine, layout
    return batches


def _check_chain(
    opened: list[tuple[PatchReader | None, PatchSource]],
    headers: Callable[[PatchReader], PatchHeader] = read_header,
) -> None:
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
        expected = headers(nxt).base_fingerprint
        if produced != expected:
            raise chain_out_of_order(
                nxt.name, expected, prev.name, produced, headers(prev).base_fingerprint
            )


@dataclass(frozen=True)
class _Prefix:
    """A safetensors file's length prefix and header."""

    file: int
    data: bytes


@dataclass(frozen=True)
class _Block:
    """One block of an item: decoded against the base, written at its offset."""

    part: int  # which patch of ``parts``
    index: int  # item index in that patch
    block: int
    last: bool
    file: int
    offset: int  # in the output file
    size: int
    base_file: int | None
    base_offset: int | None


@dataclass(frozen=True)
class _Copy:
    """Block patches: bytes of BASE outside the patched tensors, copied as they are."""

    file: int
    offset: int  # the same in BASE's file and the output
    size: int


_Step = _Prefix | _Block | _Copy


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
    the patch that has it; every other byte comes from BASE. Workers read the base blocks,
    hash them in block order into their tensor's base fingerprint (``_Chain``), decode and
    write them at their offsets; this thread checks those fingerprints and hashes, in order,
    what was written (the target fingerprints).
    """
    plan = _plan(parts, base)
    first = parts[0][1]
    partial = first.scope == "tensors"
    total = first.target_bytes
    pool = BufferPool(keep=2 * window_for(workers, first.block_bytes) + 4)
    paths = [_output_path(dest, first.layout, f.path) for f in first.files]
    if first.layout == "dir":
        dest.mkdir()
    fds: list[int] = []
    with FileSource(base) as base_fds, contextlib.ExitStack() as closing:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise os_error(exc, path) from exc
            closing.callback(os.close, fd)
            fds.append(fd)

        # One writer per file at a time: concurrent pwrites to one file queue on its inode lock
        # in the kernel, which spins while the holder runs and so burns the other core.
        write_locks = [threading.Lock() for _ in fds]
        abandoned = threading.Event()  # set once this pass stops, on success or an error

        def write(file: int, data: np.ndarray | bytes, offset: int) -> None:
            try:
                with write_locks[file]:
                    pwrite_all(fds[file], data, offset)
            except OSError as exc:
                raise os_error(exc, paths[file]) from exc

        def tasks() -> Iterator[Callable[[], tuple[Any, Any]]]:
            chain = _Chain(abandoned)
            for step in plan:
                if isinstance(step, _Prefix):
                    yield _prefix_task(step, write)
                elif isinstance(step, _Copy):
                    yield _copy_task(step, base_fds, pool, write)
                else:
                    reader, header = parts[step.part]
                    item = header.items[step.index]
                    if step.block == 0:
                        chain = _Chain(abandoned)
                        nblocks = blocks_in(item.nbytes, first.block_bytes)
                        reader.read_frame(step.index, nblocks)
                        if nblocks == 0:
                            yield _EMPTY_TASK
                            continue
                    where = f"tensor {item.label!r} block {step.block}"
                    block = reader.read_block(first.block_bytes + BLOCK_PAYLOAD_SLACK, where)
                    yield _decode_task(
                        step,
                        block.codec,
                        block.payload,
                        item,
                        base_fds,
                        pool,
                        write,
                        chain,
                        reader.name,
                        device,
                    )

        # Reading the patch (often a pipe), decoding and writing overlap (ParaBlock).
        results = overlapped_map(tasks(), workers, window_for(workers, first.block_bytes))
        # On any exit, first wait for the workers (closing the generator shuts its pool down):
        # a worker still writing when the output's fd is closed could write into whatever file
        # reuses that fd number next.
        closing.callback(results.close)
        # ... and before that, release any worker waiting for a block that was cancelled.
        closing.callback(abandoned.set)
        wholes = [new_hasher() for _ in first.files]
        written = [0] * len(first.files)
        item_fps: dict[tuple[int, int], str] = {}  # block patches: each tensor's fingerprint
        item_h: Any = None
        done = 0
        for step in plan:
            try:
                chain, new = next(results)
            except CorruptPatchError as exc:
                if isinstance(step, _Block):
                    # Decoding against the wrong base can fail before its fingerprint is known.
                    reader, header = parts[step.part]
                    _check_item_base(
                        header.items[step.index], base, reader.name, exc, partial, step.index
                    )
                raise
            wholes[step.file].update(new)
            written[step.file] += len(new)
            if isinstance(step, _Block):
                reader, header = parts[step.part]
                item = header.items[step.index]
                if step.block == 0:
                    item_h = new_hasher() if partial else None
                if item_h is not None:
                    item_h.update(new)
                if step.last:
                    if (
                        chain is not None
                        and chain.fed
                        and chain.hexdigest() != item.base_fingerprint
                    ):
                        raise _wrong_base_tensor(
                            item, base, chain.hexdigest(), reader.name, partial, step.index
                        )
                    if item_h is not None:
                        item_fps[(step.part, step.index)] = item_h.hexdigest()
            pool.give(new)
            done += len(new)
            if progress is not None:
                progress(done, total)
        # Every task has run; let the patch reader thread finish before reading the trailers.
        if next(results, None) is not None:
            raise CorruptPatchError(f"{parts[0][0].name}: items are not in file order")
        if durable:
            for fd, path in zip(fds, paths, strict=True):
                try:
                    os.fsync(fd)
                except OSError as exc:
                    raise os_error(exc, path) from exc
    computed_files = [
        FileRef(f.path, n, h.hexdigest())
        for f, n, h in zip(first.files, written, wholes, strict=True)
    ]

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


_USUAL_FIX = "apply the patch to the checkpoint it was made from"


def _other_dtype_hint(header: PatchHeader, item: Item, found: TensorInfo | None) -> str:
    """The fix for a base tensor of the wrong size: the usual one, or, when the base has the
    tensor in another float dtype than the patch (an FP32 master against its BF16 cast, a BF16
    checkpoint against its FP8 cast), which `--as` or `cast` it takes."""
    from pulsectl.cast import CAST_SOURCES
    from pulsectl.cast import TARGETS as CAST_TARGETS

    usual = _USUAL_FIX
    stored = header.files[item.file].header
    want = None
    if found is not None and stored is not None:
        want = next((t for t in stored.tensors if t.name == item.name), None)
    if found is None or want is None or want.shape != found.shape:
        return usual
    narrow, wide = sorted((want, found), key=lambda t: t.word)
    # Any float cast turns into a narrower target: F32 into BF16, and BF16 into FP8 too.
    if narrow.dtype.lower() not in CAST_TARGETS or wide.dtype not in CAST_SOURCES:
        return usual
    to = narrow.dtype.lower()
    if want is narrow:
        how = (
            f"the patch was made with --as {to}: apply it to the cast of the checkpoint it was "
            f"made from (pulsectl cast CKPT --to {to})"
        )
    else:
        how = (
            f"the patch was made from {wide.dtype} checkpoints: to update their {narrow.dtype} "
            f"cast, diff with --as {to} (or {usual})"
        )
    return f"it is {found.dtype} here, {want.dtype} in the patch; {how}"


def _plan(parts: list[tuple[PatchReader, PatchHeader]], base: Checkpoint) -> list[_Step]:
    """Every write of the output, in file order, checked before anything is written."""
    first = parts[0][1]
    bb = first.block_bytes
    partial = first.scope == "tensors"
    base_tensors: list[dict[str, TensorInfo]] = [
        {t.name: t for t in e.header.tensors} if e.header is not None else {} for e in base.files
    ]

    def item_steps(p: int, index: int) -> Iterator[_Block]:
        reader, header = parts[p]
        item = header.items[index]
        start: int | None = None
        info: TensorInfo | None = None  # the base tensor (None: the item reads a whole file)
        if item.base_file is not None:
            if item.base_name is None:
                found_size, start = base.files[item.base_file].size, 0
            else:
                info = base_tensors[item.base_file].get(item.base_name)
                if info is None:
                    raise IntegrityError(
                        f"{base.files[item.base_file].path}: wrong base for {reader.name}: it "
                        f"has no tensor {item.base_name!r}; apply the patch to the checkpoint "
                        "it was made from",
                        path=str(base.files[item.base_file].path),
                        tensor=item.base_name,
                    )
                found_size, start = info.nbytes, info.start
            if found_size != item.nbytes:
                # A file of another size (a config.json that `cast` rewrote) says less than
                # a tensor in another dtype (the step that was missed): that one first.
                cast = (
                    None
                    if info is not None
                    else _cast_mismatch(reader.name, header, base, base_tensors)
                )
                raise cast or _size_mismatch(reader.name, header, item, base, found_size, info)
        n = blocks_in(item.nbytes, bb)
        if n == 0:  # an empty tensor: a frame with no blocks
            yield _Block(p, index, 0, True, item.file, item.start, 0, None, None)
        for b in range(n):
            yield _Block(
                p,
                index,
                b,
                b == n - 1,
                item.file,
                item.start + b * bb,
                min(bb, item.nbytes - b * bb),
                item.base_file,
                None if start is None else start + b * bb,
            )

    owner: dict[str, tuple[int, int]] = {}  # block patches: tensor name -> (part, item index)
    for p, (_, h) in enumerate(parts if partial else []):
        for i, item in enumerate(h.items):
            owner[item.name or ""] = (p, i)
    plan: list[_Step] = []
    step = 0  # full patch: position in its items
    for fi, tfile in enumerate(first.files):
        at = 0
        if tfile.header is not None:
            prefix = struct.pack("<Q", len(tfile.header.raw)) + tfile.header.raw
            plan.append(_Prefix(fi, prefix))
            at = len(prefix)
        if partial:
            for name, offset, size in _spans(tfile, base, fi):
                if name is not None and name in owner:
                    plan.extend(item_steps(*owner[name]))
                else:
                    plan.extend(
                        _Copy(fi, offset + off, min(bb, size - off)) for off in range(0, size, bb)
                    )
        else:
            items = first.items
            while step < len(items) and items[step].file == fi:
                if items[step].start != at:
                    raise CorruptPatchError(
                        f"{parts[0][0].name}: item {items[step].label!r} does not start where "
                        "the one before it ends"
                    )
                plan.extend(item_steps(0, step))
                at += items[step].nbytes
                step += 1
    if not partial and step != len(first.items):
        raise CorruptPatchError(f"{parts[0][0].name}: items are not in file order")
    return plan


def _size_mismatch(
    patch: str,
    header: PatchHeader,
    item: Item,
    base: Checkpoint,
    found_size: int,
    info: TensorInfo | None,
) -> IntegrityError:
    assert item.base_file is not None
    where = base.files[item.base_file].path
    return IntegrityError(
        f"{where}: wrong base for {patch}: "
        f"{'tensor ' + repr(item.base_name) if item.base_name else 'the file'} has "
        f"{found_size:,} bytes, the patch's base had {item.nbytes:,}; "
        + _other_dtype_hint(header, item, info),
        path=str(where),
        tensor=item.base_name,
    )


def _cast_mismatch(
    patch: str,
    header: PatchHeader,
    base: Checkpoint,
    base_tensors: list[dict[str, TensorInfo]],
) -> IntegrityError | None:
    """The error of the first tensor the patch reads that BASE has in another float dtype
    (``_other_dtype_hint``), if any."""
    for item in header.items:
        if item.base_file is None or item.base_name is None:
            continue
        info = base_tensors[item.base_file].get(item.base_name)
        if (
            info is not None
            and info.nbytes != item.nbytes
            and _other_dtype_hint(header, item, info) != _USUAL_FIX
        ):
            return _size_mismatch(patch, header, item, base, info.nbytes, info)
    return None


def _empty() -> tuple[None, np.ndarray]:
    return None, np.empty(0, dtype=np.uint8)


_EMPTY_TASK = _empty

Writer = Callable[[int, "np.ndarray | bytes", int], None]


def _prefix_task(step: _Prefix, write: Writer) -> Callable[[], tuple[None, bytes]]:
    def run() -> tuple[None, bytes]:
        write(step.file, step.data, 0)
        return None, step.data

    return run


def _copy_task(
    step: _Copy, source: FileSource, pool: BufferPool, write: Writer
) -> Callable[[], tuple[None, np.ndarray]]:
    def run() -> tuple[None, np.ndarray]:
        data = source.read_into(step.file, step.offset, pool.take(step.size))
        write(step.file, data, step.offset)
        return None, data

    return run


def _check_item_base(
    item: Item,
    base: Checkpoint,
    patch: str,
    cause: Exception,
    block: bool = False,
    index: int | None = None,
) -> None:
    """Raise the wrong-base error if ``item``'s base tensor is not the patch's."""
    if item.base_file is None or item.base_fingerprint is None:
        return
    entry = base.files[item.base_file]
    start, nbytes = 0, entry.size
    if item.base_name is not None:
        found = base.find_tensor(item.base_name)
        if found is None:
            return
        start, nbytes = found[1].start, found[1].nbytes
    have = fingerprint_range(entry.path, start, nbytes)
    if have != item.base_fingerprint:
        raise _wrong_base_tensor(item, base, have, patch, block, index) from cause


def _wrong_base_tensor(
    item: Item,
    base: Checkpoint,
    have: str,
    patch: str,
    block: bool = False,
    index: int | None = None,
) -> IntegrityError:
    entry = base.files[item.base_file or 0]
    what = f"tensor {item.base_name!r}" if item.base_name is not None else "file"
    which = "block patch" if block else "patch"
    if index is not None and _writes(patch, index) == have:
        # The base already holds what the patch writes there: the commonest wrong base.
        why = (
            f"{what} already has the bytes the {which} writes (fingerprint {have}), so BASE "
            "looks like its target: applied already, or made with OLD and NEW swapped?"
        )
    else:
        stale = " (stale or already applied?)" if block else ""
        why = (
            f"{what} has fingerprint {have}, the {which} expects {item.base_fingerprint}"
            f"{stale}; apply the patch to the checkpoint it was made from"
        )
    return IntegrityError(
        f"{entry.path}: wrong base for {patch}: {why} (nothing was written)",
        path=str(entry.path),
        tensor=item.base_name,
        expected=item.base_fingerprint,
        actual=have,
    )


def _writes(patch: str, index: int) -> str | None:
    """The fingerprint item ``index`` of the patch file ``patch`` gives its tensor, from the
    trailer (read from a fresh handle: the apply's reader may still be reading); None where
    that cannot be known (a pipe, a damaged trailer)."""
    try:
        if patch == "-" or not os.path.isfile(patch):
            return None
        with open(patch, "rb") as stream:
            items = read_trailer_at_end(stream, patch).get("items")
        fp = items[index]["fingerprint"] if isinstance(items, list) else None
    except (OSError, PulseError, LookupError, TypeError):
        return None
    return fp if isinstance(fp, str) else None


def same_block_layout(header: PatchHeader, ckpt: Checkpoint) -> bool:
    """Whether ``ckpt`` has a block patch's files and headers (its base and its target do)."""
    return [e.relpath for e in ckpt.files] == [f.path for f in header.files] and all(
        (e.header.raw if e.header else None) == (f.header.raw if f.header else None)
        for e, f in zip(ckpt.files, header.files, strict=True)
    )


def _check_block_base(header: PatchHeader, base: Checkpoint, base_path: Path, patch: str) -> None:
    """A block patch applies when BASE has its layout (files and headers).

    Each tensor it reads is checked against its ``base_fingerprint`` while it is applied.
    """
    hint = "apply the patch to the checkpoint it was made from"
    if not same_block_layout(header, base):
        raise IntegrityError(
            f"{base_path}: wrong base for {patch}: its files or tensor layout differ from the "
            f"block patch's; {hint}",
            path=str(base_path),
        )


def _check_base_files(header: PatchHeader, base: Checkpoint, base_path: Path, patch: str) -> None:
    """The base has the patch's base files (the sizes of what the items read are checked by
    ``_plan``).

    Every base tensor (or blob) the patch reads is checked against its ``base_fingerprint``
    while it is applied, so the whole base is not hashed first.
    """
    hint = "apply the patch to the checkpoint it was made from"
    expected = {f.path: f for f in header.base_files}
    actual = {e.relpath: e for e in base.files}
    for path in sorted(set(expected) | set(actual)):
        label = str(base_path / path) if path else str(base_path)
        if path not in actual:
            raise IntegrityError(
                f"{label}: wrong base for {patch}: file is missing; {hint}", path=label
            )
        if path not in expected:
            raise IntegrityError(
                f"{label}: wrong base for {patch}: file is not part of the patch's base; {hint}",
                path=label,
            )


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
    step: _Block,
    codec: int,
    payload: bytes,
    item: Item,
    base_fds: FileSource,
    pool: BufferPool,
    write: Writer,
    chain: _Chain,
    patch_name: str,
    device: str | None = None,
) -> Callable[[], tuple[_Chain, np.ndarray]]:
    def run() -> tuple[_Chain, np.ndarray]:
        old = None
        try:
            if step.base_file is not None and step.base_offset is not None:
                old = base_fds.read_into(step.base_file, step.base_offset, pool.take(step.size))
        finally:
            chain.feed(step.block, old)  # the base bytes, before they are patched in place
        try:
            if (
                old is not None
                and device is None
                and patch_in_place(codec, payload, old, item.word)
            ):
                out = old  # patched in place: its base fingerprint is already taken
            else:
                out = _decode(codec, payload, old, step.size, item.word, pool, device)
        except (CorruptPatchError, FormatError) as exc:  # damaged, or a newer codec
            raise type(exc)(
                f"{patch_name}: tensor {item.label!r}: {exc}",
                path=patch_name,
                tensor=item.name,
            ) from exc
        if out.size != step.size:
            raise CorruptPatchError(
                f"{patch_name}: tensor {item.label!r}: block has the wrong size"
            )
        write(step.file, out, step.offset)
        return chain, out

    return run


def _decode(
    codec: int,
    payload: bytes,
    old: np.ndarray | None,
    size: int,
    word: int,
    pool: BufferPool,
    device: str | None,
) -> np.ndarray:
    """A block's new bytes, by its positions and moves (scattered on ``device``) or whole."""
    moves = None if old is None else decode_moves(codec, payload, old, word)
    if moves is None:
        out = decode_block(codec, payload, old, size, word)
        if out is not old:
            pool.give(old)
        return out
    assert old is not None
    if device is not None:
        from pulsectl.device import apply_moves

        moved = apply_moves(old, moves[0], moves[1], word, device)
        if moved is not None:  # else the device `auto` chose failed: scatter on the host
            pool.give(old)
            return moved
    add_moves(old, moves[0], moves[1], word)  # in place: its base fingerprint is already taken
    return old


class _Chain:
    """One item's base fingerprint, fed by the workers block by block, in block order.

    Tasks start in submission order, so a block waiting for its turn only ever waits for
    blocks already running; a task that fails still passes its turn on. A task cancelled
    before it started does not: once apply stops on an error it cancels the tasks not yet
    started, and a later block of the same item may already be waiting for one of them. So a
    waiting block gives up its turn once ``abandoned`` is set (as apply does before it waits
    for the workers).
    """

    _POLL_S = 0.05  # how soon a waiting block notices ``abandoned``

    def __init__(self, abandoned: threading.Event) -> None:
        self._hasher = new_hasher()
        self._next = 0
        self._turn = threading.Condition()
        self._abandoned = abandoned
        self.fed = False

    def feed(self, block: int, data: np.ndarray | None) -> None:
        with self._turn:
            while self._next != block:
                if self._abandoned.is_set():
                    return  # apply has stopped: the blocks before this one may never run
                self._turn.wait(self._POLL_S)
        try:
            if data is not None:
                self._hasher.update(data)
                self.fed = True
        finally:
            with self._turn:
                self._next += 1
                self._turn.notify_all()

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


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


def _is_patch(path: Path) -> bool:
    """Whether ``path`` is a file that starts as a .pulse patch does."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False  # a named pipe would wait for a writer in open()
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False  # a folder, or missing: the checkpoint reader says what is wrong
