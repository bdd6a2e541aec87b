"""PULSELoCo: sparse FP32 pseudo-gradient exchange with error feedback (docs/LOCO.md).

Each trainer runs H inner steps from the shared global weights G to its local weights L, then

    s = R + (G - L)                                   the pseudo-gradient plus the residual
    send s[i] where vis(G[i]) != vis(G[i] - s[i])     only what the receivers' cast would see
    R' = s with the sent entries set to +0.0          error feedback: nothing is lost

``vis`` is the cast to the receivers' precision (bf16, f16 or f8_e4m3, pulsectl.cast), compared
as words. The receivers average the sparse values (``reduce``) and take an outer Nesterov step
(``outer_step``).

Arithmetic is FP32 (numpy, no fused multiply-add), one IEEE operation at a time, in the order
written in each function's docstring, so results are reproducible bit for bit on any machine.

A sparse update travels as a .pulse patch (pulsectl.format): the patch from the *all-zero*
checkpoint of the same F32 tensors to the dense checkpoint holding the sent values (+0.0
elsewhere), coded with the ordinary block codecs, chosen as ``diff`` chooses them; against a zero
base, a delta codec (5 or 6 for a sparse update) stores each sent position and the value's FP32
bit pattern. A ``loco`` header field marks it (docs/FORMAT.md).
So ``pulsectl inspect`` reads it as is, and ``pulsectl apply ZEROS PATCH`` densifies it.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pulsectl import __version__
from pulsectl._atomic import (
    check_file_target,
    commit_outputs,
    file_path,
)
from pulsectl._io import pread_array
from pulsectl.cast import cast_words
from pulsectl.checkpoint import (
    HEADER_ALIGN,
    SafetensorsHeader,
    parse_header,
    read_header,
    save_safetensors,
)
from pulsectl.codecs import decode_block, encode_block
from pulsectl.errors import (
    CorruptPatchError,
    FormatError,
    InputError,
    IntegrityError,
    UsageError,
)
from pulsectl.format import (
    BLOCK_PAYLOAD_SLACK,
    DEFAULT_BLOCK_BYTES,
    MAGIC,
    PatchReader,
    PatchWriter,
    blocks_in,
)
from pulsectl.hashing import fingerprint_bytes, new_hasher, update_both
from pulsectl.patch import (
    FileRef,
    Item,
    ItemResult,
    PatchHeader,
    PatchTrailer,
    TargetFile,
    header_from_json,
    trailer_from_json,
)

LOCO_VERSION = 1  # version of the ``loco`` header field
KIND_PSEUDO_GRADIENT = "pseudo-gradient"  # one trainer's sent values (``encode``)
KIND_AVERAGE = "average"  # the mean over trainers (``reduce``)
KINDS = (KIND_PSEUDO_GRADIENT, KIND_AVERAGE)
VISIBLE = ("bf16", "f16", "f8_e4m3")
"""Receiver precisions the gate can compare in (names as in pulsectl.cast.TARGETS)."""

DEFAULT_VISIBLE = "bf16"
DEFAULT_LR = 0.7  # outer learning rate (DiLoCo)
DEFAULT_BETA = 0.9  # outer Nesterov momentum (DiLoCo)
DEFAULT_LEVEL = 3  # zstd level of the codec planes

_F32 = "F32"
_ZERO_CHUNK = 16 * 1024 * 1024

Tensors = dict[str, np.ndarray]
"""Named float32 arrays (any shape)."""


@dataclass(frozen=True)
class SparseUpdate:
    """FP32 values at some flat positions of named tensors; +0.0 everywhere else."""

    shapes: dict[str, tuple[int, ...]]  # every tensor, by name
    positions: dict[str, np.ndarray]  # int64 flat indices, strictly ascending
    values: dict[str, np.ndarray]  # float32, one per position, never the word of +0.0
    kind: str = KIND_PSEUDO_GRADIENT
    trainers: int = 1  # how many pseudo-gradients were averaged
    visible: str | None = DEFAULT_VISIBLE  # the gate's precision (None: mixed)

    @property
    def sent(self) -> int:
        return sum(int(p.size) for p in self.positions.values())

    @property
    def total(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    @property
    def density(self) -> float:
        return self.sent / self.total if self.total else 0.0

    def dense(self) -> Tensors:
        """Every tensor as a float32 array: the values at their positions, +0.0 elsewhere."""
        out: Tensors = {}
        for name, shape in self.shapes.items():
            flat = np.zeros(math.prod(shape), dtype=np.float32)
            flat[self.positions[name]] = self.values[name]
            out[name] = flat.reshape(shape)
        return out

    @classmethod
    def from_dense(
        cls,
        tensors: Mapping[str, np.ndarray],
        *,
        kind: str = KIND_PSEUDO_GRADIENT,
        trainers: int = 1,
        visible: str | None = DEFAULT_VISIBLE,
    ) -> SparseUpdate:
        """Keep the entries whose FP32 word is not +0.0 (exactly what a patch stores)."""
        shapes, positions, values = {}, {}, {}
        for name in sorted(tensors):
            flat = _f32(tensors[name], name).reshape(-1)
            pos = np.flatnonzero(flat.view(np.uint32))
            shapes[name] = tuple(int(d) for d in np.shape(tensors[name]))
            positions[name] = pos
            values[name] = flat[pos]
        return cls(shapes, positions, values, kind, trainers, visible)


# ---------------------------------------------------------------------------------------------
# The arithmetic


def visible_words(x: np.ndarray, visible: str = DEFAULT_VISIBLE) -> np.ndarray:
    """The words of ``x`` (float32) cast to the receivers' precision, round to nearest even."""
    if visible not in VISIBLE:
        raise UsageError(
            f"--visible {visible!r}: choose one of {', '.join(VISIBLE)}", option="--visible"
        )
    return cast_words(np.ascontiguousarray(x, dtype=np.float32), _F32, visible)


def encode(
    global_: Mapping[str, np.ndarray],
    local: Mapping[str, np.ndarray],
    residual: Mapping[str, np.ndarray] | None = None,
    *,
    visible: str = DEFAULT_VISIBLE,
) -> tuple[SparseUpdate, Tensors]:
    """One trainer's sparse pseudo-gradient and its new residual.

    Per element, in FP32: ``d = G - L``; ``s = R + d``; ``w = G - s``; sent where
    ``vis(G) != vis(w)`` (words), with value ``s``; the new residual is ``s`` with the sent
    entries set to +0.0. A missing residual is all +0.0. So, bitwise, the sent value where sent
    and the new residual elsewhere make up ``s``.
    """
    _check_same(global_, local, "global", "local")
    if residual is not None:
        _check_same(global_, residual, "global", "residual")
    shapes, positions, values = {}, {}, {}
    new_residual: Tensors = {}
    for name in sorted(global_):
        g = _f32(global_[name], name).reshape(-1)
        lo = _f32(local[name], name).reshape(-1)
        r = np.zeros_like(g) if residual is None else _f32(residual[name], name).reshape(-1)
        with np.errstate(all="ignore"):
            s = np.add(r, np.subtract(g, lo))
            w = np.subtract(g, s)
        pos = np.flatnonzero(visible_words(g, visible) != visible_words(w, visible))
        shape = tuple(int(d) for d in np.shape(global_[name]))
        shapes[name], positions[name], values[name] = shape, pos, s[pos]
        s[pos] = 0.0
        new_residual[name] = s.reshape(shape)
    return SparseUpdate(shapes, positions, values, KIND_PSEUDO_GRADIENT, 1, visible), new_residual


def reduce(updates: Sequence[SparseUpdate]) -> SparseUpdate:
    """The mean of the trainers' updates, as a sparse update.

    Per element, in FP32: ``acc = +0.0``, then ``acc = acc + v_k`` for each update ``k`` in the
    given order that sent this element, then ``acc / K`` with ``K = len(updates)``. Entries whose
    mean is +0.0 are dropped (the dense result is the same).
    """
    if not updates:
        raise UsageError("reduce needs at least one pseudo-gradient")
    first = updates[0]
    for k, u in enumerate(updates):
        if u.kind != KIND_PSEUDO_GRADIENT:
            raise UsageError(
                f"update {k + 1} is a loco {u.kind!r}, not a pseudo-gradient; reduce the "
                "trainers' patches from `pulsectl loco encode`"
            )
        if u.shapes != first.shapes:
            raise UsageError(
                f"update {k + 1} has other tensors than update 1 "
                f"({_first_difference(first.shapes, u.shapes)}); all trainers must share one model"
            )
    count = np.float32(len(updates))
    shapes, positions, values = {}, {}, {}
    for name, shape in first.shapes.items():
        acc = np.zeros(math.prod(shape), dtype=np.float32)
        with np.errstate(all="ignore"):
            for u in updates:
                pos = u.positions[name]
                acc[pos] = acc[pos] + u.values[name]  # positions are unique within an update
            np.divide(acc, count, out=acc)
        pos = np.flatnonzero(acc.view(np.uint32))
        shapes[name], positions[name], values[name] = shape, pos, acc[pos]
    seen = {u.visible for u in updates}
    visible = seen.pop() if len(seen) == 1 else None
    return SparseUpdate(shapes, positions, values, KIND_AVERAGE, len(updates), visible)


def outer_step(
    global_: Mapping[str, np.ndarray],
    update: Mapping[str, np.ndarray] | SparseUpdate,
    momentum: Mapping[str, np.ndarray] | None = None,
    *,
    lr: float = DEFAULT_LR,
    beta: float = DEFAULT_BETA,
    plain: bool = False,
) -> tuple[Tensors, Tensors | None]:
    """The outer step: new global weights and new momentum buffer (None with ``plain``).

    ``u`` is the averaged pseudo-gradient; ``lr`` and ``beta`` are rounded to FP32 first. Per
    element, in FP32, as torch's SGD(nesterov=True, dampening=0) with separate roundings:
    ``m' = beta * m + u`` (``m' = u`` when there is no buffer yet, as torch starts it),
    ``d = u + beta * m'``, ``G' = G - lr * d``. ``plain``: ``G' = G - u`` (averaging), no buffer.
    """
    lr32, beta32 = check_outer(lr, beta)
    dense = update.dense() if isinstance(update, SparseUpdate) else dict(update)
    _check_same(global_, dense, "global", "update")
    if momentum is not None and not plain:
        _check_same(global_, momentum, "global", "momentum")
    new_global: Tensors = {}
    new_momentum: Tensors = {}
    with np.errstate(all="ignore"):
        for name in sorted(global_):
            g = _f32(global_[name], name)
            u = _f32(dense[name], name).reshape(g.shape)
            if plain:
                new_global[name] = np.subtract(g, u)
                continue
            if momentum is None:
                m = u.copy()
            else:
                m = np.add(np.multiply(beta32, _f32(momentum[name], name).reshape(g.shape)), u)
            d = np.add(u, np.multiply(beta32, m))
            new_global[name] = np.subtract(g, np.multiply(lr32, d))
            new_momentum[name] = m
    return new_global, None if plain else new_momentum


def check_outer(lr: float, beta: float) -> tuple[np.float32, np.float32]:
    """``lr`` and ``beta`` rounded to FP32, as the outer step uses them; refuse (UsageError)
    a learning rate that is not finite and > 0, or a momentum outside [0, 1) (Nesterov SGD:
    a momentum of 1 or more never forgets an update, a negative one flips them), also when
    only its FP32 rounding is out of range (1e-50 is 0, 0.99999999999 is 1)."""
    with np.errstate(all="ignore"):
        lr32, beta32 = np.float32(lr), np.float32(beta)
    for option, value, value32, ok, what in (
        ("--lr", lr, lr32, lr32 > 0 and np.isfinite(lr32), "learning rate must be finite and > 0"),
        ("--beta", beta, beta32, 0 <= beta32 < 1, "momentum must be in [0, 1)"),
    ):
        if not ok:
            shown, shown32 = _number(float(value)), _number(float(value32))
            rounded = f" (it is {shown32} in FP32)" if shown32 != shown else ""
            raise UsageError(f"{option} {shown}: the outer {what}{rounded}", option=option)
    return lr32, beta32


def _number(x: float) -> str:
    """A float as typed: shortest round-trip digits, without a trailing '.0'."""
    text = repr(x)
    return text[:-2] if text.endswith(".0") else text


# ---------------------------------------------------------------------------------------------
# Sparse updates as .pulse patches


def dumps(update: SparseUpdate, *, level: int = DEFAULT_LEVEL) -> bytes:
    """The update as .pulse patch bytes (deterministic: same update, same bytes)."""
    buf = io.BytesIO()
    write_update(update, buf, level=level)
    return buf.getvalue()


def write_update(
    update: SparseUpdate,
    out: BinaryIO,
    *,
    level: int = DEFAULT_LEVEL,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> int:
    """Stream the update to ``out`` as a .pulse patch; returns the bytes written."""
    st = _target_header(update.shapes)
    prefix = struct.pack("<Q", len(st.raw)) + st.raw
    zeros_fp = _zeros_file_fingerprint(st)
    items = tuple(
        Item(0, t.name, t.start, t.nbytes, 4, 0, t.name, _zeros_fingerprint(t.nbytes))
        for t in st.tensors
    )
    header = PatchHeader(
        layout="file",
        block_bytes=block_bytes,
        writer=f"pulsectl {__version__}",
        base_fingerprint=zeros_fp,
        base_files=(FileRef("", st.file_size, zeros_fp),),
        files=(TargetFile("", "safetensors", st.file_size, st),),
        items=items,
    )
    doc = header.to_json()
    doc["loco"] = {
        "version": LOCO_VERSION,
        "kind": update.kind,
        "trainers": update.trainers,
        "visible": update.visible,
    }
    writer = PatchWriter(out, doc)
    whole = new_hasher()
    whole.update(prefix)
    words_per_block = block_bytes // 4
    zeros = np.zeros(min(block_bytes, max((t.nbytes for t in st.tensors), default=0)), np.uint8)
    results = []
    for index, t in enumerate(st.tensors):
        pos = update.positions[t.name]
        bits = update.values[t.name].view(np.uint32)
        nblocks = blocks_in(t.nbytes, block_bytes)
        start = writer.offset
        writer.begin_frame(index, nblocks)
        h = new_hasher()
        changed = 0
        for b in range(nblocks):
            w0 = b * words_per_block
            w1 = min(w0 + words_per_block, t.nbytes // 4)
            lo, hi = np.searchsorted(pos, [w0, w1])
            words = np.zeros(w1 - w0, dtype="<u4")
            words[pos[lo:hi] - w0] = bits[lo:hi]
            new = words.view(np.uint8)
            enc = encode_block(zeros[: new.size], new, 4, level)
            writer.add_block(enc.codec, enc.payload)
            update_both(h, whole, new.data)
            changed += enc.changed
        results.append(ItemResult(h.hexdigest(), changed, writer.offset - start))
    target_fp = whole.hexdigest()
    trailer = PatchTrailer(target_fp, (FileRef("", st.file_size, target_fp),), tuple(results), ())
    writer.finish(trailer.to_json())
    return writer.offset


def loads(data: bytes) -> SparseUpdate:
    """Read an update from .pulse patch bytes."""
    return read_update(io.BytesIO(data), "<bytes>")


def read_update(source: str | Path | BinaryIO, name: str | None = None) -> SparseUpdate:
    """Read and verify a loco patch (a file path or a binary stream), checksums included."""
    if isinstance(source, (str, Path)):
        try:
            with open(source, "rb") as f:
                return read_update(f, str(source))
        except OSError as exc:
            raise InputError(f"{source}: cannot read: {exc.strerror}", path=source) from exc
    name = name or getattr(source, "name", "<stream>")
    reader = PatchReader(source, str(name))
    header = header_from_json(reader.header, reader.name)
    loco = _loco_field(reader.header, reader.name)
    st = _check_zero_base(header, reader.name)
    shapes: dict[str, tuple[int, ...]] = {}
    positions: dict[str, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    item_fps = []
    whole = new_hasher()
    whole.update(struct.pack("<Q", len(st.raw)) + st.raw)
    bb = header.block_bytes
    words_per_block = bb // 4
    for index, (item, t) in enumerate(zip(header.items, st.tensors, strict=True)):
        nblocks = blocks_in(item.nbytes, bb)
        reader.read_frame(index, nblocks)
        h = new_hasher()
        pos_parts, val_parts = [], []
        for b in range(nblocks):
            size = min(bb, item.nbytes - b * bb)
            block = reader.read_block(bb + BLOCK_PAYLOAD_SLACK, f"tensor {t.name!r} block {b}")
            try:
                data = decode_block(block.codec, block.payload, np.zeros(size, np.uint8), size, 4)
            except (CorruptPatchError, FormatError) as exc:  # damaged, or a newer codec
                raise type(exc)(
                    f"{reader.name}: tensor {t.name!r}: {exc}", path=reader.name, tensor=t.name
                ) from exc
            update_both(h, whole, data.data)
            words = data.view("<u4")
            nz = np.flatnonzero(words)
            pos_parts.append(nz + b * words_per_block)
            val_parts.append(words[nz].astype(np.uint32).view(np.float32))
        item_fps.append(h.hexdigest())
        shapes[t.name] = t.shape
        positions[t.name] = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
        values[t.name] = np.concatenate(val_parts) if val_parts else np.zeros(0, np.float32)
    _check_zero_fingerprints(header, st, reader.name)
    trailer = trailer_from_json(reader.read_trailer(), header, reader.name)
    for t, want, got in zip(st.tensors, trailer.items, item_fps, strict=True):
        if want.fingerprint != got:
            raise IntegrityError(
                f"{reader.name}: tensor {t.name!r} decodes to fingerprint {got}, the patch says "
                f"{want.fingerprint}",
                path=reader.name,
                tensor=t.name,
                expected=want.fingerprint,
                actual=got,
            )
    if whole.hexdigest() != trailer.target_fingerprint:
        raise IntegrityError(
            f"{reader.name}: decoded values have fingerprint {whole.hexdigest()}, the patch says "
            f"{trailer.target_fingerprint}",
            path=reader.name,
            expected=trailer.target_fingerprint,
            actual=whole.hexdigest(),
        )
    return SparseUpdate(shapes, positions, values, loco["kind"], loco["trainers"], loco["visible"])


def is_patch(path: str | Path) -> bool:
    """Whether ``path`` starts with the .pulse magic (else it is taken for safetensors)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}", path=path) from exc


# ---------------------------------------------------------------------------------------------
# Files: what the `pulsectl loco` commands call


@dataclass(frozen=True)
class EncodeSummary:
    sent: int
    total: int
    patch_bytes: int
    residual_created: bool  # the residual file did not exist and started as zeros

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "total": self.total,
            "density": self.sent / self.total if self.total else 0.0,
            "patch_bytes": self.patch_bytes,
            "dense_bytes": 4 * self.total,
            "residual_created": self.residual_created,
        }


@dataclass(frozen=True)
class ReduceSummary:
    trainers: int
    sent: int
    total: int
    output_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "trainers": self.trainers,
            "nonzero": self.sent,
            "total": self.total,
            "density": self.sent / self.total if self.total else 0.0,
            "output_bytes": self.output_bytes,
        }


def load_tensors(path: str | Path) -> tuple[Tensors, dict[str, str] | None]:
    """The F32 tensors of a safetensors file (InputError naming any other dtype) and metadata."""
    path = Path(path)
    st = read_header(path)
    out: Tensors = {}
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror}", path=path) from exc
    try:
        for t in st.tensors:
            if t.dtype != _F32:
                raise InputError(
                    f"{path}: tensor {t.name!r} is {t.dtype}; loco works on F32 tensors (the "
                    "FP32 master weights); save them in float32",
                    path=path,
                    tensor=t.name,
                )
            data = pread_array(fd, t.start, t.nbytes, str(path))
            out[t.name] = data.view("<f4").astype(np.float32, copy=False).reshape(t.shape)
    finally:
        os.close(fd)
    return out, st.metadata


def encode_files(
    global_path: str | Path,
    local_path: str | Path,
    residual_path: str | Path,
    out: str | Path,
    *,
    visible: str = DEFAULT_VISIBLE,
    force: bool = False,
    level: int = DEFAULT_LEVEL,
) -> EncodeSummary:
    """Write the sparse pseudo-gradient to ``out`` and update ``residual_path``.

    Both outputs are written in full to temporary files first; only then is ``out`` moved into
    place and, right after, the residual. Any failure before that leaves both untouched.
    """
    out, residual_path = file_path(out), file_path(residual_path, "residual")
    visible_words(np.zeros(0, np.float32), visible)  # reject a bad --visible before any work
    _check_distinct(
        [
            ("--global", Path(global_path), False),
            ("--local", Path(local_path), False),
            ("--residual", residual_path, True),
            ("-o", out, True),
        ]
    )
    check_file_target(out, force)
    check_file_target(residual_path, True, "residual")
    global_, _ = load_tensors(global_path)
    local, _ = load_tensors(local_path)
    created = not residual_path.exists()
    residual = None if created else load_tensors(residual_path)[0]
    update, new_residual = encode(global_, local, residual, visible=visible)
    data = dumps(update, level=level)
    commit_outputs([(out, lambda p: _write_bytes(p, data)), (residual_path, _saver(new_residual))])
    return EncodeSummary(update.sent, update.total, len(data), created)


def reduce_files(
    patches: Sequence[str | Path],
    out: str | Path,
    *,
    dense: bool = False,
    force: bool = False,
    level: int = DEFAULT_LEVEL,
) -> ReduceSummary:
    """Average the trainers' loco patches into a loco patch, or (``dense``) a safetensors file."""
    out, paths = file_path(out), [Path(p) for p in patches]
    _check_once(paths)
    _check_distinct(
        [(f"patch {k + 1}", p, False) for k, p in enumerate(paths)] + [("-o", out, True)]
    )
    check_file_target(out, force)
    updates = [read_update(p) for p in patches]
    avg = reduce(updates)
    if dense:
        commit_outputs([(out, _saver(avg.dense()))])
    else:
        data = dumps(avg, level=level)
        commit_outputs([(out, lambda p: _write_bytes(p, data))])
    return ReduceSummary(len(updates), avg.sent, avg.total, out.stat().st_size)


def step_files(
    global_path: str | Path,
    update_path: str | Path,
    out: str | Path,
    *,
    momentum_path: str | Path | None = None,
    lr: float = DEFAULT_LR,
    beta: float = DEFAULT_BETA,
    plain: bool = False,
    force: bool = False,
) -> None:
    """Write the new global weights to ``out`` and update the momentum file (unless ``plain``).

    ``update_path`` is a loco patch or a safetensors file of F32 tensors. A missing momentum
    file starts as torch does (the first buffer is the update itself).
    """
    # The values given first, then the choice between --momentum and --plain (as the parser
    # judges the options given before the ones missing); all before any file is read.
    check_outer(lr, beta)
    out = file_path(out)
    if plain and momentum_path is not None:
        raise UsageError(
            "--plain averages without momentum; do not give --momentum", option="--plain"
        )
    if not plain and momentum_path is None:
        raise UsageError(
            "give --momentum FILE (created if missing), or --plain", option="--momentum"
        )
    momentum_path = None if momentum_path is None else file_path(momentum_path, "momentum")
    roles = [("--global", Path(global_path), False), ("--update", Path(update_path), False)]
    if momentum_path is not None:
        roles.append(("--momentum", momentum_path, True))
    _check_distinct([*roles, ("-o", out, True)])
    check_file_target(out, force)
    if momentum_path is not None:
        check_file_target(momentum_path, True, "momentum")
    global_, metadata = load_tensors(global_path)
    update: Tensors | SparseUpdate
    update = read_update(update_path) if is_patch(update_path) else load_tensors(update_path)[0]
    momentum = None
    if momentum_path is not None and momentum_path.exists():
        momentum = load_tensors(momentum_path)[0]
    new_global, new_momentum = outer_step(global_, update, momentum, lr=lr, beta=beta, plain=plain)
    writes = [(out, _saver(new_global, metadata))]
    if new_momentum is not None and momentum_path is not None:
        writes.append((momentum_path, _saver(new_momentum)))
    commit_outputs(writes)


# ---------------------------------------------------------------------------------------------
# Helpers


_FileId = tuple[Path | None, tuple[int, int] | None]


def _file_id(path: Path) -> _FileId:
    """What makes two paths one file: the path once resolved (symlinks followed, also for a
    file that does not exist yet) and, for an existing file, its device and inode (a hard
    link), which is what os.path.samefile compares."""
    try:
        resolved: Path | None = path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        resolved = None
    try:
        st = os.stat(path)
    except OSError:  # does not exist (yet), or cannot be reached: the resolved path decides
        return resolved, None
    return resolved, (st.st_dev, st.st_ino)


def _same_file(a: _FileId, b: _FileId) -> bool:
    return (a[0] is not None and a[0] == b[0]) or (a[1] is not None and a[1] == b[1])


def _check_distinct(roles: Sequence[tuple[str, Path, bool]]) -> None:
    """Refuse, before anything is read or written, a file written in one role that is the file
    of another role: ``roles`` are (option, path, written).

    The residual and the momentum are read and rewritten (state carried from round to round),
    so each is one role, written, and its own input; any other pair in which one is written is
    an error: the output would replace an input (``--residual G``), or one output the other
    (``-o R --residual R`` loses the patch)."""
    ids = [_file_id(path) for _, path, _ in roles]
    for j, (wname, wpath, written) in enumerate(roles):
        if not written:
            continue
        for i, (oname, opath, _) in enumerate(roles):
            if i == j or (i > j and roles[i][2]):  # a pair of outputs: reported once
                continue
            if _same_file(ids[i], ids[j]):
                raise UsageError(
                    f"{wname} {wpath} is the same file as {oname} {opath}: writing {wname} "
                    f"would replace it; give {wname} a file of its own"
                )


def _check_once(patches: Sequence[Path]) -> None:
    """Refuse a patch file given twice to reduce (by path, symlink or hard link); equal bytes
    in two files are not looked for (two trainers may send the same values)."""
    ids = [_file_id(path) for path in patches]
    for k, path in enumerate(patches):
        for first in range(k):
            if _same_file(ids[first], ids[k]):
                raise UsageError(
                    f"patch {k + 1} {path} is the same file as patch {first + 1} "
                    f"{patches[first]}: the same update twice would count one trainer twice; "
                    "give each trainer's patch once"
                )


def _f32(x: np.ndarray, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise InputError(f"tensor {name!r} is {a.dtype}; loco works on float32", tensor=name)
    return a


def _check_same(
    ref: Mapping[str, np.ndarray], other: Mapping[str, np.ndarray], ref_label: str, label: str
) -> None:
    a = {k: tuple(np.shape(v)) for k, v in ref.items()}
    b = {k: tuple(np.shape(v)) for k, v in other.items()}
    if a != b:
        raise InputError(
            f"{label} does not match {ref_label}: {_first_difference(a, b)}; "
            "both must hold the same tensors with the same shapes"
        )


def _first_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    for name in sorted(set(a) | set(b)):
        if name not in b:
            return f"tensor {name!r} is missing"
        if name not in a:
            return f"tensor {name!r} is extra"
        if a[name] != b[name]:
            return f"tensor {name!r} has shape {list(b[name])}, expected {list(a[name])}"
    return "no difference"


def _target_header(shapes: Mapping[str, tuple[int, ...]]) -> SafetensorsHeader:
    """The safetensors header ``save_safetensors`` writes for F32 tensors of these shapes."""
    doc: dict[str, Any] = {}
    offset = 0
    for name in sorted(shapes):
        nbytes = 4 * math.prod(shapes[name])
        doc[name] = {
            "dtype": _F32,
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % HEADER_ALIGN)
    return parse_header(raw, 8 + len(raw) + offset, "<loco update>")


def _hash_zeros(hasher: Any, nbytes: int) -> None:
    zeros = memoryview(bytes(min(nbytes, _ZERO_CHUNK)))
    while nbytes:
        n = min(nbytes, len(zeros))
        hasher.update(zeros[:n])
        nbytes -= n


_ZEROS_FP: dict[int, str] = {}


def _zeros_fingerprint(nbytes: int) -> str:
    if nbytes not in _ZEROS_FP:
        if nbytes <= _ZERO_CHUNK:
            _ZEROS_FP[nbytes] = fingerprint_bytes(bytes(nbytes))
        else:
            h = new_hasher()
            _hash_zeros(h, nbytes)
            _ZEROS_FP[nbytes] = h.hexdigest()
    return _ZEROS_FP[nbytes]


def _zeros_file_fingerprint(st: SafetensorsHeader) -> str:
    """Fingerprint of the safetensors file with this header and all-zero data."""
    h = new_hasher()
    h.update(struct.pack("<Q", len(st.raw)) + st.raw)
    _hash_zeros(h, st.file_size - st.data_start)
    return h.hexdigest()


def _loco_field(doc: Mapping[str, Any], name: str) -> dict[str, Any]:
    loco = doc.get("loco")
    if loco is None:
        raise InputError(
            f"{name}: not a PULSELoCo patch (its header has no 'loco' field); give patches "
            "written by `pulsectl loco encode` or `pulsectl loco reduce`",
            path=name,
        )
    ok = (
        isinstance(loco, dict)
        and loco.get("version") == LOCO_VERSION
        and loco.get("kind") in KINDS
        and isinstance(loco.get("trainers"), int)
        and not isinstance(loco.get("trainers"), bool)
        and loco["trainers"] >= 1
        and "visible" in loco  # null when the averaged updates used different gates
        and (loco["visible"] is None or loco["visible"] in VISIBLE)
    )
    if not ok:
        raise CorruptPatchError(
            f"{name}: the 'loco' header field is not valid (version {LOCO_VERSION} expected)",
            path=name,
        )
    return dict(loco)


def _check_zero_base(header: PatchHeader, name: str) -> SafetensorsHeader:
    """A loco patch is one F32 safetensors file patched from its all-zero twin: its layout.

    The base fingerprints are checked by ``_check_zero_fingerprints`` once the frames have
    been read: they take hashing as many zeros as the header claims, and a damaged header can
    claim any size (a 1 KB file claiming 256 GiB took 7 s to refuse), whereas its frames must
    then hold that many blocks."""
    st = header.files[0].header if header.layout == "file" else None
    if st is None:
        raise CorruptPatchError(f"{name}: a loco patch holds one safetensors file", path=name)
    for item, t in zip(header.items, st.tensors, strict=True):
        if t.dtype != _F32:
            raise CorruptPatchError(
                f"{name}: tensor {t.name!r} is {t.dtype}; a loco patch holds F32 only", path=name
            )
        if item.base_name != t.name:
            raise _not_from_zeros(name, t.name)
    return st


def _check_zero_fingerprints(header: PatchHeader, st: SafetensorsHeader, name: str) -> None:
    for item, t in zip(header.items, st.tensors, strict=True):
        if item.base_fingerprint != _zeros_fingerprint(t.nbytes):
            raise _not_from_zeros(name, t.name)
    zeros_fp = _zeros_file_fingerprint(st)
    if header.base_fingerprint != zeros_fp or [f.fingerprint for f in header.base_files] != [
        zeros_fp
    ]:
        raise CorruptPatchError(
            f"{name}: the base is not the all-zero checkpoint; not a loco patch", path=name
        )


def _not_from_zeros(name: str, tensor: str) -> CorruptPatchError:
    return CorruptPatchError(
        f"{name}: tensor {tensor!r} is not patched from zeros; not a loco patch",
        path=name,
        tensor=tensor,
    )


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _saver(tensors: Tensors, metadata: dict[str, str] | None = None) -> Any:
    def save(path: Path) -> None:
        save_safetensors(path, {n: (_F32, a.shape, a) for n, a in tensors.items()}, metadata)

    return save
