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

import contextlib
import io
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pulsectl import __version__
from pulsectl._atomic import (
    check_file_target,
    commit_together,
    file_path,
    os_error,
)
from pulsectl._io import pread_array
from pulsectl.cast import cast_words
from pulsectl.checkpoint import (
    HEADER_ALIGN,
    SafetensorsHeader,
    build_header,
    parse_header,
    read_header,
)
from pulsectl.codecs import decode_block, encode_block
from pulsectl.errors import (
    CorruptPatchError,
    FormatError,
    InputError,
    IntegrityError,
    UsageError,
    open_files_hint,
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
_RUN = 4 * 1024 * 1024  # elements the file commands work on at a time (16 MiB of FP32)

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
        r = None if residual is None else _f32(residual[name], name).reshape(-1)
        pos, sent, s = _encode_run(g, lo, r, visible)
        shape = tuple(int(d) for d in np.shape(global_[name]))
        shapes[name], positions[name], values[name] = shape, pos, sent
        new_residual[name] = s.reshape(shape)
    return SparseUpdate(shapes, positions, values, KIND_PSEUDO_GRADIENT, 1, visible), new_residual


def _encode_run(
    g: np.ndarray, lo: np.ndarray, r: np.ndarray | None, visible: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``encode`` on a run of elements (flat float32): the sent positions within the run, their
    values, and the new residual of the run (a new array)."""
    if r is None:
        r = np.zeros_like(g)
    with np.errstate(all="ignore"):
        s = _ieee(np.add, r, _ieee(np.subtract, g, lo))
        w = _ieee(np.subtract, g, s)
    pos = np.flatnonzero(visible_words(g, visible) != visible_words(w, visible))
    sent = s[pos]
    s[pos] = 0.0
    return pos, sent, s


def reduce(updates: Sequence[SparseUpdate]) -> SparseUpdate:
    """The mean of the trainers' updates, as a sparse update.

    Per element, in FP32: ``acc = +0.0``, then ``acc = acc + v_k`` for each update ``k`` in the
    given order that sent this element, then ``acc / K`` with ``K = len(updates)``. Entries whose
    mean is +0.0 are dropped (the dense result is the same).
    """
    visible = _reducible(updates)
    first = updates[0]
    shapes, positions, values = {}, {}, {}
    for name, shape in first.shapes.items():
        parts = [(u.positions[name], u.values[name]) for u in updates]
        acc = _mean(parts, math.prod(shape))
        shapes[name] = shape
        positions[name], values[name] = _sparse(acc)
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
    for name in sorted(global_):
        g = _f32(global_[name], name)
        u = _f32(dense[name], name).reshape(-1)
        m = None if momentum is None or plain else _f32(momentum[name], name).reshape(-1)
        g2, m2 = _step_run(g.reshape(-1), u, m, lr32, beta32, plain)
        new_global[name] = g2.reshape(g.shape)
        if m2 is not None:
            new_momentum[name] = m2.reshape(g.shape)
    return new_global, None if plain else new_momentum


_QUIET = np.uint32(0x00400000)  # the quiet bit of an FP32 NaN


def _ieee(op: np.ufunc, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``op(x, y)`` on flat FP32 arrays, with one rule where IEEE 754 leaves a choice: when both
    operands are NaN, the result is the first one's NaN, quieted. numpy's loops return either
    operand's, by the array's length and the machine (found in review: a run streamed from a
    file and the same elements in a whole tensor gave different NaN words)."""
    z = op(x, y)
    if np.isnan(np.sum(z)):  # any NaN (or an overflowing sum): rare in weights, then look
        both = np.isnan(x) & np.isnan(y)
        if both.any():
            z[both] = (x[both].view(np.uint32) | _QUIET).view(np.float32)
    return z


def _step_run(
    g: np.ndarray,
    u: np.ndarray,
    m: np.ndarray | None,
    lr32: np.float32,
    beta32: np.float32,
    plain: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``outer_step`` on a run of elements: the new weights and momentum (None if ``plain``)."""
    with np.errstate(all="ignore"):
        if plain:
            return _ieee(np.subtract, g, u), None
        m2 = u.copy() if m is None else _ieee(np.add, np.multiply(beta32, m), u)
        d = _ieee(np.add, u, np.multiply(beta32, m2))
        return _ieee(np.subtract, g, np.multiply(lr32, d)), m2


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
    runs = ((update.positions[n], update.values[n]) for n in sorted(update.shapes))
    return _write_patch(
        out,
        update.shapes,
        _loco_doc(update.kind, update.trainers, update.visible),
        runs,
        level=level,
        block_bytes=block_bytes,
    )


def _loco_doc(kind: str, trainers: int, visible: str | None) -> dict[str, Any]:
    return {"version": LOCO_VERSION, "kind": kind, "trainers": trainers, "visible": visible}


def _write_patch(
    out: BinaryIO,
    shapes: Mapping[str, tuple[int, ...]],
    loco: dict[str, Any],
    tensors: Iterator[tuple[np.ndarray, np.ndarray]],
    *,
    level: int = DEFAULT_LEVEL,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> int:
    """Write the loco patch of F32 tensors of ``shapes``; ``tensors`` yields each one's sent
    positions and values as it is reached, in name order (the file's), so only one tensor's
    are held at a time. Returns the bytes written."""
    st = _target_header(shapes)
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
    doc["loco"] = loco
    writer = PatchWriter(out, doc)
    whole = new_hasher()
    whole.update(prefix)
    words_per_block = block_bytes // 4
    zeros = np.zeros(min(block_bytes, max((t.nbytes for t in st.tensors), default=0)), np.uint8)
    results = []
    for index, t in enumerate(st.tensors):
        pos, values = next(tensors)
        bits = values.view(np.uint32)
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
    stream = _UpdateStream(source, str(name or getattr(source, "name", "<stream>")))
    positions: dict[str, np.ndarray] = {}
    values: dict[str, np.ndarray] = {}
    for tensor in stream.shapes:
        positions[tensor], values[tensor] = stream.next_tensor()
    stream.finish()
    return SparseUpdate(
        stream.shapes, positions, values, stream.kind, stream.trainers, stream.visible
    )


class _UpdateStream:
    """A loco patch read one tensor at a time: ``shapes`` (in file order, by name) and the
    ``loco`` field from its header, then ``next_tensor`` for each tensor in turn, then
    ``finish``, which checks the fingerprints and the file checksum. Nothing it returned is to
    be trusted (or written where it would be kept) before ``finish`` returns."""

    def __init__(self, source: BinaryIO, name: str) -> None:
        self._reader = PatchReader(source, str(name))
        self.name = self._reader.name
        self._header = header_from_json(self._reader.header, self.name)
        loco = _loco_field(self._reader.header, self.name)
        self.kind: str = loco["kind"]
        self.trainers: int = loco["trainers"]
        self.visible: str | None = loco["visible"]
        self._st = _check_zero_base(self._header, self.name)
        names = [t.name for t in self._st.tensors]
        if names != sorted(names):
            # FORMAT.md: laid out as save_safetensors lays them out, by name. The commands read
            # the patches of several trainers side by side, tensor by tensor, in that order.
            raise CorruptPatchError(
                f"{self.name}: tensors are not laid out by name; not a loco patch", path=self.name
            )
        self.shapes = {t.name: t.shape for t in self._st.tensors}
        self._whole = new_hasher()
        self._whole.update(struct.pack("<Q", len(self._st.raw)) + self._st.raw)
        self._item_fps: list[str] = []

    def next_tensor(self) -> tuple[np.ndarray, np.ndarray]:
        """The next tensor's sent positions (int64, ascending) and values (float32)."""
        index = len(self._item_fps)
        item, t = self._header.items[index], self._st.tensors[index]
        bb = self._header.block_bytes
        nblocks = blocks_in(item.nbytes, bb)
        self._reader.read_frame(index, nblocks)
        h = new_hasher()
        pos_parts, val_parts = [], []
        for b in range(nblocks):
            size = min(bb, item.nbytes - b * bb)
            where = f"tensor {t.name!r} block {b}"
            block = self._reader.read_block(bb + BLOCK_PAYLOAD_SLACK, where)
            try:
                data = decode_block(block.codec, block.payload, np.zeros(size, np.uint8), size, 4)
            except (CorruptPatchError, FormatError) as exc:  # damaged, or a newer codec
                raise type(exc)(
                    f"{self.name}: tensor {t.name!r}: {exc}", path=self.name, tensor=t.name
                ) from exc
            update_both(h, self._whole, data.data)
            words = data.view("<u4")
            nz = np.flatnonzero(words)
            pos_parts.append(nz + b * (bb // 4))
            val_parts.append(words[nz].astype(np.uint32).view(np.float32))
        self._item_fps.append(h.hexdigest())
        return _joined(pos_parts, val_parts)

    def finish(self) -> None:
        """Check what was read against the trailer (every tensor must have been read)."""
        name, st = self.name, self._st
        _check_zero_fingerprints(self._header, st, name)
        trailer = trailer_from_json(self._reader.read_trailer(), self._header, name)
        for t, want, got in zip(st.tensors, trailer.items, self._item_fps, strict=True):
            if want.fingerprint != got:
                raise IntegrityError(
                    f"{name}: tensor {t.name!r} decodes to fingerprint {got}, the patch says "
                    f"{want.fingerprint}",
                    path=name,
                    tensor=t.name,
                    expected=want.fingerprint,
                    actual=got,
                )
        got = self._whole.hexdigest()
        if got != trailer.target_fingerprint:
            raise IntegrityError(
                f"{name}: decoded values have fingerprint {got}, the patch says "
                f"{trailer.target_fingerprint}",
                path=name,
                expected=trailer.target_fingerprint,
                actual=got,
            )


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
    with _F32Source(path) as src:
        out = {t.name: src.read(t.name, 0, src.numel(t.name)).reshape(t.shape) for t in src.tensors}
        return out, src.metadata


class _F32Source:
    """A safetensors file of F32 tensors, read a run of one tensor's elements at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        st = read_header(self.path)
        self.metadata = st.metadata
        self.tensors = st.tensors
        self._by_name = {t.name: t for t in st.tensors}
        self.shapes = {t.name: t.shape for t in st.tensors}
        for t in st.tensors:
            if t.dtype != _F32:
                raise InputError(
                    f"{path}: tensor {t.name!r} is {t.dtype}; loco works on F32 tensors (the "
                    "FP32 master weights); save them in float32",
                    path=path,
                    tensor=t.name,
                )
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise InputError(
                f"{path}: cannot open: {exc.strerror}{open_files_hint(exc)}", path=path
            ) from exc

    def numel(self, name: str) -> int:
        return self._by_name[name].nbytes // 4

    def read(self, name: str, first: int, count: int) -> np.ndarray:
        """Elements ``first`` to ``first + count`` of tensor ``name``, flat float32."""
        t = self._by_name[name]
        data = pread_array(self._fd, t.start + 4 * first, 4 * count, str(self.path))
        return data.view("<f4").astype(np.float32, copy=False)

    def __enter__(self) -> _F32Source:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)


class _F32Sink:
    """A new safetensors file of F32 tensors, laid out as ``save_safetensors`` lays them out
    (by name, after the metadata), written front to back a run of elements at a time."""

    def __init__(
        self, path: Path, shapes: Mapping[str, tuple[int, ...]], metadata: dict[str, str] | None
    ) -> None:
        header, self.order = build_header({n: (_F32, s) for n, s in shapes.items()}, metadata)
        self.path = path
        self._left = sum(4 * math.prod(s) for s in shapes.values())
        try:
            self._file = open(path, "xb")  # noqa: SIM115 (closed by close or discard)
            self._file.write(struct.pack("<Q", len(header)) + header)
        except OSError as exc:
            raise os_error(exc, path) from exc

    def write(self, run: np.ndarray) -> None:
        try:
            self._file.write(memoryview(np.ascontiguousarray(run, dtype="<f4")).cast("B"))
        except OSError as exc:
            raise os_error(exc, self.path) from exc
        self._left -= 4 * run.size

    def close(self) -> None:
        assert self._left == 0, f"{self.path}: {self._left} bytes of tensor data not written"
        try:
            self._file.close()
        except OSError as exc:
            raise os_error(exc, self.path) from exc

    def __enter__(self) -> _F32Sink:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
        else:
            with contextlib.suppress(OSError):
                self._file.close()


def _runs(numel: int) -> Iterator[tuple[int, int]]:
    """(first, count) of each run of a tensor's elements that the file commands work on."""
    for first in range(0, numel, _RUN):
        yield first, min(_RUN, numel - first)


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
    with contextlib.ExitStack() as stack:
        g_src = stack.enter_context(_F32Source(global_path))
        l_src = stack.enter_context(_F32Source(local_path))
        created = not residual_path.exists()
        r_src = None if created else stack.enter_context(_F32Source(residual_path))
        _check_shapes(g_src.shapes, l_src.shapes, "global", "local")
        if r_src is not None:
            _check_shapes(g_src.shapes, r_src.shapes, "global", "residual")
        shapes = g_src.shapes
        sent = 0

        def tensors(residual: _F32Sink) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            nonlocal sent
            for name in residual.order:
                pos_parts, val_parts = [], []
                for first, count in _runs(g_src.numel(name)):
                    g = g_src.read(name, first, count)
                    lo = l_src.read(name, first, count)
                    r = None if r_src is None else r_src.read(name, first, count)
                    pos, values, s = _encode_run(g, lo, r, visible)
                    residual.write(s)
                    pos_parts.append(pos + first)
                    val_parts.append(values)
                sent += sum(p.size for p in pos_parts)
                yield _joined(pos_parts, val_parts)

        def write(tmps: list[Path]) -> int:
            patch_tmp, residual_tmp = tmps
            with _F32Sink(residual_tmp, shapes, None) as residual:
                loco = _loco_doc(KIND_PSEUDO_GRADIENT, 1, visible)
                return _write_file(patch_tmp, shapes, loco, tensors(residual), level)

        patch_bytes = commit_together([out, residual_path], write)
    total = sum(math.prod(shape) for shape in shapes.values())
    return EncodeSummary(sent, total, patch_bytes, created)


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
    with contextlib.ExitStack() as stack:
        streams = [_open_update(stack, p) for p in paths]
        visible = _reducible(streams)  # from the headers, before any tensor is read
        shapes = streams[0].shapes
        sent = 0

        def tensors() -> Iterator[Iterator[tuple[int, np.ndarray]]]:
            """Each tensor's mean as runs of elements (first, dense run), in name order."""
            for name in sorted(shapes):
                parts = [u.next_tensor() for u in streams]
                numel = math.prod(shapes[name])
                yield ((first, _mean(parts, first, count)) for first, count in _runs(numel))

        def sparse() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            nonlocal sent
            for runs in tensors():
                pos_parts, val_parts = [], []
                for first, acc in runs:
                    pos, values = _sparse(acc)
                    pos_parts.append(pos + first)
                    val_parts.append(values)
                    sent += pos.size
                yield _joined(pos_parts, val_parts)

        def write(tmps: list[Path]) -> None:
            nonlocal sent
            if not dense:
                loco = _loco_doc(KIND_AVERAGE, len(streams), visible)
                _write_file(tmps[0], shapes, loco, sparse(), level)
            else:
                with _F32Sink(tmps[0], shapes, None) as sink:
                    for runs in tensors():
                        for _, acc in runs:
                            sink.write(acc)
                            sent += int(np.count_nonzero(acc.view(np.uint32)))
            # Every patch checked to its end (trailer, fingerprints) before the output counts
            # (found in review: after its last tensor, a generator is not resumed).
            for u in streams:
                u.finish()

        commit_together([out], write)
    total = sum(math.prod(shape) for shape in shapes.values())
    return ReduceSummary(len(paths), sent, total, out.stat().st_size)


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
    lr32, beta32 = check_outer(lr, beta)
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
    with contextlib.ExitStack() as stack:
        g_src = stack.enter_context(_F32Source(global_path))
        sparse = _open_update(stack, update_path) if is_patch(update_path) else None
        u_src = None if sparse is not None else stack.enter_context(_F32Source(update_path))
        m_src = None
        if momentum_path is not None and momentum_path.exists():
            m_src = stack.enter_context(_F32Source(momentum_path))
        shapes = g_src.shapes
        u_shapes = sparse.shapes if sparse is not None else u_src.shapes  # type: ignore[union-attr]
        _check_shapes(shapes, u_shapes, "global", "update")
        if m_src is not None:
            _check_shapes(shapes, m_src.shapes, "global", "momentum")

        def write(tmps: list[Path]) -> None:
            with contextlib.ExitStack() as sinks:
                new_g = sinks.enter_context(_F32Sink(tmps[0], shapes, g_src.metadata))
                new_m = None if plain else sinks.enter_context(_F32Sink(tmps[1], shapes, None))
                for name in new_g.order:
                    sent = None if sparse is None else sparse.next_tensor()
                    for first, count in _runs(g_src.numel(name)):
                        g = g_src.read(name, first, count)
                        if sent is None:
                            u = u_src.read(name, first, count)  # type: ignore[union-attr]
                        else:
                            u = _dense_run(sent, first, count)
                        m = None if m_src is None else m_src.read(name, first, count)
                        g2, m2 = _step_run(g, u, m, lr32, beta32, plain)
                        new_g.write(g2)
                        if new_m is not None and m2 is not None:
                            new_m.write(m2)
                if sparse is not None:
                    sparse.finish()  # before either output is closed as whole

        targets = [out] if momentum_path is None else [out, momentum_path]
        commit_together(targets, write)


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
    _check_shapes(
        {k: tuple(np.shape(v)) for k, v in ref.items()},
        {k: tuple(np.shape(v)) for k, v in other.items()},
        ref_label,
        label,
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


def _reducible(updates: Sequence[SparseUpdate | _UpdateStream]) -> str | None:
    """Refuse (UsageError) updates that cannot be averaged: none, one that is not a
    pseudo-gradient, or another model than the first's. Returns the gate's precision they
    share (None: mixed)."""
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
    seen = {u.visible for u in updates}
    return seen.pop() if len(seen) == 1 else None


def _check_shapes(
    ref: Mapping[str, tuple[int, ...]],
    other: Mapping[str, tuple[int, ...]],
    ref_label: str,
    label: str,
) -> None:
    if dict(ref) != dict(other):
        raise InputError(
            f"{label} does not match {ref_label}: {_first_difference(ref, other)}; "
            "both must hold the same tensors with the same shapes"
        )


def _mean(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], first: int, count: int | None = None
) -> np.ndarray:
    """The FP32 mean of sparse updates of one tensor, as ``reduce`` defines it, dense: of its
    elements ``first`` to ``first + count`` (positions ascending), or of all ``first`` of them
    (``count`` None)."""
    with np.errstate(all="ignore"):
        if count is None:
            acc = np.zeros(first, dtype=np.float32)
            for pos, values in parts:
                acc[pos] = _ieee(np.add, acc[pos], values)  # positions are unique in an update
        else:
            acc = np.zeros(count, dtype=np.float32)
            for pos, values in parts:
                lo, hi = np.searchsorted(pos, [first, first + count])
                at = pos[lo:hi] - first
                acc[at] = _ieee(np.add, acc[at], values[lo:hi])
        np.divide(acc, np.float32(len(parts)), out=acc)
    return acc


def _sparse(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions and values of a flat float32 array's entries that are not +0.0."""
    pos = np.flatnonzero(dense.view(np.uint32))
    return pos, dense[pos]


def _joined(
    pos_parts: list[np.ndarray], val_parts: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    if not pos_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(pos_parts), np.concatenate(val_parts)


def _dense_run(sent: tuple[np.ndarray, np.ndarray], first: int, count: int) -> np.ndarray:
    """Elements ``first`` to ``first + count`` of a tensor given by its sent values."""
    pos, values = sent
    lo, hi = np.searchsorted(pos, [first, first + count])
    run = np.zeros(count, dtype=np.float32)
    run[pos[lo:hi] - first] = values[lo:hi]
    return run


def _open_update(stack: contextlib.ExitStack, path: str | Path) -> _UpdateStream:
    """A loco patch file opened for reading tensor by tensor (closed with ``stack``)."""
    try:
        f = stack.enter_context(open(path, "rb"))  # noqa: SIM115 (closed with the stack)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}", path=path) from exc
    return _UpdateStream(f, str(path))


def _write_file(
    path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    loco: dict[str, Any],
    tensors: Iterator[tuple[np.ndarray, np.ndarray]],
    level: int,
) -> int:
    """Write a loco patch to the new file ``path``, synced; returns its size."""
    try:
        with open(path, "xb") as f:
            size = _write_patch(f, shapes, loco, tensors, level=level)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise os_error(exc, path) from exc
    return size
