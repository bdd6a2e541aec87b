"""diff: two checkpoints in, one .pulse patch out, streaming block by block.

Checkpoint(old) + Checkpoint(new) -> items (tensors and blobs, target order)
  -> blocks read on a worker pool (memory maps, or pread) -> codec (pulsectl.codecs)
  -> PatchWriter in order, hashing the target as it goes -> trailer
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import struct
import threading
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from pulsectl import __version__, _prehash
from pulsectl._atomic import atomic_file, file_path, refuse_inside_folder_input, same_file
from pulsectl._dtypes import DTYPES
from pulsectl._io import BufferPool, default_workers, ordered_map, window_for

# `--level max` uses the context codec (positions grouped by the base word's exponent) at zstd
# level MAX_PRESET_LEVEL (its context tables; value planes keep the fast settings, see
# codecs/context.py).
from pulsectl._names import DEFAULT_LEVEL, MAX_LEVEL, MAX_PRESET_LEVEL  # noqa: F401
from pulsectl.checkpoint import Checkpoint
from pulsectl.codecs import EncodedBlock, encode_block
from pulsectl.codecs.context import KEYS as CONTEXT_KEYS
from pulsectl.errors import UsageError
from pulsectl.format import (
    BLOCK_CHECK,
    BLOCK_HEAD,
    DEFAULT_BLOCK_BYTES,
    FRAME_HEAD,
    PatchWriter,
    blocks_in,
)
from pulsectl.hashing import checkpoint_fingerprint, new_hasher, update_both
from pulsectl.patch import FileRef, Item, ItemResult, PatchHeader, PatchTrailer, TargetFile
from pulsectl.sources import FileSource, Source, scan

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class DiffOptions:
    level: int = DEFAULT_LEVEL  # zstd level of the planes
    context: bool = False  # also try the context codec (slower, smaller): `--level max`
    # A block patch: only the tensors matching one of ``tensors`` (fnmatch globs; all when
    # empty) and none of ``exclude``. It needs OLD and NEW to have the same files and headers.
    tensors: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    # None: numpy on the CPU (no torch import). A torch device name ("cuda", "cuda:1", "cpu"):
    # changed words are found with torch on that device; the patch bytes are the same.
    device: str | None = None

    @property
    def selecting(self) -> bool:
        return bool(self.tensors or self.exclude)

    def selects(self, name: str) -> bool:
        return (not self.tensors or self._picks.matches(name)) and not self._drops.matches(name)

    # The globs split once per options (dataclasses.replace makes a new one): a glob without
    # wildcards is a set lookup, so a block patch of N exact names (--blocks) selects in O(1)
    # per tensor instead of N fnmatch calls.
    @functools.cached_property
    def _picks(self) -> _Globs:
        return _Globs(self.tensors)

    @functools.cached_property
    def _drops(self) -> _Globs:
        return _Globs(self.exclude)

    block_bytes: int = DEFAULT_BLOCK_BYTES
    workers: int = field(default_factory=default_workers)

    def __post_init__(self) -> None:
        if self.device is not None:
            from pulsectl.device import check_name

            check_name(self.device)


_ESCAPES = ("[*]", "[?]", "[[]")  # what glob.escape writes for the three wildcard characters


def _literal(pattern: str) -> str | None:
    """The one name fnmatch glob ``pattern`` matches when it has no wildcard, else None.

    ``*``, ``?`` and ``[`` are fnmatch's only special characters; ``[*]``, ``[?]`` and ``[[]``
    (``glob.escape``) match just that character."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith(_ESCAPES, i):
            out.append(pattern[i + 1])
            i += 3
        elif pattern[i] in "*?[":
            return None
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


class _Globs:
    """fnmatch globs (case-sensitive): exact names in a set, the rest matched one by one."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        literals = {p: _literal(p) for p in patterns}
        self.names = frozenset(n for n in literals.values() if n is not None)
        self.globs = tuple(p for p, n in literals.items() if n is None)

    def matches(self, name: str) -> bool:
        return name in self.names or any(fnmatch.fnmatchcase(name, g) for g in self.globs)


@dataclass(frozen=True)
class DiffSummary:
    base_fingerprint: str
    target_fingerprint: str
    patch_bytes: int
    target_bytes: int
    changed_words: int
    total_words: int
    items: int
    # Tensors carried whole for want of a base tensor to diff against: NEW's tensors that OLD
    # has under no name (``new_tensors``) or with another shape or dtype (``recast_tensors``);
    # and OLD's tensors that NEW does not have (``removed_tensors``). Names in file order.
    new_tensors: tuple[str, ...] = ()
    recast_tensors: tuple[str, ...] = ()
    removed_tensors: tuple[str, ...] = ()
    diffed_tensors: int = 0  # NEW's tensors diffed against OLD's of the same name
    # A block patch (--tensors, --blocks): the bytes of the tensors it carries, the size to
    # compare it with (``target_bytes`` is the whole target's); None for a full patch.
    selected_bytes: int | None = None


def diff_to_path(
    old: str | Path | Source,
    new: str | Path | Source,
    out: str | Path,
    *,
    force: bool = False,
    options: DiffOptions | None = None,
    progress: Progress | None = None,
    durable: bool = False,
) -> DiffSummary:
    """Write the patch from ``old`` to ``new`` to ``out`` atomically (fsynced if ``durable``)."""
    out = file_path(out, "patch")
    refuse_input_as_output(out, (old, new))
    with atomic_file(out, force, durable) as f:
        return diff_checkpoints(old, new, f, options=options, progress=progress)


def refuse_input_as_output(out: Path, inputs: tuple[str | Path | Source, ...]) -> None:
    """UsageError when ``out`` is the file (or folder) of one of the diff's inputs."""
    for source in inputs:
        where = source.ckpt.root if isinstance(source, FileSource) else source
        if not isinstance(where, (str, Path)):
            continue  # a state dict or other source has no path
        if same_file(out, where):
            raise UsageError(f"{out} is an input of the diff; write the patch elsewhere")
        refuse_inside_folder_input(out, [where], "patch")


def diff_checkpoints(
    old: str | Path | Source,
    new: str | Path | Source,
    out: BinaryIO,
    *,
    options: DiffOptions | None = None,
    progress: Progress | None = None,
) -> DiffSummary:
    """Stream the patch that turns checkpoint ``old`` into checkpoint ``new`` to ``out``.

    ``old`` and ``new`` are checkpoint paths or sources (see pulsectl.sources).
    """
    options = options or DiffOptions()
    if not 1 <= options.level <= MAX_LEVEL:
        raise UsageError(f"level {options.level} is outside 1..{MAX_LEVEL}")
    with contextlib.ExitStack() as stack:
        base = _open_source(old, stack)
        target = _open_source(new, stack)
        return _diff_sources(base, target, old, new, out, options, progress)


def _open_source(spec: str | Path | Source, stack: contextlib.ExitStack) -> Source:
    if isinstance(spec, (str, Path)):
        return stack.enter_context(FileSource(Checkpoint.open(spec)))
    return spec


def _diff_sources(
    base: Source,
    target: Source,
    old: object,
    new: object,
    out: BinaryIO,
    options: DiffOptions,
    progress: Progress | None,
) -> DiffSummary:
    if base.layout != target.layout:
        raise UsageError(
            f"{old} is a {_layout_word(base.layout)} but {new} is a "
            f"{_layout_word(target.layout)}; diff a file against a file, a folder against a folder"
        )
    # The base's fingerprints go into the header, but nothing else needs them: the base is
    # hashed on its own thread while the blocks are encoded (see _write_patch).
    scanned = _Scan(base)
    scanned.start()
    base_index = {e.relpath: i for i, e in enumerate(base.files)}

    files: list[TargetFile] = []
    items: list[Item] = []  # base fingerprints are filled in once the base is hashed
    added: list[str] = []  # NEW's tensors that OLD lacks, or has with another shape or dtype
    recast: list[str] = []
    diffed = 0
    for fi, entry in enumerate(target.files):
        if entry.header is None:
            files.append(TargetFile(entry.relpath, "blob", entry.size, None))
            bentry = base.file(entry.relpath)
            if bentry is not None and bentry.header is None and bentry.size == entry.size:
                bi = base_index[bentry.relpath]
                items.append(Item(fi, None, 0, entry.size, 1, bi, None, None))
            else:
                items.append(Item(fi, None, 0, entry.size, 1, None, None, None))
            continue
        files.append(TargetFile(entry.relpath, "safetensors", entry.size, entry.header))
        for t in entry.header.tensors:
            found = base.find_tensor(t.name)
            word = DTYPES[t.dtype].word
            if found is not None and (found[1].dtype, found[1].shape) == (t.dtype, t.shape):
                bi = base_index[found[0].relpath]
                items.append(Item(fi, t.name, t.start, t.nbytes, word, bi, t.name, None))
                diffed += 1
            else:
                items.append(Item(fi, t.name, t.start, t.nbytes, word, None, None, None))
                (added if found is None else recast).append(t.name)

    scope: Literal["checkpoint", "tensors"] = "checkpoint"
    if options.selecting:
        _require_same_layout(base, target, old, new)
        names = [i.name for i in items if i.name is not None]
        items = [i for i in items if i.name is not None and options.selects(i.name)]
        if not items:
            some = ", ".join(names[:3]) + (f" ... ({len(names)} tensors)" if len(names) > 3 else "")
            raise UsageError(
                f"no tensor matches --tensors/--exclude; nothing to patch (NEW has {some})",
                option="--tensors",
            )
        for flag, patterns in (("--tensors", options.tensors), ("--exclude", options.exclude)):
            for pattern in patterns:  # one of several that selects nothing: likely a typo
                if not any(_Globs((pattern,)).matches(n) for n in names):
                    warnings.warn(
                        f"{flag} {pattern!r} matches no tensor of NEW (the patterns are "
                        "fnmatch globs: '[[]' matches a '[')",
                        stacklevel=2,
                    )
        scope = "tensors"

    def make_header() -> PatchHeader:
        base_refs, base_tensor_fps = scanned.result()
        base_fp = checkpoint_fingerprint(
            base.layout, ((r.path, r.size, r.fingerprint) for r in base_refs)
        )
        return PatchHeader(
            layout=target.layout,
            block_bytes=options.block_bytes,
            writer=f"pulsectl {__version__}",
            base_fingerprint=base_fp,
            base_files=tuple(base_refs),
            files=tuple(files),
            items=tuple(
                replace(
                    i,
                    base_fingerprint=base_refs[i.base_file].fingerprint
                    if i.base_name is None
                    else base_tensor_fps[(i.base_file, i.base_name)],
                )
                if i.base_file is not None
                else i
                for i in items
            ),
            scope=scope,
        )

    try:
        summary = _write_patch(
            make_header, scanned.done, items, files, base, target, out, options, progress
        )
    finally:
        scanned.stop()  # failed or interrupted early: stop hashing before the files close
    if scope == "tensors":
        return summary  # the base's headers, kept: nothing is added, recast or removed
    kept = {t.name for e in target.files if e.header is not None for t in e.header.tensors}
    return replace(
        summary,
        new_tensors=tuple(added),
        recast_tensors=tuple(recast),
        removed_tensors=tuple(
            t.name
            for e in base.files
            if e.header is not None
            for t in e.header.tensors
            if t.name not in kept
        ),
        diffed_tensors=diffed,
    )


class _Scan(threading.Thread):
    """Every base file's fingerprint and every base tensor's, on a thread of its own."""

    def __init__(self, base: Source) -> None:
        super().__init__(name="pulsectl-scan", daemon=True)
        self._base = base
        self._stop_event = threading.Event()
        self._refs: list[FileRef] = []
        self._fps: dict[tuple[int, str], str] = {}
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            for index in range(len(self._base.files)):
                ref, fps = scan(self._base, index, self._stop_event)
                self._refs.append(ref)
                for name, fp in fps.items():
                    self._fps[(index, name)] = fp
        except BaseException as exc:  # handed to result()
            self._error = exc

    def done(self) -> bool:
        return not self.is_alive()

    def result(self) -> tuple[list[FileRef], dict[tuple[int, str], str]]:
        self.join()
        if self._error is not None:
            raise self._error
        return self._refs, self._fps

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            _prehash.stop()  # it may be waiting for the child's fingerprints of the base
        self.join()


def _require_same_layout(base: Source, target: Source, old: object, new: object) -> None:
    """Block patches keep every file and header of the base: check that NEW has them too."""
    same = [e.relpath for e in base.files] == [e.relpath for e in target.files] and all(
        (a.header.raw if a.header else a.size) == (b.header.raw if b.header else b.size)
        for a, b in zip(base.files, target.files, strict=True)
    )
    if not same:
        raise UsageError(
            f"{old} and {new} differ in their files or safetensors headers (tensors added, "
            "removed, reshaped, re-typed or in another order, or other metadata); a block patch "
            "(--tensors/--exclude/--blocks) keeps the base's headers, so it needs them to be the "
            "same: make a full patch instead"
        )
    for index, entry in enumerate(target.files):
        if entry.header is None and (
            scan(base, index)[0].fingerprint != scan(target, index)[0].fingerprint
        ):
            raise UsageError(
                f"{entry.relpath} differs between {old} and {new}; block patches carry tensors "
                "only: make a full patch instead"
            )


# Encoded frames held in memory while the base is still being hashed (the header, which
# names the base's fingerprints, goes first); past this, encoding waits for the hashing.
HELD_BYTES = 64 * 1024 * 1024


class _HeldWriter:
    """A PatchWriter made once the header is known; frames before that are held in memory."""

    def __init__(
        self, out: BinaryIO, make_header: Callable[[], PatchHeader], ready: Callable[[], bool]
    ) -> None:
        self._out = out
        self._make_header = make_header
        self._ready = ready  # true once make_header will not block
        self._writer: PatchWriter | None = None
        self._held: list[Callable[[PatchWriter], object]] = []  # writes to replay, in order
        self._held_bytes = 0
        self.header: PatchHeader | None = None

    def writer(self) -> PatchWriter:
        if self._writer is None:
            self.header = self._make_header()
            self._writer = PatchWriter(self._out, self.header.to_json())
            for write in self._held:
                write(self._writer)
            self._held.clear()
        return self._writer

    def _direct(self) -> PatchWriter | None:
        if self._writer is None and (self._ready() or self._held_bytes > HELD_BYTES):
            self.writer()
        return self._writer

    def begin_frame(self, index: int, nblocks: int) -> int:
        w = self._direct()
        if w is None:
            self._held.append(lambda w: w.begin_frame(index, nblocks))
        else:
            w.begin_frame(index, nblocks)
        return FRAME_HEAD.size

    def add_block(self, codec: int, payload: bytes) -> int:
        w = self._direct()
        if w is not None:
            return w.add_block(codec, payload)
        self._held.append(lambda w: w.add_block(codec, payload))
        self._held_bytes += len(payload)
        return BLOCK_HEAD.size + len(payload) + BLOCK_CHECK.size


def _write_patch(
    make_header: Callable[[], PatchHeader],
    ready: Callable[[], bool],
    items: list[Item],
    files: list[TargetFile],
    base: Source,
    target: Source,
    out: BinaryIO,
    options: DiffOptions,
    progress: Progress | None,
) -> DiffSummary:
    bb = options.block_bytes
    total = sum(f.size for f in files)
    dtypes = [
        {t.name: t.dtype for t in f.header.tensors} if f.header is not None else {} for f in files
    ]
    keys: list[tuple[int, int] | None] = [
        CONTEXT_KEYS.get(dtypes[item.file].get(item.name or "", ""))
        if options.context and item.base_file is not None
        else None
        for item in items
    ]
    pool = BufferPool(keep=3 * window_for(options.workers, bb) + 4)

    def tasks() -> Iterator[Callable[[], tuple[np.ndarray, EncodedBlock]]]:
        for index, item in enumerate(items):
            for b in range(blocks_in(item.nbytes, bb)):
                yield _encode_task(
                    item, b, bb, base, target, options.level, keys[index], options.device, pool
                )

    held = _HeldWriter(out, make_header, ready)
    results = ordered_map(tasks(), options.workers, window_for(options.workers, bb))
    try:
        return _write_frames(results, held, items, files, bb, total, target, out, pool, progress)
    finally:
        results.close()  # on an error: the workers stop before the caller closes the sources


def _write_frames(
    results: Generator[tuple[np.ndarray, EncodedBlock], None, None],
    held: _HeldWriter,
    items: list[Item],
    files: list[TargetFile],
    bb: int,
    total: int,
    target: Source,
    out: BinaryIO,
    pool: BufferPool,
    progress: Progress | None,
) -> DiffSummary:
    item_results: list[ItemResult] = []
    file_refs: list[FileRef] = []
    done = 0
    item_iter = iter(enumerate(items))
    pending = next(item_iter, None)
    for fi, tfile in enumerate(files):
        whole = new_hasher()
        # A child hashing this file while the CLI loaded (pulsectl._prehash): its fingerprints
        # are taken once the file's blocks are done, so that nothing waits for them before.
        ahead = isinstance(target, FileSource) and _prehash.expects(target.fd(fi))
        if tfile.header is not None:
            whole.update(struct.pack("<Q", len(tfile.header.raw)) + tfile.header.raw)
            done += 8 + len(tfile.header.raw)
        first_result = len(item_results)
        while pending is not None and pending[1].file == fi:
            index, item = pending
            nblocks = blocks_in(item.nbytes, bb)
            encoded = held.begin_frame(index, nblocks)
            h = new_hasher()
            changed = 0
            for _ in range(nblocks):
                data, enc = next(results)
                if not ahead:
                    update_both(h, whole, data)
                pool.give(data)
                encoded += held.add_block(enc.codec, enc.payload)
                changed += enc.changed
                done += data.size
                if progress is not None:
                    progress(done, total)
            item_results.append(ItemResult(h.hexdigest(), changed, encoded))
            pending = next(item_iter, None)
        if not ahead:
            file_refs.append(FileRef(tfile.path, tfile.size, whole.hexdigest()))
            continue
        # The child's fingerprints, or (it failed, or the file changed) a pass of our own.
        ref, fps = scan(target, fi)
        file_refs.append(ref)
        for at in range(first_result, len(item_results)):
            name = items[at].name
            fp = ref.fingerprint if name is None else fps[name]  # a blob is its whole file
            item_results[at] = replace(item_results[at], fingerprint=fp)
    writer = held.writer()
    header = held.header
    assert header is not None
    if header.scope == "tensors":
        # The frames hold only some tensors: fingerprint NEW's files whole (a second pass).
        file_refs = [scan(target, i)[0] for i in range(len(header.files))]
    target_fp = checkpoint_fingerprint(
        header.layout, ((r.path, r.size, r.fingerprint) for r in file_refs)
    )
    trailer = PatchTrailer(target_fp, tuple(file_refs), tuple(item_results), ())
    writer.finish(trailer.to_json())
    out.flush()
    return DiffSummary(
        base_fingerprint=header.base_fingerprint,
        target_fingerprint=target_fp,
        patch_bytes=writer.offset,
        target_bytes=total,
        changed_words=sum(r.changed for r in item_results),
        total_words=sum(i.nbytes // i.word for i in header.items),
        items=len(header.items),
        selected_bytes=(sum(i.nbytes for i in header.items) if header.scope == "tensors" else None),
    )


def _encode_task(
    item: Item,
    block: int,
    block_bytes: int,
    base: Source,
    target: Source,
    level: int,
    key: tuple[int, int] | None,
    device: str | None = None,
    pool: BufferPool | None = None,
) -> Callable[[], tuple[np.ndarray, EncodedBlock]]:
    offset = block * block_bytes
    size = min(block_bytes, item.nbytes - offset)

    def read(source: Source, file_index: int, at: int) -> np.ndarray:
        # Files are compared and hashed where they lie (a read-only map), except for a torch
        # device: torch warns about every read-only array it wraps.
        view = getattr(source, "view", None) if device is None else None
        mapped = None if view is None else view(file_index, at, size)
        if mapped is not None:
            return mapped
        read_into = getattr(source, "read_into", None)
        if pool is not None and read_into is not None:
            return read_into(file_index, at, pool.take(size))
        return source.read(file_index, at, size)

    def run() -> tuple[np.ndarray, EncodedBlock]:
        new = read(target, item.file, item.start + offset)
        old = None
        start = 0
        if item.base_file is not None:
            if item.base_name is not None:
                found = base.find_tensor(item.base_name)
                assert found is not None
                start = found[1].start
            old = read(base, item.base_file, start + offset)
        positions = None
        if device is not None and old is not None:
            from pulsectl.device import find_changes

            if hasattr(base, "read_device") and hasattr(target, "read_device"):
                # Live tensors: compare where they are, without a round trip through the host.
                old_d = base.read_device(item.base_file, start + offset, size)
                new_d = target.read_device(item.file, item.start + offset, size)
                positions = find_changes(old_d, new_d, item.word, device)
            else:
                positions = find_changes(old, new, item.word, device)
        encoded = encode_block(old, new, item.word, level, key, positions)
        if pool is not None:
            pool.give(old)  # the payload never refers to it
        return new, encoded

    return run


def _layout_word(layout: str) -> str:
    return "single file" if layout == "file" else "folder"
