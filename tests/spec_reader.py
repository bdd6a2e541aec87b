"""A second reader of `.pulse` v1 patches, written from docs/FORMAT.md alone (by a session that
had not read pulsectl's source), for tests/test_spec_reader.py: where it and pulsectl agree on
every patch, the document specifies what pulsectl writes. Keep it to the document: when the
format changes, change FORMAT.md first, then this reader from it, never from pulsectl's code.

Slow and plain on purpose (Python loops, whole files in memory): for small patches only.
Raises SpecError on anything the document says to reject.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass, field

import numpy as np
import xxhash
import zstandard

MAGIC = b"\x89PULSE\r\n"
END_MAGIC = b"PULSEEND"
TRAILER_TAG = b"PTRL"
FRAME_TAG = b"PFRM"
MiB = 1 << 20

# The 22 dtypes of FORMAT.md (Header, `items`): word width, and bits per element.
WORD = {}
BITS = {}
for _names, _word, _bits in (
    (("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"), 1, 8),
    (("F6_E2M3", "F6_E3M2"), 1, 6),
    (("F4",), 1, 4),
    (("F16", "BF16", "I16", "U16"), 2, 16),
    (("F32", "I32", "U32"), 4, 32),
    (("C64",), 4, 64),
    (("F64", "I64", "U64"), 8, 64),
):
    for _d in _names:
        WORD[_d], BITS[_d] = _word, _bits


class SpecError(Exception):
    pass


def req(cond, msg):
    if not cond:
        raise SpecError(msg)


def xxh64(b):
    return xxhash.xxh3_64_intdigest(b)


def fp(b):
    return xxhash.xxh3_128_hexdigest(b)


def zstd_frame(data: bytes, expected_size=None, max_size=None, require_content_size=True):
    """Decode exactly one zstd frame occupying all of `data`."""
    req(len(data) > 0, "empty zstd frame")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as e:
        raise SpecError(f"bad zstd frame: {e}") from e
    cs = params.content_size
    unknown = cs == zstandard.CONTENTSIZE_UNKNOWN or cs < 0 or cs == 2**64 - 1
    if require_content_size:
        req(not unknown, "zstd frame without content size")
    if expected_size is not None:
        req(cs == expected_size, f"zstd content size {cs} != expected {expected_size}")
    if max_size is not None:
        req(cs <= max_size, f"zstd content size {cs} > {max_size}")
    d = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = d.decompress(data)
    except zstandard.ZstdError as e:
        raise SpecError(f"bad zstd frame: {e}") from e
    req(d.eof, "truncated zstd frame")
    req(d.unused_data == b"", f"{len(d.unused_data)} bytes after zstd frame")
    req(len(out) == cs, "zstd frame decoded to a size other than its content size")
    return out


def parse_json(raw: bytes):
    try:
        obj = json.loads(raw.decode("utf-8"))
    except Exception as e:
        raise SpecError(f"bad JSON: {e}") from e
    req(isinstance(obj, dict), "JSON is not an object")
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return obj, canonical == raw


def check_path(p):
    req(isinstance(p, str), "path not a string")
    req(p != "", "empty path")
    req("\\" not in p, f"backslash in path {p!r}")
    req(not any(ord(c) < 0x20 or ord(c) == 0x7F for c in p), f"control char in path {p!r}")
    req(not p.startswith("/"), f"absolute path {p!r}")
    for comp in p.split("/"):
        req(comp not in ("", ".", ".."), f"bad path component in {p!r}")
        req(not comp.startswith("."), f"dot component in {p!r}")


# ---------------------------------------------------------------- safetensors headers


@dataclass
class STHeader:
    raw: bytes
    tensors: dict  # name -> (dtype, shape, begin, end)
    data_size: int

    @property
    def file_size(self):
        return 8 + len(self.raw) + self.data_size


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    req(len(set(keys)) == len(keys), "a key twice in a safetensors header")
    return dict(pairs)


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def parse_st_header(raw: bytes, strict_tiling=True) -> STHeader:
    """FORMAT.md, Header: a valid safetensors header, as the document defines one."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(f"bad safetensors header: {e}") from e
    req(isinstance(obj, dict), "safetensors header not an object")
    tensors = {}
    for name, t in obj.items():
        if name == "__metadata__":
            req(
                t is None or (isinstance(t, dict) and all(isinstance(v, str) for v in t.values())),
                "__metadata__ is neither an object of strings nor null",
            )
            continue
        req(isinstance(t, dict), f"entry of {name} not an object")
        req(all(k in t for k in ("dtype", "shape", "data_offsets")), f"entry of {name} lacks a key")
        dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
        req(dtype in WORD, f"unknown dtype {dtype}")
        req(
            isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape),
            f"shape of {name} is not a list of non-negative integers",
        )
        req(all(d < 2**64 for d in shape), f"a dimension of {name} is 2**64 or more")
        req(math.prod(shape) <= 2**64, f"shape of {name} has more than 2**64 elements")
        req(
            isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets),
            f"data_offsets of {name} are not two integers",
        )
        b, e = offsets
        req(0 <= b <= e, f"bad offsets for {name}")
        bits = math.prod(shape) * BITS[dtype]
        req(bits % 8 == 0, f"{name}: a sub-byte tensor that does not end at a byte boundary")
        req(bits // 8 == e - b, f"shape/size mismatch for {name}")
        tensors[name] = (dtype, shape, b, e)
    ranges = sorted((b, e, n) for n, (_, _, b, e) in tensors.items())
    pos = 0
    for b, e, _ in ranges:
        if strict_tiling:
            req(b == pos, f"tensors do not tile the data section (at {pos}, next {b})")
        pos = max(pos, e)
    return STHeader(raw, tensors, pos)


def read_st_file(path):
    with open(path, "rb") as f:
        data = f.read()
    req(len(data) >= 8, f"{path}: too short")
    (n,) = struct.unpack_from("<Q", data, 0)
    req(8 + n <= len(data), f"{path}: bad header length")
    h = parse_st_header(data[8 : 8 + n], strict_tiling=False)
    return h, data


# ---------------------------------------------------------------- checkpoints


def list_ckpt_files(root):
    """Files of a folder checkpoint: regular files and symlinks to files, no dot components."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for fn in filenames:
            if fn.startswith("."):
                continue
            full = os.path.join(dirpath, fn)
            if not os.path.isfile(full):
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            out.append(rel)
    out.sort()
    return out


def ckpt_fingerprint(path):
    if os.path.isdir(path):
        lines = []
        for rel in list_ckpt_files(path):
            with open(os.path.join(path, rel), "rb") as f:
                b = f.read()
            lines.append(f"{fp(b)} {len(b)} {rel}\n")
        return fp("".join(lines).encode("utf-8"))
    with open(path, "rb") as f:
        return fp(f.read())


def dir_fingerprint_from(files):  # files: list of (path, size, fingerprint) sorted by path
    return fp("".join(f"{f} {s} {p}\n" for p, s, f in files).encode("utf-8"))


# ---------------------------------------------------------------- bit streams


def bits_msb(data: bytes):
    a = np.unpackbits(np.frombuffer(data, dtype=np.uint8))  # MSB first
    return a


def read_unary(data: bytes, count: int):
    bits = bits_msb(data)
    zeros = np.flatnonzero(bits == 0)
    req(len(zeros) >= count, "unary stream has fewer than count 0-bits")
    zeros = zeros[:count]
    prev = np.concatenate([[-1], zeros[:-1]]) if count else np.zeros(0, dtype=np.int64)
    return (zeros - prev - 1).astype(np.int64)


def read_remainders(data: bytes, ks):
    total = int(sum(ks))
    req(len(data) == (total + 7) // 8, f"remainder stream {len(data)} bytes != ceil({total}/8)")
    bits = bits_msb(data)
    out = np.zeros(len(ks), dtype=np.int64)
    pos = 0
    for j, k in enumerate(ks):
        v = 0
        for _ in range(k):
            v = (v << 1) | int(bits[pos])
            pos += 1
        out[j] = v
    return out


# ---------------------------------------------------------------- codecs


class Cur:
    def __init__(self, b: bytes):
        self.b = b
        self.p = 0

    def take(self, n):
        req(self.p + n <= len(self.b), "payload truncated")
        r = self.b[self.p : self.p + n]
        self.p += n
        return r

    def u(self, fmt):
        s = struct.calcsize(fmt)
        return struct.unpack("<" + fmt, self.take(s))

    def left(self):
        return len(self.b) - self.p


def read_plane(cur, size, count):
    if size == 0:
        return np.zeros(count, dtype=np.uint8)
    # An all-zero plane stored as a frame is not what writers write, but still decodes.
    return np.frombuffer(zstd_frame(cur.take(size), expected_size=count), dtype=np.uint8)


def read_paired_plane0(cur, size, count):
    if size == 0:
        return np.zeros(count, dtype=np.uint8)
    sub = Cur(cur.take(size))
    (sb,) = sub.u("I")
    nsym = (count + 1) // 2
    syms = np.frombuffer(zstd_frame(sub.take(sb), expected_size=nsym), dtype=np.uint8)
    req(not (syms > 225).any(), "paired symbol > 225")
    E = int((syms == 225).sum())
    rest = sub.take(sub.left())
    if E == 0:
        req(rest == b"", "escape data present with no escapes")
        esc = b""
    else:
        esc = zstd_frame(rest, expected_size=2 * E)
    z = np.zeros(2 * nsym, dtype=np.uint8)
    e = 0
    for i, s in enumerate(syms):
        s = int(s)
        if s < 225:
            z[2 * i], z[2 * i + 1] = s // 15, s % 15
        else:
            a, b = esc[2 * e], esc[2 * e + 1]
            e += 1
            z[2 * i], z[2 * i + 1] = a, b
    if count % 2:
        req(z[count] == 0, "paired pad byte not 0")
    return z[:count]


def assemble(planes, count, nbytes_each):
    v = np.zeros(count, dtype=np.uint64)
    for k, pl in enumerate(planes[:nbytes_each]):
        v |= pl.astype(np.uint64) << np.uint64(8 * k)
    return v


def unzigzag(z, word):
    """z: uint64 array of zigzag values (word bytes). Return the signed s as unsigned mod 2^(8w)."""
    bits = 8 * word
    mask = (1 << bits) - 1
    out = []
    for zz in z.tolist():
        s = (zz >> 1) ^ -(zz & 1)  # python ints: signed value
        out.append(s & mask)
    return out


def apply_changes(old: bytes, word: int, positions, z):
    n = len(old)
    req(n % word == 0, "block length not a multiple of word")
    dt = {1: np.uint8, 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}[word]
    arr = np.frombuffer(old, dtype=dt).copy()
    mask = (1 << (8 * word)) - 1
    for p, d in zip(positions, unzigzag(z, word), strict=True):
        arr[p] = (int(arr[p]) + d) & mask
    return arr.tobytes()


def check_zigzag_range(z, word):
    if word < 8:
        req(not (z >> np.uint64(8 * word)).any(), "zigzag value too wide")


def decode_codec3(payload, old, word):
    cur = Cur(payload)
    count, gap_bytes, w, res = cur.u("IBBH")
    n = len(old)
    req(res == 0, "codec3 reserved != 0")
    req(w == word, f"codec3 word {w} != item word {word}")
    req(1 <= gap_bytes <= 4, "gap_bytes out of range")
    req(1 <= count <= n // word, "codec3 count out of range")
    sizes = cur.u("I" * (gap_bytes + word))
    req(sum(sizes) == cur.left(), "plane sizes do not add up to the rest of the payload")
    planes = [read_plane(cur, s, count) for s in sizes]
    gaps = assemble(planes[:gap_bytes], count, gap_bytes).astype(np.int64)
    z = assemble(planes[gap_bytes:], count, word)
    pos = np.cumsum(gaps + 1) - 1
    req(int(pos[-1]) < n // word, "codec3 position out of block")
    return apply_changes(old, word, pos.tolist(), z)


def read_streams(cur, word):
    """Codecs 4-7: the unary and remainder streams and the value planes' sizes."""
    (ub,) = cur.u("I")
    unary = cur.take(ub)
    (rb,) = cur.u("I")
    rem = cur.take(rb)
    sizes = cur.u("I" * word)
    req(sum(sizes) == cur.left(), "plane sizes do not add up")
    return unary, rem, sizes


def read_value_planes(cur, sizes, count, word, paired):
    """Codecs 4-7: the zigzag values from the value planes (plane 0 paired in 6 and 7)."""
    planes = []
    for i, s in enumerate(sizes):
        if i == 0 and paired:
            planes.append(read_paired_plane0(cur, s, count))
        else:
            planes.append(read_plane(cur, s, count))
    z = assemble(planes, count, word)
    check_zigzag_range(z, word)
    return z


def decode_codec5(payload, old, word, paired=False):
    cur = Cur(payload)
    count, w, k, res = cur.u("IBBH")
    n = len(old)
    req(res == 0, "codec5 reserved != 0")
    req(w == word, "codec5 word mismatch")
    req(0 <= k <= 31, "rice_k out of range")
    req(1 <= count <= n // word, "codec5 count out of range")
    unary, rem, sizes = read_streams(cur, word)
    q = read_unary(unary, count)  # bits after the count-th 0-bit do not matter
    r = read_remainders(rem, [k] * count)  # nor do the padding bits
    gaps = (q << k) | r
    z = read_value_planes(cur, sizes, count, word, paired)
    pos = np.cumsum(gaps + 1) - 1
    req(int(pos[-1]) < n // word, "codec5 position out of block")
    return apply_changes(old, word, pos.tolist(), z)


def decode_codec4(payload, old, word, paired=False):
    cur = Cur(payload)
    count, w, shift, kbits, res1, C, res2 = cur.u("IBBBBHH")
    n = len(old)
    nw = n // word
    req(res1 == 0 and res2 == 0, "codec4 reserved != 0")
    req(w == word, "codec4 word mismatch")
    req(1 <= kbits <= 16 and shift + kbits <= 8 * word, "codec4 key_shift/key_bits out of range")
    req(1 <= count <= nw, "codec4 count out of range")
    req(1 <= C <= min(count, 1 << kbits), "codec4 contexts out of range")
    (tb,) = cur.u("I")
    table = zstd_frame(cur.take(tb), expected_size=7 * C)
    keys = np.frombuffer(table[: 2 * C], dtype="<u2").astype(np.int64)
    ks = np.frombuffer(table[2 * C : 3 * C], dtype=np.uint8).astype(np.int64)
    ch = np.frombuffer(table[3 * C : 7 * C], dtype="<u4").astype(np.int64)
    req((np.diff(keys) > 0).all(), "context keys not strictly ascending")
    req((keys < (1 << kbits)).all(), "context key exceeds key_bits")
    req((ks <= 31).all(), "context rice_k > 31")
    req((ch >= 1).all() and int(ch.sum()) == count, "context change counts bad")
    unary, rem, sizes = read_streams(cur, word)
    q = read_unary(unary, count)
    per_change_k = np.repeat(ks, ch)
    r = read_remainders(rem, per_change_k.tolist())
    gaps = (q << per_change_k) | r
    z = read_value_planes(cur, sizes, count, word, paired)
    # keys of base words
    dt = {1: np.uint8, 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}[word]
    basew = np.frombuffer(old, dtype=dt).astype(np.uint64)
    wkeys = ((basew >> np.uint64(shift)) & np.uint64((1 << kbits) - 1)).astype(np.int64)
    positions = []
    j = 0
    for key, c in zip(keys.tolist(), ch.tolist(), strict=True):
        members = np.flatnonzero(wkeys == key)  # ascending position = rank order
        rank = -1
        for _ in range(c):
            rank = rank + int(gaps[j]) + 1
            req(rank < len(members), f"codec4 rank {rank} >= {len(members)} words with key {key}")
            positions.append(int(members[rank]))
            j += 1
    return apply_changes(old, word, positions, z)


def decode_block(codec, payload, old, n, word, has_base):
    if codec == 0:
        req(has_base, "copy block without base")
        req(payload == b"", "copy block with payload")
        return old
    if codec == 1:
        req(len(payload) == n, "store payload length != n")
        return payload
    if codec == 2:
        return zstd_frame(payload, expected_size=n)
    req(codec in (3, 4, 5, 6, 7), f"unknown block codec {codec}")
    req(has_base, f"codec {codec} without base")
    if codec == 3:
        return decode_codec3(payload, old, word)
    if codec == 5:
        return decode_codec5(payload, old, word)
    if codec == 6:
        return decode_codec5(payload, old, word, paired=True)
    if codec == 4:
        return decode_codec4(payload, old, word)
    if codec == 7:
        return decode_codec4(payload, old, word, paired=True)


# ---------------------------------------------------------------- container


@dataclass
class Patch:
    raw: bytes
    header: dict
    trailer: dict
    frames: list  # per item: list of (codec, payload, offset)
    frame_offsets: list
    header_canonical: bool
    trailer_canonical: bool
    target_headers: dict = field(default_factory=dict)  # file index -> STHeader


def _need(obj, what, *keys):
    """FORMAT.md: every field shown is required (``scope``, ``loco`` and a null base's
    ``base_fingerprint`` aside)."""
    req(isinstance(obj, dict), f"{what} is not an object")
    for key in keys:
        req(key in obj, f"{what}: missing field {key!r}")


def parse_patch(raw: bytes) -> Patch:
    req(len(raw) >= 24 + 8 + 24, "too short")
    req(raw[:8] == MAGIC, "bad magic")
    version, flags, hlen, hsum = struct.unpack_from("<HHIQ", raw, 8)
    req(version == 1, f"unknown version {version}")
    req(flags == 0, "flags != 0")
    req(hlen <= 64 * MiB, "header too long")
    hbytes = raw[24 : 24 + hlen]
    req(len(hbytes) == hlen, "truncated header")
    req(xxh64(hbytes) == hsum, "header checksum mismatch")
    header, hcanon = parse_json(zstd_frame(hbytes, max_size=256 * MiB))
    pos = 24 + hlen

    H = header
    _need(H, "header", "layout", "block_bytes", "writer", "base", "files", "items")
    req(isinstance(H["writer"], str), "header: writer is not a string")
    _need(H["base"], "header base", "fingerprint", "files")
    for f in H["base"]["files"]:
        _need(f, "a base file", "path", "size", "fingerprint")
    for f in H["files"]:
        _need(
            f,
            "a target file",
            "path",
            "kind",
            "header" if f.get("kind") == "safetensors" else "size",
        )
    for it in H["items"]:
        _need(it, "an item", "file", "name", "nbytes", "word", "base")
        if it["base"] is not None:
            _need(it["base"], "an item's base", "file", "name")
            _need(it, "an item", "base_fingerprint")
    layout = H["layout"]
    req(layout in ("file", "dir"), "bad layout")
    bb = H["block_bytes"]
    req(isinstance(bb, int) and bb % 8 == 0 and 4096 <= bb <= 268435456, "bad block_bytes")
    scope = H.get("scope", "checkpoint")
    req(scope in ("checkpoint", "tensors"), "bad scope")
    bfiles = H["base"]["files"]
    files = H["files"]
    items = H["items"]
    for lst in (bfiles, files):
        paths = [f["path"] for f in lst]
        req(paths == sorted(paths) and len(set(paths)) == len(paths), "files not sorted/unique")
        if layout == "file":
            req(paths == [""], "layout file must have one file with path ''")
        else:
            for p in paths:
                check_path(p)

    # target headers and item check
    tgt_headers = {}
    expected_items = []  # (file, name, nbytes, word)
    for fi, f in enumerate(files):
        if f["kind"] == "safetensors":
            h = parse_st_header(f["header"].encode("utf-8"), strict_tiling=True)
            tgt_headers[fi] = h
            order = sorted(h.tensors.items(), key=lambda kv: (kv[1][2], kv[1][3], kv[0]))
            for name, (dt, _shape, b, e) in order:
                expected_items.append((fi, name, e - b, WORD[dt]))
        else:
            req(f["kind"] == "blob", "bad file kind")
            req(isinstance(f["size"], int) and f["size"] >= 0, "bad blob size")
            expected_items.append((fi, None, f["size"], 1))
    if scope == "checkpoint":
        got = [(it["file"], it["name"], it["nbytes"], it["word"]) for it in items]
        req(got == expected_items, "items do not match target headers")
    else:
        req(len(items) >= 1, "block patch without items")
        got = [(it["file"], it["name"], it["nbytes"], it["word"]) for it in items]
        # subsequence check
        it_e = iter(expected_items)
        req(all(any(g == e for e in it_e) for g in got), "block patch items not a subsequence")
        for it in items:
            req(it["base"] is not None and it["name"] is not None, "block patch item without base")
    for it in items:
        req(
            (it["base"] is None) == (it.get("base_fingerprint") is None),
            "base_fingerprint present iff base",
        )
        if it["base"] is not None:
            req(0 <= it["base"]["file"] < len(bfiles), "base file index out of range")

    # frames
    frames = []
    offsets = []
    for i, it in enumerate(items):
        req(raw[pos : pos + 4] == FRAME_TAG, f"frame {i}: bad tag at {pos}")
        offsets.append(pos)
        idx, nblocks, res = struct.unpack_from("<III", raw, pos + 4)
        req(idx == i, "frame item index mismatch")
        req(nblocks == -(-it["nbytes"] // bb), "frame block count mismatch")
        req(res == 0, "frame reserved != 0")
        pos += 16
        blocks = []
        for _ in range(nblocks):
            head = raw[pos : pos + 8]
            req(len(head) == 8, "truncated block head")
            codec = head[0]
            req(head[1:4] == b"\0\0\0", "block reserved != 0")
            (plen,) = struct.unpack_from("<I", head, 4)
            req(plen <= bb + MiB, "payload too long")
            payload = raw[pos + 8 : pos + 8 + plen]
            req(len(payload) == plen, "truncated payload")
            (cs,) = struct.unpack_from("<Q", raw, pos + 8 + plen)
            req(xxh64(head + payload) == cs, "block checksum mismatch")
            blocks.append((codec, payload))
            pos += 8 + plen + 8
        frames.append(blocks)

    # trailer
    trailer_offset = pos
    req(raw[pos : pos + 4] == TRAILER_TAG, "bad trailer tag")
    (tlen,) = struct.unpack_from("<I", raw, pos + 4)
    req(tlen <= 64 * MiB, "trailer too long")
    tbytes = raw[pos + 8 : pos + 8 + tlen]
    req(len(tbytes) == tlen, "truncated trailer")
    trailer, tcanon = parse_json(zstd_frame(tbytes, max_size=256 * MiB))
    pos += 8 + tlen
    req(len(raw) - pos == 24, f"footer: {len(raw) - pos} bytes after trailer (want 24)")
    toff, fsum = struct.unpack_from("<QQ", raw, pos)
    req(raw[pos + 16 : pos + 24] == END_MAGIC, "bad END_MAGIC")
    req(toff == trailer_offset, "trailer_offset mismatch")
    req(xxh64(raw[: pos + 8]) == fsum, "file checksum mismatch")

    # trailer structure
    _need(trailer, "trailer", "target", "items", "frames")
    _need(trailer["target"], "trailer target", "fingerprint", "files")
    for f in trailer["target"]["files"]:
        _need(f, "a trailer file", "path", "size", "fingerprint")
    for r in trailer["items"]:
        _need(r, "a trailer item", "fingerprint", "changed", "encoded")
    tf = trailer["target"]["files"]
    req([(f["path"]) for f in tf] == [f["path"] for f in files], "trailer file paths differ")
    for f, hf in zip(tf, files, strict=True):
        size = tgt_headers[files.index(hf)].file_size if hf["kind"] == "safetensors" else hf["size"]
        req(f["size"] == size, f"trailer size of {hf['path']!r} {f['size']} != header's {size}")
    req(len(trailer["items"]) == len(items), "trailer items count")
    for r, it in zip(trailer["items"], items, strict=True):
        changed, encoded = r.get("changed"), r.get("encoded")
        req(_is_int(changed) and 0 <= changed <= it["nbytes"] // it["word"], "trailer: bad changed")
        req(_is_int(encoded) and encoded >= 0, "trailer: bad encoded")
    req(trailer["frames"] == offsets, f"trailer frames {trailer['frames']} != actual {offsets}")
    return Patch(raw, header, trailer, frames, offsets, hcanon, tcanon, tgt_headers)


# ---------------------------------------------------------------- apply


class Base:
    def __init__(self, path, layout):
        self.path = path
        self.layout = layout
        self.cache = {}

    def file_bytes(self, relpath):
        if relpath not in self.cache:
            full = self.path if self.layout == "file" else os.path.join(self.path, relpath)
            with open(full, "rb") as f:
                self.cache[relpath] = f.read()
        return self.cache[relpath]

    def files(self):
        if self.layout == "file":
            return [""]
        return list_ckpt_files(self.path)

    def tensor(self, relpath, name):
        data = self.file_bytes(relpath)
        (n,) = struct.unpack_from("<Q", data, 0)
        h = parse_st_header(data[8 : 8 + n], strict_tiling=False)
        req(name in h.tensors, f"base has no tensor {name!r} in {relpath!r}")
        _, _, b, e = h.tensors[name]
        return data[8 + n + b : 8 + n + e]


def decode_item(P, it, blocks, base_bytes):
    bb = P.header["block_bytes"]
    out = []
    for i, (codec, payload) in enumerate(blocks):
        lo, hi = i * bb, min((i + 1) * bb, it["nbytes"])
        old = base_bytes[lo:hi] if base_bytes is not None else None
        nb = decode_block(codec, payload, old, hi - lo, it["word"], base_bytes is not None)
        req(len(nb) == hi - lo, "block decoded to wrong length")
        out.append(nb)
    return b"".join(out)


def apply_patch(base_path, patch_raw, out_path, check_base_fp=False):
    P = parse_patch(patch_raw)
    H, T = P.header, P.trailer
    layout = H["layout"]
    scope = H.get("scope", "checkpoint")
    base = Base(base_path, layout)
    bfiles = H["base"]["files"]
    have = set(base.files())
    for f in bfiles:
        req(f["path"] in have, f"base lacks file {f['path']!r}")
    req(have == {f["path"] for f in bfiles}, "base has a file that base.files does not list")
    if check_base_fp and scope == "checkpoint":
        req(ckpt_fingerprint(base_path) == H["base"]["fingerprint"], "base fingerprint mismatch")

    def base_item(it):
        if it["base"] is None:
            return None
        bp = bfiles[it["base"]["file"]]["path"]
        if it["base"]["name"] is None:
            b = base.file_bytes(bp)
        else:
            b = base.tensor(bp, it["base"]["name"])
        req(len(b) == it["nbytes"], "base item size mismatch")
        req(
            fp(b) == it["base_fingerprint"],
            f"base tensor {it['base']['name']!r} fingerprint {fp(b)} != {it['base_fingerprint']}",
        )
        return b

    decoded = []
    for i, it in enumerate(H["items"]):
        d = decode_item(P, it, P.frames[i], base_item(it))
        req(fp(d) == T["items"][i]["fingerprint"], f"item {i} ({it['name']}) fingerprint mismatch")
        decoded.append(d)

    outputs = {}  # path -> bytes
    if scope == "checkpoint":
        for fi, f in enumerate(H["files"]):
            parts = []
            if f["kind"] == "safetensors":
                hr = f["header"].encode("utf-8")
                parts.append(struct.pack("<Q", len(hr)) + hr)
            for it, d in zip(H["items"], decoded, strict=True):
                if it["file"] == fi:
                    parts.append(d)
            outputs[f["path"]] = b"".join(parts)
    else:
        # block patch: target files are base files, items replaced
        for fi, f in enumerate(H["files"]):
            data = bytearray(base.file_bytes(f["path"]))
            if f["kind"] == "safetensors":
                (n,) = struct.unpack_from("<Q", data, 0)
                req(
                    bytes(data[8 : 8 + n]) == f["header"].encode("utf-8"),
                    f"base header of {f['path']!r} differs",
                )
                h = P.target_headers[fi]
                for it, d in zip(H["items"], decoded, strict=True):
                    if it["file"] == fi:
                        _, _, b, e = h.tensors[it["name"]]
                        data[8 + n + b : 8 + n + e] = d
            outputs[f["path"]] = bytes(data)

    # verify
    tfiles = T["target"]["files"]
    for tf in tfiles:
        b = outputs[tf["path"]]
        if scope == "checkpoint":
            req(len(b) == tf["size"], "file size mismatch")
            req(fp(b) == tf["fingerprint"], f"file {tf['path']!r} fingerprint mismatch")
    if scope == "checkpoint":
        if layout == "file":
            cfp = fp(outputs[""])
        else:
            cfp = dir_fingerprint_from([(p, len(b), fp(b)) for p, b in sorted(outputs.items())])
        req(cfp == T["target"]["fingerprint"], "checkpoint fingerprint mismatch")

    # write
    if layout == "file":
        with open(out_path, "wb") as f:
            f.write(outputs[""])
    else:
        if os.path.exists(out_path):
            shutil.rmtree(out_path)
        for p, b in outputs.items():
            full = os.path.join(out_path, p)
            os.makedirs(os.path.dirname(full) or out_path, exist_ok=True)
            with open(full, "wb") as f:
                f.write(b)
    return P
