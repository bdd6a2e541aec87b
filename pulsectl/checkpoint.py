"""Read safetensors headers and checkpoint layouts; write safetensors files.

A checkpoint is either one ``.safetensors`` file or a directory of shards plus other files
(config, index, tokenizer), which pulsectl carries along as opaque blobs. Reading never
touches tensor data: only the 8-byte length prefix and the JSON header of each file.

File layout (https://github.com/huggingface/safetensors, README "Format")::

    u64 little-endian N | N bytes of UTF-8 JSON header | tensor data

Each header entry maps a tensor name to ``{"dtype", "shape", "data_offsets"}``, offsets being
relative to the start of the data section; the optional ``"__metadata__"`` entry is a
``str -> str`` map. The tensors must tile the data section exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

from pulsectl._atomic import discard, file_path, interrupts_deferred, os_error, temp_prefix
from pulsectl._dtypes import DTYPES
from pulsectl.errors import FormatError, InputError
from pulsectl.format import MAGIC as PATCH_MAGIC

if TYPE_CHECKING:  # numpy is imported only to write files: reading headers stays light
    import numpy as np

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same limit as the official safetensors library
HEADER_LEN_BYTES = 8  # the u64 little-endian header length that starts every file
HEADER_ALIGN = 8  # the official writer pads the header with spaces to a multiple of this
METADATA_KEY = "__metadata__"
SAFETENSORS_SUFFIX = ".safetensors"

_MAX_ELEMENTS = 2**64  # sizes are u64 in safetensors; no real tensor comes near
_LEN_PREFIX = struct.Struct("<Q")
_O_BINARY: int = getattr(os, "O_BINARY", 0)  # Windows only
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})

# The official serializer orders tensors by its Rust ``Dtype`` enum, descending, then by name.
# The enum is declared in this order (roughly increasing alignment), so this is its rank.
_LAYOUT_ORDER: tuple[str, ...] = (
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
)
_LAYOUT_RANK: dict[str, int] = {name: rank for rank, name in enumerate(_LAYOUT_ORDER)}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset of the first data byte in the file
    nbytes: int

    @property
    def word(self) -> int:
        """Bytes per word compared and delta-coded for this dtype."""
        return DTYPES[self.dtype].word

    @property
    def end(self) -> int:
        """Absolute offset one past the last data byte."""
        return self.start + self.nbytes


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header."""

    raw: bytes  # JSON header exactly as stored (padding included), without the length prefix
    tensors: tuple[TensorInfo, ...]  # in file order (by data offset)
    metadata: dict[str, str] | None  # the "__metadata__" entry, if present
    data_start: int  # 8 + len(raw)
    file_size: int  # data_start + sum of tensor sizes


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_ZIP_MAGIC = b"PK\x03\x04"  # then the version needed (never 0): a length over the limit


def _other_format(prefix: bytes) -> str:
    """What a file that is not safetensors is, by its first bytes, where that is well known:
    the start of an error message, '' otherwise."""
    torch_file = "not a safetensors file; convert the state dict with safetensors.torch.save_file"
    if prefix == PATCH_MAGIC:
        return "a .pulse patch, not a safetensors file"
    if prefix.startswith(_ZIP_MAGIC):
        return f"a zip archive (torch.save's .pt or .bin?), {torch_file}"
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return f"a pickle (an older torch.save .bin?), {torch_file}"
    if prefix.startswith(b"GGUF"):
        return "a GGUF file, not a safetensors file"
    text = prefix.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
    # Text all through: a length prefix has zero high bytes (found in review: one of 0x7B20
    # starts with ' {' and, cut short, was named JSON).
    if all(32 <= c < 127 or c in b"\t\r\n" for c in text) and text.lstrip()[:1] in (b"{", b"["):
        return (
            "a JSON file, not a safetensors file; for a Hugging Face checkpoint, give its folder "
            "(model.safetensors.index.json and config.json are read from there)"
        )
    if prefix == b"version ":  # "version https://git-lfs.github.com/spec/v1"
        return (
            "a Git LFS pointer, not the file's content (a clone without git-lfs?); fetch the "
            "weights with 'git lfs pull' or download them with huggingface_hub"
        )
    return ""


def _check_header_len(header_len: int, file_size: int, path: str | Path) -> None:
    if header_len == 0:
        raise FormatError(f"{path}: header length is 0; not a safetensors file", path=path)
    if header_len > MAX_HEADER_BYTES:
        raise FormatError(
            f"{path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit;"
            " not a safetensors file",
            path=path,
        )
    if header_len > file_size - HEADER_LEN_BYTES:
        raise FormatError(
            f"{path}: header length {header_len} is larger than the rest of the file"
            f" ({file_size - HEADER_LEN_BYTES} bytes); file truncated or not safetensors",
            path=path,
        )


def _parse_entry(name: str, entry: object, data_start: int, path: str | Path) -> TensorInfo:
    def fail(what: str) -> FormatError:
        return FormatError(f"{path}: tensor {name!r}: {what}", path=path, tensor=name)

    if not isinstance(entry, dict):
        raise fail(f"entry must be a JSON object, got {type(entry).__name__}")
    # Other keys are ignored, as the official reader ignores them (its entry type does not deny
    # unknown fields); the header's bytes travel unchanged all the same.
    missing = sorted(_ENTRY_KEYS - entry.keys())
    if missing:
        raise fail(f"entry must have dtype, shape, data_offsets (missing {', '.join(missing)})")
    dtype = entry["dtype"]
    if not isinstance(dtype, str):
        raise fail(f"dtype must be a string, got {dtype!r}")
    if dtype not in DTYPES:
        raise fail(f"unknown dtype {dtype!r}")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < _MAX_ELEMENTS for d in shape):
        raise fail(f"shape must be a list of integers in [0, 2**64), got {shape!r}")
    numel = 1
    for d in shape:  # stop early: the product of a hostile shape could have millions of digits
        numel *= d
        if numel > _MAX_ELEMENTS:
            raise fail(f"shape has more than 2**64 elements (len {len(shape)})")
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise fail(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    begin, end = offsets
    if math.prod(shape) * DTYPES[dtype].bits % 8:
        # As the official library: a packed sub-byte tensor (F4, F6_*) must fill whole bytes.
        raise fail(f"{dtype} {shape} does not end at a byte boundary")
    expected = DTYPES[dtype].nbytes(math.prod(shape))
    if end - begin != expected:
        raise fail(
            f"data_offsets {offsets} span {end - begin} bytes but {dtype} {shape} takes {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin)


def _check_tiling(
    tensors: list[TensorInfo], data_start: int, file_size: int, path: str | Path
) -> None:
    """The tensors, in file order, must cover the data section exactly once."""
    data_len = file_size - data_start
    cursor = 0
    previous: TensorInfo | None = None
    for t in tensors:
        begin, end = t.start - data_start, t.end - data_start
        if end > data_len:
            raise FormatError(
                f"{path}: tensor {t.name!r}: data_offsets [{begin}, {end}] run past the end"
                f" of the data section ({data_len} bytes); file truncated?",
                path=path,
                tensor=t.name,
            )
        if begin < cursor:
            assert previous is not None
            raise FormatError(
                f"{path}: tensor {t.name!r}: data_offsets [{begin}, {end}] overlap tensor"
                f" {previous.name!r} (ends at {cursor})",
                path=path,
                tensor=t.name,
            )
        if begin > cursor:
            after = f"after tensor {previous.name!r}" if previous else "at the start of the data"
            raise FormatError(
                f"{path}: tensor {t.name!r}: {begin - cursor} unused bytes before it"
                f" ({after}); data_offsets must leave no holes",
                path=path,
                tensor=t.name,
            )
        cursor = end
        previous = t
    if cursor < data_len:
        raise FormatError(
            f"{path}: {data_len - cursor} bytes after the last tensor are not covered by"
            " the header",
            path=path,
        )


def parse_header(raw: bytes, file_size: int, path: str | Path = "<bytes>") -> SafetensorsHeader:
    """Validate a JSON header ``raw`` (as stored, no length prefix) of a file of ``file_size``."""
    _check_header_len(len(raw), file_size, path)
    data_start = HEADER_LEN_BYTES + len(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(
            f"{path}: header is not valid UTF-8 (byte {e.start})", path=path
        ) from None
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicates)
    except _DuplicateKeyError as e:
        raise FormatError(f"{path}: header has duplicate key {e.key!r}", path=path) from None
    except json.JSONDecodeError as e:
        raise FormatError(
            f"{path}: header is not valid JSON: {e.msg.removesuffix(' at')} at byte {e.pos}",
            path=path,
        ) from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise FormatError(f"{path}: header is not valid JSON: {e}", path=path) from None
    except RecursionError:
        raise FormatError(f"{path}: header JSON is nested too deeply", path=path) from None
    if not isinstance(doc, dict):
        raise FormatError(
            f"{path}: header must be a JSON object, got {type(doc).__name__}", path=path
        )

    metadata: dict[str, str] | None = None
    tensors: list[TensorInfo] = []
    for name, entry in doc.items():
        if name == METADATA_KEY:
            if entry is None:  # null: no metadata, as the official reader takes it
                continue
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise FormatError(
                    f"{path}: {METADATA_KEY} must be an object of string values", path=path
                )
            metadata = entry
        else:
            tensors.append(_parse_entry(name, entry, data_start, path))
    tensors.sort(key=lambda t: (t.start, t.nbytes, t.name))
    _check_tiling(tensors, data_start, file_size, path)
    return SafetensorsHeader(bytes(raw), tuple(tensors), metadata, data_start, file_size)


def _read_exact(f: BinaryIO, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise FormatError(f"{path}: file ended while reading the header", path=path)
    return data


def refuse_special_file(path: Path) -> None:
    """InputError for a checkpoint path that is neither a file nor a folder (a named pipe, a
    device): a pipe would wait in open() for a writer that a checkpoint never has. A missing
    path passes: whoever opens it says so."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise InputError(f"{path}: not a regular file or directory", path=path)


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path`` (no tensor data)."""
    path = Path(path)
    refuse_special_file(path)
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < HEADER_LEN_BYTES:
                raise FormatError(
                    f"{path}: file is {file_size} bytes, shorter than the 8-byte header length;"
                    " not a safetensors file",
                    path=path,
                )
            prefix = _read_exact(f, HEADER_LEN_BYTES, path)
            (header_len,) = _LEN_PREFIX.unpack(prefix)
            try:
                _check_header_len(header_len, file_size, path)
            except FormatError:
                # Only a file that cannot be safetensors is named as something else: the
                # first bytes of a valid file are any length up to MAX_HEADER_BYTES.
                other = _other_format(prefix)
                if other:
                    raise FormatError(f"{path}: {other}", path=path) from None
                raise
            raw = _read_exact(f, header_len, path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or directory", path=path) from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a file", path=path) from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}", path=path) from None
    return parse_header(raw, file_size, path)


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: a parsed safetensors file or an opaque blob."""

    relpath: str  # "" for a single-file checkpoint, else a POSIX path inside the directory
    path: Path
    size: int
    header: SafetensorsHeader | None  # None for blobs (config.json, tokenizer, ...)


def folder_files(root: Path) -> list[tuple[str, Path]]:
    """(relpath, path) of the files a folder checkpoint at ``root`` holds: regular files and
    links to files, no path component starting with '.'; InputError for a broken link or a
    name that is not UTF-8."""
    found: list[tuple[str, Path]] = []
    _walk(root, (), found)
    return found


def linked_folders(root: Path) -> list[str]:
    """Relative paths of the links to folders below folder checkpoint ``root``, hidden ones
    aside: they are not followed, so what they hold is not part of the checkpoint; [] for a
    single file."""
    found: list[str] = []
    if not root.is_dir():
        return found
    for folder, names, _ in os.walk(root):  # links to folders are listed, not entered
        rel = Path(folder).relative_to(root)
        names[:] = [n for n in names if not n.startswith(".")]
        for name in names:
            if os.path.islink(os.path.join(folder, name)):
                found.append((rel / name).as_posix())
    return sorted(found)


def _walk(root: Path, rel: tuple[str, ...], out: list[tuple[str, Path]]) -> None:
    """Collect (relpath, path) of regular files and links to files; skip dot-names."""
    folder = root.joinpath(*rel)
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as e:
        raise InputError(f"{folder}: cannot list: {e.strerror or e}", path=folder) from None
    for entry in entries:
        if entry.name.startswith("."):
            continue
        parts = (*rel, entry.name)
        path = Path(entry.path)
        try:
            entry.name.encode("utf-8")
        except UnicodeEncodeError:  # a byte the file system's encoding could not decode
            raise InputError(
                f"{path}: file name is not valid UTF-8; a folder checkpoint's paths are UTF-8 "
                "(its fingerprint and patches record them): rename it",
                path=path,
            ) from None
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in entry.name):
            # The fingerprint is a text of one line per file: a newline in a name could make
            # two different folders' texts, and fingerprints, the same.
            raise InputError(
                f"{ascii(str(path))}: file name holds a control character (a newline?); a "
                "folder checkpoint's fingerprint lists its files one per line: rename it",
                path=path,
            )
        if "\\" in entry.name:
            # FORMAT.md: a patch's paths hold no backslash (it separates folders elsewhere), and
            # every reader refuses one: a patch of this folder could never be applied.
            raise InputError(
                f"{path}: file name holds a backslash; a folder checkpoint's paths "
                "must not (patches record them, and readers refuse them): rename it",
                path=path,
            )
        if entry.is_symlink():
            if path.is_file():
                out.append(("/".join(parts), path))
            elif not path.exists():
                raise InputError(
                    f"{path}: broken symbolic link in the checkpoint; fix or remove it",
                    path=path,
                )
            # links to directories are not followed (cycles, files counted twice)
        elif entry.is_dir(follow_symlinks=False):
            _walk(root, parts, out)
        elif entry.is_file(follow_symlinks=False):
            out.append(("/".join(parts), path))


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}", path=path) from None


@dataclass(frozen=True)
class Checkpoint:
    """A single safetensors file or a directory checkpoint (shards plus blobs)."""

    layout: Literal["file", "dir"]
    root: Path
    files: tuple[FileEntry, ...]  # sorted by relpath

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open a checkpoint file or directory, reading and validating every header."""
        root = Path(path)
        if not root.exists():
            if str(path) == "-":  # stdin, by the convention of the patch arguments
                raise InputError(
                    "-: no such file or directory; a checkpoint is read from its file or "
                    "folder, not from standard input (only patches are)",
                    path=root,
                )
            raise InputError(f"{root}: no such file or directory", path=root)
        if root.is_file():
            header = read_header(root)
            return cls("file", root, (FileEntry("", root, header.file_size, header),))
        if not root.is_dir():
            raise InputError(f"{root}: not a regular file or directory", path=root)
        found = folder_files(root)
        if not found:
            raise InputError(f"{root}: directory has no files; nothing to read", path=root)
        entries = []
        for relpath, where in sorted(found):
            if relpath.endswith(SAFETENSORS_SUFFIX):
                header = read_header(where)
                entries.append(FileEntry(relpath, where, header.file_size, header))
            else:
                entries.append(FileEntry(relpath, where, _file_size(where), None))
        checkpoint = cls("dir", root, tuple(entries))
        checkpoint._tensor_index  # noqa: B018 -- rejects a tensor present in two shards
        return checkpoint

    @cached_property
    def _tensor_index(self) -> dict[str, tuple[FileEntry, TensorInfo]]:
        index: dict[str, tuple[FileEntry, TensorInfo]] = {}
        for entry, info in self.tensors():
            if info.name in index:
                first = index[info.name][0]
                fix = "remove one copy"
                variant = _variant_of(first.relpath, entry.relpath)
                if variant is not None:
                    # diffusers/transformers variants: X.safetensors beside X.fp16.safetensors,
                    # one model in two dtypes, not two copies of it.
                    fix = (
                        f"these look like two variants of one model ({variant}); tensors are "
                        "matched by name across a folder checkpoint, so diff each variant in a "
                        "folder of its own (one that holds its files only)"
                    )
                elif first.relpath.rpartition("/")[0] != entry.relpath.rpartition("/")[0]:
                    # Most likely a pipeline of models (diffusers: text_encoder/ and
                    # text_encoder_2/), whose tensor names repeat from model to model.
                    fix = (
                        "tensors are matched by name across a folder checkpoint, so a folder of "
                        "several models is diffed and applied one model at a time: give each "
                        "model's folder (e.g. A/text_encoder B/text_encoder)"
                    )
                raise FormatError(
                    f"{self.root}: tensor {info.name!r} is in both {first.relpath}"
                    f" and {entry.relpath}; {fix}",
                    path=entry.path,
                    tensor=info.name,
                )
            index[info.name] = (entry, info)
        return index

    @cached_property
    def _file_index(self) -> dict[str, FileEntry]:
        return {entry.relpath: entry for entry in self.files}

    def tensors(self) -> Iterator[tuple[FileEntry, TensorInfo]]:
        """Every tensor: files in relpath order, tensors in file order."""
        for entry in self.files:
            if entry.header is not None:
                for info in entry.header.tensors:
                    yield entry, info

    def find_tensor(self, name: str) -> tuple[FileEntry, TensorInfo] | None:
        """The file holding tensor ``name`` and where it is, or None."""
        return self._tensor_index.get(name)

    def file(self, relpath: str) -> FileEntry | None:
        """The file at ``relpath`` ("" for a single-file checkpoint), or None."""
        return self._file_index.get(relpath)


def _variant_of(a: str, b: str) -> str | None:
    """The variant names when ``a`` and ``b`` are one model's file in two variants, in the
    naming of diffusers and transformers (``X.safetensors`` and ``X.fp16.safetensors``, shards
    ``X-00001-of-00002.safetensors`` and ``X.fp16-00001-of-00002.safetensors``), else None. A
    variant is a word (fp16, bf16, non_ema), not the ``1-8b`` of ``llama-3.1-8b`` (found in
    review)."""
    if a.rpartition("/")[0] != b.rpartition("/")[0]:
        return None

    def stem(relpath: str) -> str:
        name = relpath.rpartition("/")[2].removesuffix(SAFETENSORS_SUFFIX)
        return re.sub(r"-\d+-of-\d+$", "", name)

    def word(text: str) -> bool:
        return re.fullmatch(r"[A-Za-z]\w*", text) is not None

    sa, sb = stem(a), stem(b)
    for x, y in ((sa, sb), (sb, sa)):  # X and X.fp16
        if x.startswith(f"{y}.") and word(x[len(y) + 1 :]):
            return f"'default' and {x[len(y) + 1 :]!r}"
    (ma, _, va), (mb, _, vb) = sa.rpartition("."), sb.rpartition(".")
    if ma and ma == mb and va != vb and word(va) and word(vb):  # X.bf16 and X.fp16
        return " and ".join(map(repr, sorted((va, vb))))
    return None


def _tensor_bytes(
    name: str, value: tuple[str, Sequence[int], bytes | np.ndarray]
) -> tuple[str, list[int], memoryview]:
    dtype, shape, data = value
    if not isinstance(name, str) or name == METADATA_KEY:
        raise ValueError(f"invalid tensor name {name!r}")
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise ValueError(f"tensor {name!r}: negative dimension in shape {dims}")
    import numpy as np

    if isinstance(data, np.ndarray):
        arr = data.astype(data.dtype.newbyteorder("<"), copy=False)
        buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
    else:
        buf = memoryview(data).cast("B")
    if math.prod(dims) * DTYPES[dtype].bits % 8:
        raise ValueError(f"tensor {name!r}: {dtype} {dims} does not end at a byte boundary")
    expected = DTYPES[dtype].nbytes(math.prod(dims))
    if buf.nbytes != expected:
        raise ValueError(
            f"tensor {name!r}: {buf.nbytes} bytes of data but {dtype} {dims} takes {expected}"
        )
    return dtype, dims, buf


def build_header(
    tensors: Mapping[str, tuple[str, Sequence[int]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The header bytes ``save_safetensors`` writes for ``{name: (dtype, shape)}``.

    Returns the JSON header (padded, without the length prefix) and the tensor names in data
    order.
    """
    order = sorted(tensors, key=lambda n: (-_LAYOUT_RANK[tensors[n][0]], n))
    doc: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("metadata must map strings to strings")
        doc[METADATA_KEY] = dict(sorted(metadata.items()))
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        dims = [int(d) for d in shape]
        size = DTYPES[dtype].nbytes(math.prod(dims))
        doc[name] = {"dtype": dtype, "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header += b" " * (-len(header) % HEADER_ALIGN)
    return header, order


def save_safetensors(
    path: str | Path,
    tensors: Mapping[str, tuple[str, Sequence[int], bytes | np.ndarray]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``{name: (dtype, shape, data)}`` as a safetensors file, atomically.

    The layout matches the official writer byte for byte: tensors ordered by dtype rank
    (descending) then name, compact JSON, spaces up to a multiple of 8. Metadata keys are
    written sorted (the official writer uses a hash map, so its order varies per process).
    """
    path = file_path(path)
    prepared = {name: _tensor_bytes(name, value) for name, value in tensors.items()}
    header, order = build_header({n: (v[0], v[1]) for n, v in prepared.items()}, metadata)

    # Not tempfile.mkstemp: its 0600 mode would stick to the result; os.open honours the umask.
    # os.urandom, which secrets.token_hex reads too: importing secrets (and with it hmac and
    # OpenSSL's hashlib) would load them into every command for this one name.
    # Named as every temp of pulsectl (what a kill -9 leaves: docs/GUARANTEES.md).
    tmp_name = str(path.parent / f"{temp_prefix(path.name)}{os.urandom(8).hex()}")
    created = False
    out: BinaryIO | None = None
    try:
        # Created and marked as ours before an interrupt can stop this function.
        with interrupts_deferred():
            try:
                fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_BINARY, 0o666)
            except OSError as e:
                raise os_error(e, path) from None
            created = True
            out = os.fdopen(fd, "wb")
        with out as f:
            f.write(_LEN_PREFIX.pack(len(header)))
            f.write(header)
            for name in order:
                f.write(prepared[name][2])
        os.replace(tmp_name, path)
    except BaseException as e:
        discard(out, Path(tmp_name) if created else None)
        if isinstance(e, OSError):
            raise os_error(e, path) from None
        raise
