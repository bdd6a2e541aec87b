"""Checks that only damage or a crafted patch reaches, each pinned by its own failure: a
mutation audit removed each check in turn and no other test noticed. Two of them stood between
a block patch and a silently wrong checkpoint (the layout of BASE, and the patched tensors'
fingerprints)."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from _faultkit import parse_patch
from _native import pure_numpy
from safetensors.torch import save_file

from pulsectl import _zstd
from pulsectl.apply import apply_patches
from pulsectl.checkpoint import read_header, save_safetensors
from pulsectl.codecs import (
    CODEC_CONTEXT,
    CODEC_DELTA,
    CODEC_RICE,
    CODEC_RICE_PAIRED,
    check_block,
    context,
    decode_block,
    delta,
    patch_in_place,
    rice,
)
from pulsectl.codecs._bits import change_planes
from pulsectl.diff import DiffOptions, diff_to_path
from pulsectl.errors import CorruptPatchError, FormatError, IntegrityError
from pulsectl.format import (
    BLOCK_CHECK,
    BLOCK_HEAD,
    FOOTER,
    FRAME_HEAD,
    PatchWriter,
)
from pulsectl.info import read_patch_info
from pulsectl.synth import generate_chain


def _reseal_file(data: bytearray) -> None:
    at = len(data) - FOOTER.size + 8
    struct.pack_into("<Q", data, at, xxhash.xxh3_64_intdigest(bytes(data[:at])))


def _tensors(path: Path) -> dict:
    raw = path.read_bytes()
    return {t.name: (t.dtype, t.shape, raw[t.start : t.end]) for t in read_header(path).tensors}


def test_block_patch_refuses_a_base_with_another_layout(tmp_path: Path) -> None:
    """BASE with the patch's tensors plus one more, which shifts every offset: applied anyway,
    26 of 27 tensors of the output would be wrong and only the patched one verified."""
    chain = generate_chain(tmp_path / "c", "tiny", steps=1, lr=1e-3, seed=7)
    base = _tensors(chain[0])
    sel = sorted(base)[-1]
    p = tmp_path / "b.pulse"
    diff_to_path(chain[0], chain[1], p, options=DiffOptions(tensors=(sel,)))
    other = tmp_path / "other.safetensors"
    save_safetensors(other, {**base, "aaa.extra": ("F32", (16,), np.arange(16, dtype=np.float32))})
    with pytest.raises(IntegrityError, match="layout differ"):
        apply_patches(other, [p], tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_block_patch_with_a_consistent_but_wrong_payload_fails(tmp_path: Path) -> None:
    """A block patch's payload edited with valid checksums gives no output: the patched
    tensor's fingerprint (all a block patch can check) is compared."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 2**31, (4096,), generator=gen, dtype=torch.int32)
    save_file(
        {"w": torch.zeros(64), "noise": torch.zeros(4096, dtype=torch.int32)}, tmp_path / "a.st"
    )
    save_file({"w": torch.zeros(64), "noise": noise}, tmp_path / "b.st")
    p = tmp_path / "p.pulse"
    diff_to_path(tmp_path / "a.st", tmp_path / "b.st", p, options=DiffOptions(tensors=("noise",)))
    info = read_patch_info(p)
    index = [i.name for i in info.header.items].index("noise")
    frame = info.trailer.frames[index]
    data = bytearray(p.read_bytes())
    _, _, length = BLOCK_HEAD.unpack_from(data, frame + FRAME_HEAD.size)
    payload = frame + FRAME_HEAD.size + BLOCK_HEAD.size
    data[payload + length - 1] ^= 0x01  # the last byte: for store, zstd and delta codecs alike
    head = bytes(data[payload - BLOCK_HEAD.size : payload + length])
    BLOCK_CHECK.pack_into(data, payload + length, xxhash.xxh3_64_intdigest(head))
    _reseal_file(data)
    p.write_bytes(data)
    out = tmp_path / "out.st"
    with pytest.raises(IntegrityError):  # CorruptPatchError is one too: any refusal, no output
        apply_patches(tmp_path / "a.st", [p], out)
    assert not out.exists()


def _context_payload():
    rng = np.random.default_rng(4)
    old = rng.integers(0, 2**16, 1000, dtype=np.uint16).view(np.uint8)
    new = old.copy()
    new.view(np.uint16)[::29] += 1
    pos = np.flatnonzero(old.view(np.uint16) != new.view(np.uint16))
    payload, _ = context.encode(old, new, 2, pos, context.KEYS["BF16"], 3)
    return old, payload


@pytest.mark.parametrize("damage", ["count-sum", "duplicate-key"])
def test_context_table_damage_is_refused_both_ways(damage: str) -> None:
    """A context table whose counts do not add up, or whose keys repeat, is damage on both
    paths (the numpy one decoded repeated keys to wrong bytes, left to the fingerprints)."""
    old, payload = _context_payload()
    head = context._HEAD
    count, w, sh, bits, r1, nctx, r2 = head.unpack_from(payload, 0)
    (tlen,) = struct.unpack_from("<I", payload, head.size)
    table = bytearray(_zstd.decompress(payload[head.size + 4 : head.size + 4 + tlen], nctx * 7))
    keys = np.frombuffer(bytes(table[: 2 * nctx]), "<u2").copy()
    counts = np.frombuffer(bytes(table[3 * nctx :]), "<u4").copy()
    assert nctx >= 2
    if damage == "count-sum":
        counts[0] += 1
    else:
        keys[1] = keys[0]
    table[: 2 * nctx] = keys.astype("<u2").tobytes()
    table[3 * nctx :] = counts.astype("<u4").tobytes()
    packed = _zstd.compress(bytes(table), 3)
    bad = payload[: head.size] + struct.pack("<I", len(packed)) + packed
    bad += payload[head.size + 4 + tlen :]
    with pytest.raises(CorruptPatchError, match="table is damaged"):
        decode_block(CODEC_CONTEXT, bad, old, old.size, 2)
    with pure_numpy(), pytest.raises(CorruptPatchError, match="table is damaged"):
        decode_block(CODEC_CONTEXT, bad, old, old.size, 2)


@pytest.mark.parametrize("codec", [8, 9, 100, 255])
def test_every_unassigned_codec_id_is_unsupported(codec: int) -> None:
    """The first free id (8) is as unknown as 9: exit 1, "upgrade", not 3, "damaged"."""
    old = np.zeros(64, np.uint8)
    with pytest.raises(FormatError, match="unknown block codec"):
        decode_block(codec, b"", old, 64, 1)
    with pytest.raises(FormatError, match="unknown block codec"):
        check_block(codec, b"", 64, True)


def _small_patch(tmp_path: Path) -> tuple[Path, bytearray]:
    save_file({"w": torch.zeros(64)}, tmp_path / "a.st")
    save_file({"w": torch.ones(64)}, tmp_path / "b.st")
    p = tmp_path / "p.pulse"
    diff_to_path(tmp_path / "a.st", tmp_path / "b.st", p)
    return tmp_path / "a.st", bytearray(p.read_bytes())


def test_a_damaged_header_is_named_by_its_checksum(tmp_path: Path) -> None:
    """A header byte flipped (file checksum resealed) fails on the header checksum, before a
    reader that stops at the header (inspect) could show the damaged contents."""
    base, data = _small_patch(tmp_path)
    data[24 + 10] ^= 0x01
    _reseal_file(data)
    p = tmp_path / "bad.pulse"
    p.write_bytes(data)
    with pytest.raises(CorruptPatchError, match="header checksum mismatch"):
        read_patch_info(p)
    with pytest.raises(CorruptPatchError, match="header checksum mismatch"):
        apply_patches(base, [p], tmp_path / "out")


def test_unknown_preamble_flags_are_refused(tmp_path: Path) -> None:
    """Flags set by a writer (checksums valid) are refused, not ignored."""
    base, data = _small_patch(tmp_path)
    struct.pack_into("<H", data, 10, 1)
    _reseal_file(data)
    p = tmp_path / "flags.pulse"
    p.write_bytes(data)
    with pytest.raises(CorruptPatchError, match="unknown preamble flags"):
        apply_patches(base, [p], tmp_path / "out")


def test_a_block_length_past_any_payload_is_a_damaged_head(tmp_path: Path) -> None:
    """A block length near 4 GiB is refused as a damaged block head at once, not read until
    the patch 'ends early' (as if the download were cut)."""
    base, data = _small_patch(tmp_path)
    info = read_patch_info(tmp_path / "p.pulse")
    head_at = info.trailer.frames[0] + FRAME_HEAD.size
    codec, reserved, _ = BLOCK_HEAD.unpack_from(data, head_at)
    BLOCK_HEAD.pack_into(data, head_at, codec, reserved, 0xFFFFFF00)
    _reseal_file(data)
    p = tmp_path / "long.pulse"
    p.write_bytes(data)
    with pytest.raises(CorruptPatchError, match="block head of .* is damaged"):
        apply_patches(base, [p], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("codec", [CODEC_DELTA, CODEC_RICE, CODEC_RICE_PAIRED])
def test_a_delta_payloads_reserved_field_must_be_zero(codec: int) -> None:
    """Codecs 3, 5 and 6 carry a u16 that MUST be 0 (FORMAT.md): on every decoding path."""
    rng = np.random.default_rng(9)
    old = rng.integers(0, 2**16, 4096, dtype=np.uint16).view(np.uint8)
    new = old.copy()
    moved = rng.random(4096) < 0.1
    new.view(np.uint16)[moved] += rng.choice(np.array([1, 65535], np.uint16), int(moved.sum()))
    positions = np.flatnonzero(moved)
    values = change_planes(old, new, positions, 2, 3, pair=codec == CODEC_RICE_PAIRED)
    assert values.paired == (codec == CODEC_RICE_PAIRED)
    if codec == CODEC_DELTA:
        good = delta.encode(old, new, 2, positions, 3)
    else:
        good = rice.encode_moves(positions, None, 2, 3, values=values)
    assert decode_block(codec, good, old, old.size, 2).tobytes() == new.tobytes()
    bad = bytearray(good)
    bad[6] = 1  # the reserved u16
    for numpy_only in (False, True):
        with pure_numpy() if numpy_only else contextlib.nullcontext():
            with pytest.raises(CorruptPatchError, match="header is damaged"):
                decode_block(codec, bytes(bad), old, old.size, 2)
            work = old.copy()
            try:
                in_place = patch_in_place(codec, bytes(bad), work, 2)
            except CorruptPatchError as exc:
                assert "header is damaged" in str(exc)
            else:
                assert not in_place and work.tobytes() == old.tobytes()


def test_each_container_check_names_its_own_damage(tmp_path: Path) -> None:
    """Each field's check, with every checksum made to fit again, so that only that check can
    refuse it: a block head's reserved bytes, a frame head's block count, the footer's trailer
    offset, the trailer's frame index."""
    base, good = _small_patch(tmp_path)
    patch = tmp_path / "p.pulse"
    frame = read_patch_info(patch).trailer.frames[0]
    cases: dict[str, tuple[bytearray, str]] = {}

    data = bytearray(good)  # a reserved byte of the block head, block checksum refitted
    head = frame + FRAME_HEAD.size
    codec, _, length = BLOCK_HEAD.unpack_from(data, head)
    BLOCK_HEAD.pack_into(data, head, codec, b"\0\1\0", length)
    block = bytes(data[head : head + BLOCK_HEAD.size + length])
    BLOCK_CHECK.pack_into(data, head + BLOCK_HEAD.size + length, xxhash.xxh3_64_intdigest(block))
    cases["block head"] = (data, "block head of .* is damaged")

    data = bytearray(good)  # the frame says 2 blocks where the item has 1
    tag, item, nblocks, reserved = FRAME_HEAD.unpack_from(data, frame)
    FRAME_HEAD.pack_into(data, frame, tag, item, nblocks + 1, reserved)
    cases["frame head"] = (data, "frame head at byte .* is damaged")

    data = bytearray(good)  # the footer points 8 bytes before the trailer
    at = len(data) - FOOTER.size
    struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] - 8)
    cases["footer"] = (data, "file checksum mismatch")

    for what, (damaged, match) in cases.items():
        _reseal_file(damaged)
        bad = tmp_path / "bad.pulse"
        bad.write_bytes(bytes(damaged))
        with pytest.raises(CorruptPatchError, match=match):
            apply_patches(base, [bad], tmp_path / "out")
        assert not (tmp_path / "out").exists(), what

    # The trailer's frame index, written wrong by a writer with every checksum right.
    parts = parse_patch(bytes(good))
    bad = tmp_path / "bad.pulse"
    with bad.open("wb") as f:
        writer = PatchWriter(f, parts.header)
        for index, blocks in enumerate(parts.frames):
            writer.begin_frame(index, len(blocks))
            for codec, payload in blocks:
                writer.add_block(codec, payload)
        writer.frame_offsets[-1] += 1
        writer.finish(parts.trailer)
    with pytest.raises(CorruptPatchError, match="trailer frame index is damaged"):
        apply_patches(base, [bad], tmp_path / "out")
