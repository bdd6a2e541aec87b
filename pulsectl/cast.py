"""cast: a checkpoint's floating tensors rounded to BF16, F16 or FP8, exactly as torch does.

The receiver of a ``diff --as bf16`` patch keeps this cast of the trainer's checkpoint as its
anchor. Every F32, F64, F16 and BF16 tensor is converted; every other tensor (integers, bools,
FP8 and sub-byte floats, complex) and every non-safetensors file is carried unchanged.

Rounding is to nearest, ties to even, bit for bit as ``torch.from_numpy(x).to(dtype)`` on a
contiguous CPU tensor (torch 2.x): subnormals kept, the sign of zero kept, F64 rounded to F32
first (torch converts doubles through float, so F64 values round twice). Out of range:

- bf16, f16: overflow gives +-inf.
- f8_e4m3 (``float8_e4m3fn``, no infinities): saturates, as torch's CPU kernel does: every
  |x| >= 448, infinities included, gives +-448 (0x7E | sign). (c10's scalar
  ``Float8_e4m3fn(float)`` and some older torch releases give NaN from 480 on instead.)
- f8_e5m2 (``float8_e5m2``): |x| >= 2**16 gives +-inf (values just below round normally).

NaN words follow the torch kernels: to bf16, F32/F64 NaN -> 0xFFFF and F16 NaN -> 0x7FC0
(torch's own F64 kernel writes 0x7FC0 instead in the scalar tail of a row, the last n mod 16
elements: this module always writes 0xFFFF); to f16, sign | 0x7E00 | the top payload bits
(the x86 F16C rule); to FP8, sign | 0x7F. A tensor already of the target dtype is copied.

The output is deterministic: tensors laid out as the official safetensors writer orders them
(dtype rank, then name), metadata kept with sorted keys. A folder keeps its file names; the
index's ``metadata.total_size`` is rewritten, and ``config.json``'s ``torch_dtype`` when the
target is bf16 or f16; other files are copied byte for byte. Work goes tensor by tensor in
chunks of ``CHUNK_ELEMENTS``, so memory stays at a few tens of MiB whatever the model size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pulsectl._atomic import (
    TEMP_MARK,
    atomic_file,
    check_folder_target,
    check_target,
    file_path,
    install,
    os_error,
    refuse_inside_folder_input,
    remove,
    same_file,
    temp_path,
    temp_prefix,
)
from pulsectl._dtypes import DTYPES
from pulsectl._io import pread_array
from pulsectl.checkpoint import (
    _LAYOUT_RANK,
    HEADER_ALIGN,
    METADATA_KEY,
    Checkpoint,
    FileEntry,
    SafetensorsHeader,
)
from pulsectl.errors import InputError, OutputError, UsageError, open_files_hint
from pulsectl.floats import f32_to_bf16

TARGETS: dict[str, str] = {
    "bf16": "BF16",
    "f16": "F16",
    "f8_e4m3": "F8_E4M3",
    "f8_e5m2": "F8_E5M2",
}
"""Target names accepted by ``cast`` and ``--as``, and the safetensors dtype each writes."""

CAST_SOURCES = frozenset({"F32", "F64", "F16", "BF16"})
"""Dtypes that are converted; every other tensor is copied unchanged."""

CHUNK_ELEMENTS = 1 << 22  # elements converted per pass (16 MiB of F32)
INDEX_SUFFIX = ".safetensors.index.json"
CONFIG_NAME = "config.json"

_TORCH_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16"}
_SIGN = np.uint32(0x8000_0000)
_ABS = np.uint32(0x7FFF_FFFF)
_F32_INF = np.uint32(0x7F80_0000)
_BF16_NAN_FROM_WIDE = 0xFFFF  # torch's vectorised F32/F64 -> BF16 kernels
_BF16_NAN_FROM_F16 = 0x7FC0  # torch's F16 -> BF16 kernel (c10::BFloat16(float))

Progress = Callable[[int, int], None]


def target_dtype(to: str, option: str | None = None) -> str:
    """The safetensors dtype for a target name (``bf16`` -> ``BF16``); UsageError if unknown,
    naming ``option`` (``--as``) where the name came from one."""
    try:
        return TARGETS[to.lower()]
    except KeyError:
        choose = f"choose one of {', '.join(TARGETS)}"
        if option is None:
            raise UsageError(f"unknown cast target {to!r}; {choose}") from None
        raise UsageError(f"{option} {to!r}: unknown cast target; {choose}", option=option) from None


# ---------------------------------------------------------------------------------------------
# Conversions on raw words


def cast_words(data: np.ndarray | bytes, src: str, to: str) -> np.ndarray:
    """Convert raw little-endian ``src`` words (any buffer) to words of target ``to``.

    ``src`` is a safetensors dtype in CAST_SOURCES, ``to`` a key of TARGETS. Returns uint16
    (bf16, f16) or uint8 (FP8) words, one per source element.
    """
    dst = target_dtype(to)
    if src not in CAST_SOURCES:
        raise ValueError(f"cannot cast {src}; castable dtypes: {', '.join(sorted(CAST_SOURCES))}")
    raw = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if src == dst:
        return raw.view(_word_type(dst)).copy()
    bits = _f32_bits(raw, src)
    if dst == "BF16":
        nan = _BF16_NAN_FROM_F16 if src == "F16" else _BF16_NAN_FROM_WIDE
        return f32_to_bf16(bits, nan=nan)
    if dst == "F16":
        return _f32_to_f16(bits)
    if dst == "F8_E4M3":
        return _f32_to_e4m3fn(bits)
    return _f32_to_e5m2(bits)


def _word_type(dtype: str) -> Any:
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[DTYPES[dtype].word]


def _f32_bits(raw: np.ndarray, src: str) -> np.ndarray:
    """The source values as float32 bit patterns (uint32), as torch's kernels see them."""
    if src == "F32":
        return raw.view("<u4").astype(np.uint32, copy=False)
    if src == "BF16":
        return raw.view("<u2").astype(np.uint32) << np.uint32(16)
    if src == "F16":
        with np.errstate(all="ignore"):
            return raw.view("<f2").astype(np.float32).view(np.uint32)
    # F64: round to float32 (nearest even), then give NaNs the hardware payload rule
    # (sign, quiet bit, top 22 payload bits) whatever numpy's loop does with them.
    wide = raw.view("<u8")
    with np.errstate(all="ignore"):
        bits = raw.view("<f8").astype(np.float32).view(np.uint32)
    nan = (wide & np.uint64(0x7FFF_FFFF_FFFF_FFFF)) > np.uint64(0x7FF0_0000_0000_0000)
    if nan.any():
        w = wide[nan]
        sign = (w >> np.uint64(32)).astype(np.uint32) & _SIGN
        payload = (w >> np.uint64(29)).astype(np.uint32) & np.uint32(0x007F_FFFF)
        bits[nan] = sign | np.uint32(0x7FC0_0000) | payload
    return bits


def _f32_to_f16(bits: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        out = bits.view(np.float32).astype(np.float16).view(np.uint16)
    nan = (bits & _ABS) > _F32_INF
    if nan.any():
        b = bits[nan]
        out[nan] = (
            ((b >> np.uint32(16)) & np.uint32(0x8000))
            | np.uint32(0x7E00)
            | ((b >> np.uint32(13)) & np.uint32(0x3FF))
        ).astype(np.uint16)
    return out


def _f32_to_fp8(
    bits: np.ndarray, mant_bits: int, bias: int, max_bits: int, min_normal_exp: int, big: Any
) -> np.ndarray:
    """The c10 float -> float8 conversion (c10/util/Float8_*.h), vectorised.

    ``big(f)`` gives the word for magnitudes at or above ``max_bits`` (NaN or inf rules).
    Subnormal results come from a float32 addition that rounds to nearest even, as in c10.
    """
    shift = 23 - mant_bits
    sign = bits & _SIGN
    f = bits ^ sign
    out = np.empty(f.shape, dtype=np.uint8)
    large = f >= np.uint32(max_bits)
    small = f < np.uint32(min_normal_exp << 23)
    normal = ~(large | small)
    out[large] = big(f[large])
    if small.any():
        # c10's denorm_mask: adding it shifts the mantissa into place, rounding to even.
        denorm_bits = np.uint32((127 - bias + shift + 1) << 23)
        denorm = denorm_bits.view(np.float32)
        with np.errstate(all="ignore"):
            summed = (f[small].view(np.float32) + denorm).view(np.uint32)
        out[small] = (summed - denorm_bits).astype(np.uint8)
    if normal.any():
        g = f[normal]
        odd = (g >> np.uint32(shift)) & np.uint32(1)
        rebias = np.uint32((((bias - 127) << 23) + (1 << (shift - 1)) - 1) & 0xFFFF_FFFF)
        g = g + rebias + odd  # uint32 arithmetic wraps like the C code
        out[normal] = (g >> np.uint32(shift)).astype(np.uint8)
    out |= (sign >> np.uint32(24)).astype(np.uint8)
    return out


def _f32_to_e4m3fn(bits: np.ndarray) -> np.ndarray:
    # 0x43E00000 is 448.0, the largest finite e4m3fn: torch's CPU kernel saturates everything
    # from there on, infinities included, to +-448 (0x7E); NaN gives 0x7F.
    return _f32_to_fp8(
        bits,
        3,
        7,
        0x43E0_0000,
        121,
        lambda f: np.where(f > _F32_INF, np.uint8(0x7F), np.uint8(0x7E)).astype(np.uint8),
    )


def _f32_to_e5m2(bits: np.ndarray) -> np.ndarray:
    # 143 << 23 is 65536.0: from there on the result is inf (NaN stays NaN).
    return _f32_to_fp8(
        bits,
        2,
        15,
        143 << 23,
        113,
        lambda f: np.where(f > _F32_INF, np.uint8(0x7F), np.uint8(0x7C)).astype(np.uint8),
    )


# ---------------------------------------------------------------------------------------------
# Checkpoints


@dataclass(frozen=True)
class CastSummary:
    output: Path
    target: str  # safetensors dtype written, e.g. "BF16"
    tensors: int
    converted: int  # tensors whose dtype changed
    source_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class _Planned:
    name: str
    src_dtype: str
    out_dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the source file
    src_nbytes: int
    out_nbytes: int


def cast_checkpoint(
    source: str | Path,
    out: str | Path,
    *,
    to: str = "bf16",
    force: bool = False,
    progress: Progress | None = None,
) -> CastSummary:
    """Write the cast of checkpoint ``source`` (file or folder) to ``out``, atomically."""
    dst = target_dtype(to)
    given, out = out, Path(out)  # 'runs/' with a trailing '/': a folder checkpoint only
    if same_file(out, source):  # even with -f: an FP32 master cannot be had back from its cast
        raise UsageError(f"{out} is CKPT; write the cast elsewhere, even with -f")
    refuse_inside_folder_input(out, [source], "cast")
    ckpt = Checkpoint.open(source)
    total = sum(e.size for e in ckpt.files)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    counts = [0, 0, 0]  # tensors, converted, output bytes
    if ckpt.layout == "file":
        entry = ckpt.files[0]
        assert entry.header is not None
        with atomic_file(file_path(given, "cast checkpoint"), force) as f:
            _cast_file(entry, dst, f, counts, advance)
    else:
        if out.is_file():  # -f replaces a checkpoint with a checkpoint, not a file by a folder
            raise OutputError(
                f"{out}: is a file, and the cast of a folder checkpoint is a folder; give "
                "another path",
                path=out,
            )
        check_target(out, force)
        check_folder_target(out, [Path(source)])
        tmp = temp_path(out)
        try:
            tmp.mkdir()
            _cast_folder(ckpt, dst, tmp, counts, advance)
            install(tmp, out)
        except OSError as exc:
            remove(tmp)
            raise os_error(exc, out) from exc
        except BaseException:
            remove(tmp)
            raise
    return CastSummary(out, dst, counts[0], counts[1], total, counts[2])


def _plan(header: SafetensorsHeader, dst: str) -> list[_Planned]:
    planned = []
    for t in header.tensors:
        out_dtype = dst if t.dtype in CAST_SOURCES else t.dtype
        out_nbytes = DTYPES[out_dtype].nbytes(math.prod(t.shape))
        planned.append(_Planned(t.name, t.dtype, out_dtype, t.shape, t.start, t.nbytes, out_nbytes))
    # The official writer's order: dtype rank descending, then name (see save_safetensors).
    planned.sort(key=lambda p: (-_LAYOUT_RANK[p.out_dtype], p.name))
    return planned


def _header_bytes(planned: Sequence[_Planned], metadata: dict[str, str] | None) -> bytes:
    """The JSON header save_safetensors would write for these tensors, padded, no prefix."""
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc[METADATA_KEY] = dict(sorted(metadata.items()))
    offset = 0
    for p in planned:
        doc[p.name] = {
            "dtype": p.out_dtype,
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.out_nbytes],
        }
        offset += p.out_nbytes
    header = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return header + b" " * (-len(header) % HEADER_ALIGN)


def _cast_file(
    entry: FileEntry,
    dst: str,
    out: BinaryIO,
    counts: list[int],
    advance: Callable[[int], None],
) -> int:
    """Stream the cast of one safetensors file to ``out``; returns the tensor bytes written."""
    assert entry.header is not None
    planned = _plan(entry.header, dst)
    header = _header_bytes(planned, entry.header.metadata)
    out.write(len(header).to_bytes(8, "little") + header)
    advance(entry.header.data_start)
    written = 0
    try:
        fd = os.open(entry.path, os.O_RDONLY)
    except OSError as exc:
        raise InputError(
            f"{entry.path}: cannot open: {exc.strerror}{open_files_hint(exc)}", path=entry.path
        ) from exc
    try:
        for p in planned:
            converted = p.src_dtype != p.out_dtype
            size = DTYPES[p.src_dtype].nbytes(1) if converted else 1
            step = CHUNK_ELEMENTS * size
            for offset in range(0, p.src_nbytes, step):
                n = min(step, p.src_nbytes - offset)
                raw = pread_array(fd, p.start + offset, n, str(entry.path))
                if converted:
                    raw = cast_words(raw, p.src_dtype, dst).view(np.uint8)
                out.write(raw.data)
                advance(n)
            written += p.out_nbytes
            counts[0] += 1
            counts[1] += converted
    finally:
        os.close(fd)
    counts[2] += 8 + len(header) + written
    return written


def _cast_folder(
    ckpt: Checkpoint,
    dst: str,
    tmp: Path,
    counts: list[int],
    advance: Callable[[int], None],
) -> None:
    tensor_bytes = 0
    deferred: list[FileEntry] = []
    for entry in ckpt.files:
        target = tmp.joinpath(*entry.relpath.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        if entry.header is not None:
            with open(target, "wb") as f:
                tensor_bytes += _cast_file(entry, dst, f, counts, advance)
        elif entry.relpath.endswith(INDEX_SUFFIX) or entry.relpath == CONFIG_NAME:
            deferred.append(entry)  # needs the sizes of every shard first
        else:
            shutil.copyfile(entry.path, target)
            counts[2] += entry.size
            advance(entry.size)
    for entry in deferred:
        target = tmp.joinpath(*entry.relpath.split("/"))
        data = entry.path.read_bytes()
        if entry.relpath == CONFIG_NAME:
            data = _rewrite_config(data, dst)
        else:
            data = _rewrite_index(data, tensor_bytes)
        target.write_bytes(data)
        counts[2] += len(data)
        advance(entry.size)


def _load_object(data: bytes) -> dict[str, Any] | None:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # bad JSON, 4300+ digit ints, nesting
        return None
    return doc if isinstance(doc, dict) else None


def _dump(doc: dict[str, Any]) -> bytes:
    # transformers' spelling: two-space indent, a final newline; key order kept as read.
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def _rewrite_index(data: bytes, total_size: int) -> bytes:
    doc = _load_object(data)
    if doc is None or not isinstance(doc.get("metadata"), dict):
        return data
    if "total_size" not in doc["metadata"] or doc["metadata"]["total_size"] == total_size:
        return data
    doc["metadata"]["total_size"] = total_size
    return _dump(doc)


def _rewrite_config(data: bytes, dst: str) -> bytes:
    name = _TORCH_DTYPE_NAMES.get(dst)
    doc = _load_object(data)
    if name is None or doc is None:
        return data
    changed = False
    for key in ("torch_dtype", "dtype"):
        if isinstance(doc.get(key), str) and doc[key] != name:
            doc[key] = name
            changed = True
    return _dump(doc) if changed else data


@contextlib.contextmanager
def cast_temporaries(
    checkpoints: Sequence[str | Path], *, to: str, near: str | Path | None = None
) -> Iterator[list[Path]]:
    """Cast each checkpoint into a temporary folder; yield their paths; remove them after.

    The folder is made beside ``near`` (e.g. the output file, so the casts share its disk) or,
    when ``near`` is None, in $TMPDIR. Used by ``diff --as`` and ``stats --as``: the simplest
    correct way to diff two casts, at the price of writing both to disk once.
    """
    target_dtype(to)
    parent = Path(near).parent if near is not None else None
    # Beside the output it is named as its temps are (docs/GUARANTEES.md: what a kill -9
    # leaves, and how to remove it).
    prefix = (
        temp_prefix(Path(near).name, f"{TEMP_MARK}cast-") if near is not None else "pulsectl-cast-"
    )
    try:
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    except OSError as exc:
        raise os_error(exc, Path(parent or tempfile.gettempdir())) from exc
    try:
        paths = []
        for i, ckpt in enumerate(checkpoints):
            path = folder / f"{i:04d}-{Path(ckpt).name}"
            cast_checkpoint(ckpt, path, to=to)
            paths.append(path)
        yield paths
    finally:
        shutil.rmtree(folder, ignore_errors=True)
