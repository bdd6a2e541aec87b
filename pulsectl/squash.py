"""squash: one patch equivalent to a chain (the base of the first, the target of the last).

Without the base checkpoint, blocks are composed symbolically: a delta block (codec 3 or 5) is
a set of (position, move) pairs, and moves add up modulo the word size, so a word that moved +1
then -1 drops out. Stored blocks carry their bytes, and later deltas apply to them. Context blocks
(``--level max``) need the base words to find their positions, so a chain that has them is
squashed with the base given: then the chain is applied to a temporary checkpoint and the
result diffed against the base, with any codec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np

from pulsectl import __version__
from pulsectl._atomic import (
    TEMP_MARK,
    atomic_file,
    check_file_target,
    file_path,
    naming_output,
    os_error,
    refuse_inside_folder_input,
    remove,
    same_file,
    temp_prefix,
)
from pulsectl.codecs import (
    CODEC_CONTEXT,
    CODEC_COPY,
    CODEC_DELTA,
    CODEC_RICE,
    CODEC_RICE_PAIRED,
    CODEC_STORE,
    CODEC_ZSTD,
    EncodedBlock,
    decode_block,
    encode_block,
    plain_codec,
    rice,
)
from pulsectl.codecs._bits import moves_planes
from pulsectl.codecs.delta import decode_moves, encode_moves
from pulsectl.diff import DiffOptions
from pulsectl.errors import CorruptPatchError, FormatError, IntegrityError, UsageError
from pulsectl.format import (
    BLOCK_PAYLOAD_SLACK,
    Block,
    PatchReader,
    PatchWriter,
    blocks_in,
)
from pulsectl.info import PatchInfo, read_patch_info
from pulsectl.patch import Item, ItemResult, PatchHeader, PatchTrailer, chain_out_of_order

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class SquashSummary:
    patches: int
    input_bytes: int
    patch_bytes: int
    base_fingerprint: str
    target_fingerprint: str


def squash_patches(
    patches: Sequence[str | Path],
    out: str | Path | BinaryIO,
    *,
    base: str | Path | None = None,
    force: bool = False,
    options: DiffOptions | None = None,
) -> SquashSummary:
    """Write one patch equivalent to applying ``patches`` in order; ``base`` is optional.

    ``out`` is a path (written atomically) or a binary stream (e.g. stdout)."""
    with naming_output(Path(out) if isinstance(out, (str, Path)) else None):
        return _squash_patches(patches, out, base=base, force=force, options=options)


def _squash_patches(
    patches: Sequence[str | Path],
    out: str | Path | BinaryIO,
    *,
    base: str | Path | None,
    force: bool,
    options: DiffOptions | None,
) -> SquashSummary:
    if not patches:
        raise UsageError("no patch given")
    for p in patches:
        if str(p) == "-" or (os.path.exists(p) and stat.S_ISFIFO(os.stat(p).st_mode)):
            shown = "'-'" if str(p) == "-" else f"a pipe ({p})"
            raise UsageError(f"squash reads patches by seeking; give files, not {shown}")
    if isinstance(out, (str, Path)):
        # Before the patches are read; an input is refused even with -f, so it goes first.
        _refuse_an_input_as_output(file_path(out, "patch"), patches, base)
        out = check_file_target(out, force, "patch")
    infos = [read_patch_info(p, check=True) for p in patches]
    for info in infos:
        if info.header.scope == "tensors":
            raise UsageError(
                f"{info.name}: a block patch (--tensors/--exclude/--blocks); squash takes full "
                "patches; block patches of one update apply together with `apply`",
                path=info.name,
            )
    for prev, nxt in zip(infos, infos[1:], strict=False):
        if nxt.header.base_fingerprint != prev.trailer.target_fingerprint:
            raise chain_out_of_order(
                nxt.name,
                nxt.header.base_fingerprint,
                prev.name,
                prev.trailer.target_fingerprint,
                prev.header.base_fingerprint,
            )
    input_bytes = sum(i.size or 0 for i in infos)
    if base is not None:
        return _squash_with_base(patches, out, Path(base), force, options, infos, input_bytes)
    if options is not None and options.context:
        raise UsageError(
            "--level max needs --base: its codec orders each block by the base words; without "
            "the base squash can only write the default codecs (give a level 1..22)",
            option="--level",
        )
    block_bytes = {i.header.block_bytes for i in infos}
    if len(block_bytes) != 1:
        raise UsageError("the patches use different block sizes; squash them with --base")
    level = (options or DiffOptions()).level
    with contextlib.ExitStack() as stack:
        streams = [stack.enter_context(open(p, "rb")) for p in patches]
        header, trailer_items = _compose_header(infos)
        sink = atomic_file(out, force) if isinstance(out, Path) else _staged(out)
        with sink as f:
            writer = PatchWriter(f, header.to_json())
            results: list[ItemResult] = []
            for index, (item, chain) in enumerate(trailer_items):
                start = writer.offset
                nblocks = blocks_in(item.nbytes, header.block_bytes)
                writer.begin_frame(index, nblocks)
                changed = 0
                # Block by block from every patch of the chain at once (each has its own
                # stream): holding each patch's whole frame took the sum of the tensor's
                # frames over the chain (a 1 GiB tensor stored whole: 1 GB per patch).
                frames = [_frame_blocks(streams[p], infos[p], i) for p, i in chain]
                for b in range(nblocks):
                    size = min(header.block_bytes, item.nbytes - b * header.block_bytes)
                    enc = _compose_block(
                        [next(blocks) for blocks in frames],
                        item,
                        size,
                        level,
                        infos[-1].name,
                        [infos[p].name for p, _ in chain],
                    )
                    writer.add_block(enc.codec, enc.payload)
                    changed += enc.changed
                last = infos[-1].trailer.items[index]
                results.append(ItemResult(last.fingerprint, changed, writer.offset - start))
            last_trailer = infos[-1].trailer
            writer.finish(
                PatchTrailer(
                    last_trailer.target_fingerprint, last_trailer.target_files, tuple(results), ()
                ).to_json()
            )
            size = writer.offset
    return SquashSummary(
        len(patches),
        input_bytes,
        size,
        infos[0].header.base_fingerprint,
        infos[-1].trailer.target_fingerprint,
    )


def _compose_header(
    infos: list[PatchInfo],
) -> tuple[PatchHeader, list[tuple[Item, list[tuple[int, int]]]]]:
    """The squashed header, and per final item the (patch, item) frames to fold, oldest first.

    A later patch refers to an earlier patch's output by tensor name, or by path for a blob.
    """
    first, last = infos[0].header, infos[-1].header
    lookups = [
        {_key(info.header, item): i for i, item in enumerate(info.header.items)} for info in infos
    ]
    items: list[Item] = []
    chains: list[list[tuple[int, int]]] = []
    for index, item in enumerate(last.items):
        p, current = len(infos) - 1, item
        chain = [(p, index)]
        while current.base_file is not None and p > 0:
            base_path = infos[p].header.base_files[current.base_file].path
            key = ("", current.base_name) if current.base_name is not None else (base_path, None)
            found = lookups[p - 1].get(key)
            if found is None:
                raise IntegrityError(
                    f"{infos[p].name}: item {current.label!r} has no source in {infos[p - 1].name}"
                )
            p -= 1
            current = infos[p].header.items[found]
            chain.append((p, found))
        chain.reverse()
        origin = (
            current if current.base_file is not None else None
        )  # a base item of the first patch
        items.append(
            Item(
                item.file,
                item.name,
                item.start,
                item.nbytes,
                item.word,
                origin.base_file if origin else None,
                origin.base_name if origin else None,
                origin.base_fingerprint if origin else None,
            )
        )
        chains.append(chain)
    header = PatchHeader(
        layout=last.layout,
        block_bytes=last.block_bytes,
        writer=f"pulsectl {__version__}",
        base_fingerprint=first.base_fingerprint,
        base_files=first.base_files,
        files=last.files,
        items=tuple(items),
    )
    return header, list(zip(items, chains, strict=True))


def _key(header: PatchHeader, item: Item) -> tuple[str, str | None]:
    return ("", item.name) if item.name is not None else (header.files[item.file].path, None)


def _frame_blocks(stream: BinaryIO, info: PatchInfo, index: int) -> Iterator[Block]:
    """The blocks of frame ``index`` of a seekable patch, one at a time (block checksums
    verified), read where the last one ended: ``stream`` is this frame's alone meanwhile."""
    header = info.header
    item = header.items[index]
    nblocks = blocks_in(item.nbytes, header.block_bytes)
    reader = PatchReader.at_frame(stream, info.name, info.trailer.frames[index])
    reader.read_frame(index, nblocks)
    for _ in range(nblocks):
        yield reader.read_block(header.block_bytes + BLOCK_PAYLOAD_SLACK, f"tensor {item.label!r}")


def _compose_block(
    blocks: list[Block], item: Item, size: int, level: int, name: str, sources: list[str]
) -> EncodedBlock:
    """Fold one block's codecs across the chain into a single block (``sources``: the patch
    each block comes from, named in errors)."""
    word = item.word
    utype = _UINT[word]
    raw: np.ndarray | None = None  # the block's bytes, once a link stored them whole
    positions = np.empty(0, dtype=np.int64)  # else: moves relative to the origin
    moves = np.empty(0, dtype=utype)
    for block, source in zip(blocks, sources, strict=True):
        try:
            raw, positions, moves = _fold(block, item, size, source, raw, positions, moves)
        except (CorruptPatchError, FormatError) as exc:  # damaged, or a newer codec
            raise type(exc)(
                f"{source}: tensor {item.label!r}: {exc}", path=source, tensor=item.name
            ) from exc
    if raw is not None:
        # The base bytes are unknown here: a block stored whole counts every word as changed.
        return dataclasses.replace(encode_block(None, raw, word, level), changed=size // word)
    if positions.size == 0:
        if item.base_file is None:
            raise IntegrityError(f"{name}: item {item.label!r} has no base and no bytes")
        return EncodedBlock(CODEC_COPY, b"", 0)
    values = moves_planes(moves, word, level, pair=True)
    payload = encode_moves(positions, None, word, level, values=values.plain())
    best = EncodedBlock(CODEC_DELTA, payload, positions.size)
    payload = rice.encode_moves(positions, None, word, level, values=values)
    if len(payload) < len(best.payload):
        best = EncodedBlock(
            CODEC_RICE_PAIRED if values.paired else CODEC_RICE, payload, positions.size
        )
    # Without the base bytes a dense block cannot be stored whole: its delta may be a little
    # larger than the block, within what the format allows; beyond that, the base is needed.
    if len(best.payload) > size + BLOCK_PAYLOAD_SLACK:
        raise UsageError(
            f"{name}: a squashed block is too dense to code without the base; use --base"
        )
    return best


def _fold(
    block: Block,
    item: Item,
    size: int,
    name: str,
    raw: np.ndarray | None,
    positions: np.ndarray,
    moves: np.ndarray,
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """One more link of a block's chain: its bytes (once a link stored them whole), or its
    moves from the origin. ``name``: the patch ``block`` comes from."""
    word = item.word
    codec, paired = plain_codec(block.codec)
    if codec == CODEC_COPY:
        if block.payload:  # as decode_block refuses it, and apply with it
            raise CorruptPatchError("copy block carries a payload")
        return raw, positions, moves
    if codec in (CODEC_STORE, CODEC_ZSTD):
        raw = decode_block(block.codec, block.payload, None, size, word).copy()
        return raw, positions[:0], moves[:0]
    if codec == CODEC_CONTEXT:
        if raw is None:
            raise UsageError(
                f"{name}: has --level max blocks (tensor {item.label!r}), which need the base "
                "to decode; squash with --base CKPT",
                path=name,
                tensor=item.name,
            )
        return decode_block(block.codec, block.payload, raw, size, word).copy(), positions, moves
    if codec in (CODEC_DELTA, CODEC_RICE):
        if raw is not None:
            raw = decode_block(block.codec, block.payload, raw, size, word).copy()
            return raw, positions, moves
        if codec == CODEC_DELTA:
            pos, mv = decode_moves(block.payload, word, size // word)
        else:
            pos, mv = rice.decode_moves(block.payload, word, size // word, paired)
        return (raw, *_add_moves(positions, moves, pos, mv.astype(_UINT[word])))
    decode_block(block.codec, block.payload, raw, size, word)  # raises: unknown codec
    raise AssertionError(f"codec {block.codec} decoded without a rule to fold it")


def _add_moves(
    pos_a: np.ndarray, mv_a: np.ndarray, pos_b: np.ndarray, mv_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sum two sparse move sets (modulo the word size); drop words that moved back."""
    positions = np.concatenate([pos_a, pos_b])
    moves = np.concatenate([mv_a, mv_b])
    unique, inverse = np.unique(positions, return_inverse=True)
    total = np.zeros(unique.size, dtype=moves.dtype)
    np.add.at(total, inverse, moves)
    keep = total != 0
    return unique[keep], total[keep]


@contextlib.contextmanager
def _staged(out: BinaryIO) -> Iterator[BinaryIO]:
    """A stream output gets the patch only once it is whole: a refusal found while composing
    (a --level max block that needs the base) must not leave part of a patch in a pipe that
    an `aws s3 cp -` would store. Kept in memory up to 64 MiB, then in $TMPDIR."""
    with tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024) as staged:
        yield cast(BinaryIO, staged)
        staged.seek(0)
        shutil.copyfileobj(staged, out, 1024 * 1024)


def _base_changed(base: Path, want: str, got: str, output: str) -> IntegrityError:
    """BASE is read twice (the chain applied to it, then the diff against it): it changed in
    between (found in review: the patch then recorded the old fingerprint with moves against
    the new bytes, which apply refuses on either)."""
    return IntegrityError(
        f"{base}: BASE changed while squash read it (fingerprint {got}, the chain's base "
        f"{want}); the squashed patch would fit neither, so {output}",
        path=str(base),
        expected=want,
        actual=got,
    )


def _refuse_an_input_as_output(
    out: Path, patches: Sequence[str | Path], base: str | Path | None
) -> None:
    """Refuse an output that is one of the patches or the base, even with ``force``: the
    squashed patch would replace an input (as ``apply -o PATCH`` and ``diff -o NEW`` are)."""
    inputs = [(f"patch {n}", p) for n, p in enumerate(patches, 1)]
    for what, source in [*inputs, *([("BASE", base)] if base is not None else [])]:
        if same_file(out, source):
            raise UsageError(
                f"{out} is {what} of this squash; the squashed patch would replace it, even "
                "with -f: write the output elsewhere"
            )
    refuse_inside_folder_input(out, [base], "patch")


def _squash_with_base(
    patches: Sequence[str | Path],
    out: Path | BinaryIO,
    base: Path,
    force: bool,
    options: DiffOptions | None,
    infos: list,
    input_bytes: int,
) -> SquashSummary:
    from pulsectl.apply import _is_patch, apply_patches
    from pulsectl.diff import diff_checkpoints, diff_to_path

    if _is_patch(base):
        raise UsageError(
            f"--base {base}: is a .pulse patch; give the checkpoint the first patch was made "
            "from (pulsectl squash P1 P2... --base CKPT -o OUT)",
            option="--base",
        )
    # The chain's target is rebuilt beside the output (or in $TMPDIR for a stream); the
    # output's folder exists: squash_patches checked it first.
    # Beside the output it is named as its temps are (docs/GUARANTEES.md: what a kill -9
    # leaves, and how to remove it).
    near = out.parent if isinstance(out, Path) else None
    prefix = (
        temp_prefix(out.name, f"{TEMP_MARK}squash-")
        if isinstance(out, Path)
        else "pulsectl-squash-"
    )
    try:
        work = tempfile.TemporaryDirectory(prefix=prefix, dir=near)
    except OSError as exc:  # a read-only or full folder
        raise os_error(exc, out if isinstance(out, Path) else Path(tempfile.gettempdir())) from exc
    want = infos[0].header.base_fingerprint
    with work as tmp:
        target = Path(tmp) / "target"
        apply_patches(base, list(patches), target)
        if isinstance(out, Path):
            summary = diff_to_path(base, target, out, force=force, options=options)
            if summary.base_fingerprint != want:
                remove(out)
                raise _base_changed(base, want, summary.base_fingerprint, "it was removed")
        else:
            # Whole or nothing on a stream, as without --base (found in review: the diff wrote
            # to it directly, so a failure midway left part of a patch in the pipe).
            with _staged(out) as sink:
                summary = diff_checkpoints(base, target, sink, options=options)
                if summary.base_fingerprint != want:
                    raise _base_changed(base, want, summary.base_fingerprint, "nothing was written")
    return SquashSummary(
        len(patches),
        input_bytes,
        summary.patch_bytes,
        summary.base_fingerprint,
        summary.target_fingerprint,
    )
