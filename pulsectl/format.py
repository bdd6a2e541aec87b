"""The .pulse container, version 1: the only module that knows byte offsets.

docs/FORMAT.md is the normative description; the constants below mirror it.

    preamble   MAGIC | u16 version | u16 flags | u32 header length | u64 xxh3-64 of header
    header     one zstd frame of canonical JSON (what the patch turns into what)
    frames     one per item (tensor or blob), in item order; each holds the item's blocks
    trailer    TRAILER_TAG | u32 length | one zstd frame of canonical JSON (target fingerprints...)
    footer     u64 trailer offset | u64 xxh3-64 of every byte before this field | END_MAGIC
"""

from __future__ import annotations

import io
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash
import zstandard

from pulsectl import _zstd
from pulsectl.errors import CorruptPatchError, FormatError, InputError, UsageError

MAGIC = b"\x89PULSE\r\n"
STDIN_NAME = "<stdin>"  # how messages name a patch read from standard input
END_MAGIC = b"PULSEEND"
FORMAT_VERSION = 1
FRAME_TAG = b"PFRM"
TRAILER_TAG = b"PTRL"

PREAMBLE = struct.Struct("<8sHHIQ")  # magic, version, flags, header length, header checksum
FRAME_HEAD = struct.Struct("<4sIII")  # tag, item index, block count, reserved
BLOCK_HEAD = struct.Struct("<B3sI")  # codec, reserved, payload length
BLOCK_CHECK = struct.Struct("<Q")  # xxh3-64 of the block head and payload
TRAILER_HEAD = struct.Struct("<4sI")  # tag, trailer length
FOOTER = struct.Struct("<QQ8s")  # trailer offset, file checksum, END_MAGIC

MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_TRAILER_BYTES = 64 * 1024 * 1024
MIN_BLOCK_BYTES = 4096
MAX_BLOCK_BYTES = 256 * 1024 * 1024
DEFAULT_BLOCK_BYTES = 8 * 1024 * 1024
BLOCK_PAYLOAD_SLACK = 1024 * 1024  # a payload may exceed block_bytes by at most this much
MAX_JSON_BYTES = 256 * 1024 * 1024  # decompressed header or trailer
# The header and trailer JSON. Level 19 took 75 ms on the 94 KB header of a 290-tensor
# checkpoint, a tenth of a sparse 1 GB diff; level 15 takes 16 ms for 1% more bytes (9,393
# against 9,305; level 9: 11,692 bytes). Past LARGE_JSON_BYTES (a few thousand tensors) the
# levels differ little in size but a lot in time: on the 6.0 MB header of 20,000 tensors,
# level 15 took 260 ms for 683,704 bytes, level 3 14 ms for 699,590 (2.3% more).
JSON_ZSTD_LEVEL = 15
LARGE_JSON_BYTES = 1024 * 1024
LARGE_JSON_ZSTD_LEVEL = 3


def _looks_like(start: bytes) -> str:
    """A hint for a file given where a patch was expected: a safetensors file starts with
    its header's length (8 bytes, little-endian) and then its JSON header."""
    if start[8:9] == b"{" and 2 <= int.from_bytes(start[:8], "little") < 1 << 32:
        return "; it looks like a safetensors file"
    return ""


def canonical_json(obj: Any) -> bytes:
    """The one JSON spelling pulsectl writes: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def blocks_in(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


class PatchWriter:
    """Writes a .pulse stream: header, then frames block by block, then trailer and footer."""

    def __init__(self, stream: BinaryIO, header: dict[str, Any]) -> None:
        self._stream = stream
        self._hash = xxhash.xxh3_64()
        self.offset = 0
        self.frame_offsets: list[int] = []
        body = _pack_json(header)
        if len(body) > MAX_HEADER_BYTES:
            raise FormatError(f"patch header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
        checksum = xxhash.xxh3_64_intdigest(body)
        self._write(PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, len(body), checksum))
        self._write(body)

    def _write(self, data: bytes | memoryview) -> None:
        self._stream.write(data)
        self._hash.update(data)
        self.offset += len(data)

    def begin_frame(self, item: int, nblocks: int) -> None:
        self.frame_offsets.append(self.offset)
        self._write(FRAME_HEAD.pack(FRAME_TAG, item, nblocks, 0))

    def add_block(self, codec: int, payload: bytes) -> int:
        """Write one block; returns the bytes it took."""
        head = BLOCK_HEAD.pack(codec, b"\0\0\0", len(payload))
        check = xxhash.xxh3_64()
        check.update(head)
        check.update(payload)
        self._write(head)
        self._write(payload)
        self._write(BLOCK_CHECK.pack(check.intdigest()))
        return BLOCK_HEAD.size + len(payload) + BLOCK_CHECK.size

    def finish(self, trailer: dict[str, Any]) -> None:
        body = _pack_json({**trailer, "frames": self.frame_offsets})
        trailer_offset = self.offset
        self._write(TRAILER_HEAD.pack(TRAILER_TAG, len(body)))
        self._write(body)
        head = struct.pack("<Q", trailer_offset)
        self._write(head)
        checksum = self._hash.intdigest()
        self._stream.write(struct.pack("<Q", checksum) + END_MAGIC)
        self.offset += 16


@dataclass(frozen=True)
class Block:
    codec: int
    payload: bytes


PatchSource = str | Path | BinaryIO

_stdin: tuple[object, BinaryIO] | None = None  # (the sys.stdin it reads, the reader)


def standard_input() -> BinaryIO:
    """Standard input, through a buffered reader of pulsectl's own rather than
    ``sys.stdin.buffer``.

    A patch arriving over a pipe is read on a thread of its own (``_io.overlapped_map``). An
    interrupt while that thread waits inside a read leaves it there, holding its reader's lock;
    if that reader were ``sys.stdin.buffer``, the interpreter would close it on the way out,
    fail to take the lock and abort ("Fatal Python error", exit 134 instead of 130). Nothing
    closes this one at exit, and it leaves descriptor 0 open. A ``sys.stdin`` without a
    descriptor (a caller's in-memory stream) is read as it is.
    """
    global _stdin
    if _stdin is not None and _stdin[0] is sys.stdin:
        return _stdin[1]
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return sys.stdin.buffer
    reader = io.BufferedReader(io.FileIO(fd, "rb", closefd=False), buffer_size=1 << 20)
    _stdin = (sys.stdin, reader)
    return reader


def refuse_terminal_input() -> None:
    """UsageError when standard input, about to be read for a patch ('-'), is a terminal: as
    zstd does, since a forgotten '|' would otherwise wait, silent, for typed bytes."""
    try:
        terminal = bool(sys.stdin.isatty())
    except (AttributeError, OSError, ValueError):
        terminal = False
    if terminal:
        raise UsageError(
            "refusing to read a binary patch from a terminal; pipe one in "
            "(... | pulsectl ... -) or give its path"
        )


def open_patch(source: PatchSource, stdin: BinaryIO | None = None) -> tuple[PatchReader, BinaryIO]:
    """Open a patch file, ``-`` (standard input) or a binary stream and read its header."""
    if isinstance(source, (str, Path)):
        if str(source) == "-":
            if stdin is None:
                refuse_terminal_input()
            stream = stdin or standard_input()
            name = STDIN_NAME
        else:
            try:
                stream = open(source, "rb")  # noqa: SIM115 - closed by the caller
            except OSError as exc:
                raise InputError(
                    f"{source}: cannot open patch: {exc.strerror}", path=source
                ) from exc
            name = str(source)
    else:
        stream, name = source, getattr(source, "name", "<stream>")
    return PatchReader(stream, str(name)), stream


class PatchReader:
    """Reads a .pulse stream front to back; every read is bounded and checked.

    ``header`` is the parsed header JSON (validated by pulsectl.patch). Frames are read with
    ``read_frame`` and ``read_block`` in order, then ``read_trailer`` checks the file checksum.
    """

    def __init__(self, stream: BinaryIO, name: str) -> None:
        if isinstance(stream, io.TextIOBase):  # its reads are str, decoded (found in review)
            raise UsageError(f"{name}: the patch is open in text mode; open it with 'rb'")
        self._stream = stream
        self.name = name
        self._hash = xxhash.xxh3_64()
        self.offset = 0
        pre = self._read(PREAMBLE.size, "preamble", allow_short_magic=True)
        magic, version, flags, header_len, checksum = PREAMBLE.unpack(pre)
        if magic != MAGIC:
            raise FormatError(
                f"{name}: not a .pulse patch (bad magic){_looks_like(pre)}", path=name
            )
        if version != FORMAT_VERSION:
            raise FormatError(
                f"{name}: .pulse version {version} is not supported by this pulsectl "
                f"(reads version {FORMAT_VERSION}); upgrade pulsectl",
                path=name,
            )
        if flags:
            raise CorruptPatchError(f"{name}: unknown preamble flags {flags:#x}", path=name)
        if header_len > MAX_HEADER_BYTES:
            raise CorruptPatchError(
                f"{name}: header length {header_len} exceeds {MAX_HEADER_BYTES}", path=name
            )
        body = self._read(header_len, "header")
        if xxhash.xxh3_64_intdigest(body) != checksum:
            raise CorruptPatchError(f"{name}: header checksum mismatch (patch damaged)", path=name)
        self.header_bytes = body
        self.header: dict[str, Any] = _load_json(body, name, "header")
        self.frame_offsets: list[int] = []

    @classmethod
    def at_frame(cls, stream: BinaryIO, name: str, offset: int) -> PatchReader:
        """A reader positioned at the frame at ``offset`` of a seekable patch (random access).

        Block checksums are verified as usual; the whole-file checksum is not (read the patch
        front to back for that).
        """
        reader = cls.__new__(cls)
        reader._stream = stream
        reader.name = name
        reader._hash = xxhash.xxh3_64()
        reader.offset = offset
        reader.frame_offsets = []
        stream.seek(offset)
        return reader

    def _read(self, n: int, what: str, allow_short_magic: bool = False) -> bytes:
        data = _read_exact(self._stream, n)
        if len(data) != n:
            if allow_short_magic and not data.startswith(MAGIC[: len(data)]):
                raise FormatError(
                    f"{self.name}: not a .pulse patch (bad magic){_looks_like(data)}",
                    path=self.name,
                )
            if allow_short_magic and not data:
                hint = (
                    "no patch bytes arrived (did the command that writes it fail?)"
                    if self.name == STDIN_NAME
                    else "0 bytes, no patch in it"
                )
                raise CorruptPatchError(f"{self.name}: empty: {hint}", path=self.name)
            raise CorruptPatchError(
                f"{self.name}: patch ends early in the {what} at byte {self.offset + len(data)} "
                "(truncated download or interrupted pipe?)",
                path=self.name,
            )
        self._hash.update(data)
        self.offset += n
        return data

    def read_frame(self, item: int, nblocks: int) -> None:
        """Read the frame head for ``item`` and check it promises ``nblocks`` blocks."""
        self.frame_offsets.append(self.offset)
        tag, got_item, got_blocks, reserved = FRAME_HEAD.unpack(
            self._read(FRAME_HEAD.size, f"frame of item {item}")
        )
        if tag != FRAME_TAG or got_item != item or got_blocks != nblocks or reserved:
            raise CorruptPatchError(
                f"{self.name}: frame head at byte {self.frame_offsets[-1]} is damaged "
                f"(expected item {item} with {nblocks} blocks)",
                path=self.name,
            )

    def read_block(self, max_payload: int, where: str) -> Block:
        head = self._read(BLOCK_HEAD.size, where)
        codec, reserved, length = BLOCK_HEAD.unpack(head)
        if reserved != b"\0\0\0" or length > max_payload:
            raise CorruptPatchError(
                f"{self.name}: block head of {where} is damaged", path=self.name
            )
        payload = self._read(length, where)
        (expected,) = BLOCK_CHECK.unpack(self._read(BLOCK_CHECK.size, where))
        check = xxhash.xxh3_64()
        check.update(head)
        check.update(payload)
        if check.intdigest() != expected:
            raise CorruptPatchError(
                f"{self.name}: checksum mismatch in {where} (patch damaged)", path=self.name
            )
        return Block(codec, payload)

    def read_trailer(self) -> dict[str, Any]:
        """Read trailer and footer, check the whole-file checksum and the end of the stream."""
        trailer_offset = self.offset
        tag, length = TRAILER_HEAD.unpack(self._read(TRAILER_HEAD.size, "trailer"))
        if tag != TRAILER_TAG or length > MAX_TRAILER_BYTES:
            raise CorruptPatchError(f"{self.name}: trailer is damaged", path=self.name)
        body = self._read(length, "trailer")
        (stated_offset,) = struct.unpack("<Q", self._read(8, "footer"))
        checksum = self._hash.intdigest()
        rest = _read_exact(self._stream, 16)
        if len(rest) != 16:
            raise CorruptPatchError(
                f"{self.name}: patch ends early in the footer (truncated?)", path=self.name
            )
        got_checksum, end = struct.unpack("<Q8s", rest)
        if end != END_MAGIC or stated_offset != trailer_offset or got_checksum != checksum:
            raise CorruptPatchError(
                f"{self.name}: file checksum mismatch (patch damaged)", path=self.name
            )
        if _read_exact(self._stream, 1):
            raise CorruptPatchError(
                f"{self.name}: unexpected bytes after the end of the patch", path=self.name
            )
        trailer = _load_json(body, self.name, "trailer")
        if trailer.get("frames") != self.frame_offsets:
            raise CorruptPatchError(f"{self.name}: trailer frame index is damaged", path=self.name)
        return trailer


def read_trailer_at_end(stream: BinaryIO, name: str) -> dict[str, Any]:
    """Read only the trailer of a seekable patch (the file checksum needs a full read)."""
    end = stream.seek(0, 2)
    if end < PREAMBLE.size + FOOTER.size:
        raise CorruptPatchError(f"{name}: too short to be a .pulse patch", path=name)
    stream.seek(end - FOOTER.size)
    trailer_offset, _, magic = FOOTER.unpack(_read_exact(stream, FOOTER.size))
    if magic != END_MAGIC or trailer_offset > end - FOOTER.size - TRAILER_HEAD.size:
        raise CorruptPatchError(
            f"{name}: patch has no valid footer (truncated or damaged)", path=name
        )
    stream.seek(trailer_offset)
    tag, length = TRAILER_HEAD.unpack(_read_exact(stream, TRAILER_HEAD.size))
    if tag != TRAILER_TAG or trailer_offset + TRAILER_HEAD.size + length + FOOTER.size != end:
        raise CorruptPatchError(f"{name}: trailer is damaged", path=name)
    return _load_json(_read_exact(stream, length), name, "trailer")


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if data is None:
        data = b""
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pack_json(obj: Any) -> bytes:
    raw = canonical_json(obj)
    large = len(raw) > LARGE_JSON_BYTES
    return _zstd.compress(raw, LARGE_JSON_ZSTD_LEVEL if large else JSON_ZSTD_LEVEL)


def _load_json(body: bytes, name: str, what: str) -> dict[str, Any]:
    try:
        size = zstandard.get_frame_parameters(body).content_size
    except zstandard.ZstdError as exc:
        raise CorruptPatchError(f"{name}: {what} is damaged ({exc})", path=name) from exc
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise CorruptPatchError(
            f"{name}: {what} is damaged (its zstd frame does not state its size)", path=name
        )
    if not 0 < size <= MAX_JSON_BYTES:
        raise CorruptPatchError(f"{name}: {what} claims {size} bytes of JSON", path=name)
    try:
        text = _zstd.decompress(body, size)
    except CorruptPatchError as exc:
        raise CorruptPatchError(f"{name}: {what} is damaged ({exc})", path=name) from exc
    try:
        obj = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: bad JSON, or an integer of more than 4300 digits; RecursionError: nesting.
        raise CorruptPatchError(f"{name}: {what} is not valid JSON ({exc})", path=name) from exc
    if not isinstance(obj, dict):
        raise CorruptPatchError(f"{name}: {what} is not a JSON object", path=name)
    return obj
