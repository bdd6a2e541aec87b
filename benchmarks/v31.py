"""The PULSESync "sparse codec v3.1" layout, rebuilt from its description, as a size baseline.

Per tensor (viewed 2-D; a 1-D tensor is 1 x n, a scalar 1 x 1) the changed BF16 words as COO
indices in lexsorted (row, col) order:
  - row gaps (row minus the previous changed element's row; the first from row 0) as the
    smallest of uint8 / uint16 / int32 that holds them all;
  - columns: the absolute column where a new row starts, else the gap from the previous column
    in that row, as uint16 or int32;
  - the new words themselves (raw BF16 bits, uint16).
Buffer: u32 little-endian JSON length, the JSON header (per tensor: name, shape, count, index
dtypes), then each tensor's rows, cols, values; all of it one zstd frame at level 1.

``decode_and_check`` rebuilds every target tensor from the base and the buffer and compares
it word for word with the target, so the reported size is that of a working lossless encoding.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import zstandard

VERSION = 31
ZSTD_LEVEL = 1
_LEN = struct.Struct("<I")
_ROW_DTYPES = ("uint8", "uint16", "int32")
_COL_DTYPES = ("uint16", "int32")


@dataclass(frozen=True)
class Pair:
    """One tensor of the base and the target as uint16 words (memory maps are fine)."""

    name: str
    shape: tuple[int, ...]
    old: np.ndarray
    new: np.ndarray


def _view_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) <= 1:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def _smallest(values: np.ndarray, names: tuple[str, ...]) -> str:
    top = int(values.max()) if values.size else 0
    for name in names:
        if top <= np.iinfo(np.dtype(name)).max:
            return name
    raise ValueError(f"index {top} does not fit int32")


def encode_tensor(pair: Pair) -> tuple[dict[str, object], list[bytes]]:
    """Header entry and (rows, cols, values) byte strings for one tensor."""
    _, ncols = _view_2d(pair.shape)
    # flatnonzero lists the changes in row-major order, which is the layout's lexsorted COO
    # order already: sorting them again would only add time (decode_and_check checks it).
    flat = np.flatnonzero(pair.old != pair.new)
    rows, cols = np.divmod(flat, ncols)
    row_gaps = np.diff(rows, prepend=0)
    new_row = np.ones(rows.size, dtype=bool)
    new_row[1:] = row_gaps[1:] != 0
    col_gaps = np.diff(cols, prepend=0)
    col_field = np.where(new_row, cols, col_gaps)
    row_dtype = _smallest(row_gaps, _ROW_DTYPES)
    col_dtype = _smallest(col_field, _COL_DTYPES)
    values = np.ascontiguousarray(pair.new[flat], dtype="<u2")
    entry = {
        "name": pair.name,
        "shape": list(pair.shape),
        "num_nonzero": int(flat.size),
        "value_dtype": "bfloat16",
        "row_dtype": row_dtype,
        "col_dtype": col_dtype,
    }
    chunks = [
        row_gaps.astype(np.dtype(row_dtype).newbyteorder("<")).tobytes(),
        col_field.astype(np.dtype(col_dtype).newbyteorder("<")).tobytes(),
        values.tobytes(),
    ]
    return entry, chunks


def encode(pairs: Iterator[Pair]) -> bytes:
    """The compressed v3.1 buffer for all tensors (sorted by name, as the layout stores them)."""
    entries: dict[str, tuple[dict[str, object], list[bytes]]] = {}
    for pair in pairs:
        entries[pair.name] = encode_tensor(pair)
    names = sorted(entries)
    header = json.dumps(
        {"version": VERSION, "tensors": [entries[n][0] for n in names]}, separators=(",", ":")
    ).encode()
    cobj = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj()
    out = [cobj.compress(_LEN.pack(len(header)) + header)]
    for name in names:
        for chunk in entries[name][1]:
            out.append(cobj.compress(chunk))
    out.append(cobj.flush())
    return b"".join(out)


def decode(buffer: bytes) -> Iterator[tuple[str, tuple[int, ...], np.ndarray, np.ndarray]]:
    """Yield (name, shape, flat positions, new words) per tensor."""
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(buffer)
    (hlen,) = _LEN.unpack_from(raw, 0)
    header = json.loads(raw[4 : 4 + hlen])
    if header["version"] != VERSION:
        raise ValueError(f"not a v3.1 buffer (version {header['version']})")
    at = 4 + hlen
    for t in header["tensors"]:
        n = t["num_nonzero"]
        arrays = []
        for dtype in (t["row_dtype"], t["col_dtype"], "uint16"):
            dt = np.dtype(dtype).newbyteorder("<")
            arrays.append(np.frombuffer(raw, dtype=dt, count=n, offset=at))
            at += n * dt.itemsize
        row_gaps, col_field, values = arrays
        shape = tuple(t["shape"])
        _, ncols = _view_2d(shape)
        rows = np.cumsum(row_gaps, dtype=np.int64)
        new_row = np.ones(n, dtype=bool)
        new_row[1:] = row_gaps[1:] != 0
        # Columns: a running sum of the field that restarts at each new row.
        run = np.cumsum(col_field, dtype=np.int64)
        starts = np.flatnonzero(new_row)
        offset = run[starts] - col_field[starts]
        seg = np.cumsum(new_row) - 1
        cols = run - offset[seg] if n else run
        yield t["name"], shape, rows * ncols + cols, values
    if at != len(raw):
        raise ValueError(f"{len(raw) - at} trailing bytes in the v3.1 buffer")


def decode_and_check(buffer: bytes, pairs: dict[str, Pair]) -> int:
    """Rebuild every target tensor from base + buffer; raise unless all match. Returns count."""
    seen = set()
    total = 0
    for name, _shape, positions, values in decode(buffer):
        pair = pairs[name]
        rebuilt = np.array(pair.old, copy=True)
        rebuilt[positions] = values
        if not np.array_equal(rebuilt, pair.new):
            raise AssertionError(f"v3.1 decode of {name} does not reproduce the target")
        seen.add(name)
        total += positions.size
    missing = set(pairs) - seen
    if missing:
        raise AssertionError(f"v3.1 buffer lacks tensors: {sorted(missing)[:5]}")
    return total


def measure(pairs: dict[str, Pair]) -> dict[str, float | int]:
    """Encode (timed: the best of up to 3 runs, as pulsectl's commands get their best), decode
    and check; sizes and times."""
    times: list[float] = []
    while len(times) < 3 and sum(times) < 30:
        t0 = time.perf_counter()
        buffer = encode(iter(pairs.values()))
        times.append(time.perf_counter() - t0)
    encode_s = min(times)
    t0 = time.perf_counter()
    changed = decode_and_check(buffer, pairs)
    check_s = time.perf_counter() - t0
    return {
        "bytes": len(buffer),
        "changed": changed,
        "encode_s": encode_s,
        "decode_check_s": check_s,
    }
