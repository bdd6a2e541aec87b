"""Codecs 6 and 7: value plane 0 in pairs. The pairing loops against numpy, round trips on every
word width with adversarial moves, damaged paired planes, and when the encoder pairs."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _native import pure_numpy, simd_modes
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsectl import _zstd
from pulsectl.codecs import (
    CODEC_CONTEXT,
    CODEC_CONTEXT_PAIRED,
    CODEC_DELTA,
    CODEC_RICE,
    CODEC_RICE_PAIRED,
    _fast,
    context,
    decode_block,
    decode_moves,
    encode_block,
    patch_in_place,
    plain_codec,
)
from pulsectl.codecs._bits import (
    PAIR_ESCAPE,
    PAIR_SMALL,
    change_planes,
    pair_plane,
    paired_plane,
    unpack_paired_plane,
    unpair_plane,
)
from pulsectl.errors import CorruptPatchError

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
KEYS = {1: (3, 4), 2: context.KEYS["BF16"], 4: context.KEYS["F32"], 8: context.KEYS["F64"]}


def both(fn: Callable[[], Any]) -> list[Any]:
    """``fn()`` with the compiled loops (where built; their AVX-512 versions, where this CPU
    has them, then the portable ones), then with numpy."""
    out = [fn() for _ in simd_modes()] if _fast.native is not None else []
    with pure_numpy():
        out.append(fn())
    return out


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CorruptPatchError:
        return "corrupt"


# Low zigzag bytes as Adam steps make them (mostly 1 and 2), with rarer larger ones.
low_bytes = st.lists(
    st.one_of(st.sampled_from([1, 2, 1, 2, 3, 4, 0]), st.integers(0, 255)), max_size=600
).map(lambda xs: bytes(xs))


@settings(max_examples=300, deadline=None)
@given(low_bytes)
def test_pairing_round_trips_and_the_loops_agree(plane: bytes) -> None:
    expected = _spelled_out(plane)  # 15 a + b for two small bytes, else an escape and both
    for got in both(lambda: pair_plane(plane)):
        assert got == expected
    symbols, escapes = expected
    assert len(symbols) == (len(plane) + 1) // 2
    for restored in both(lambda: unpair_plane(symbols, escapes, len(plane))):
        assert restored == plane


@settings(max_examples=200, deadline=None)
@given(low_bytes, st.integers(0, 3))
def test_damaged_pairs_are_refused_alike(plane: bytes, damage: int) -> None:
    symbols, escapes = pair_plane(plane)
    count = len(plane)
    if damage == 0:  # an escape too few, or one where no pair escaped
        escapes = escapes[:-2] if escapes else b"\1\1"
        expect_corrupt = True
    elif damage == 1:  # a symbol above the escape
        if not symbols:
            return
        symbols = bytes([PAIR_ESCAPE + 1]) + symbols[1:]
        expect_corrupt = True
    elif damage == 2:  # a nonzero pad byte after an odd plane
        if count % 2 == 0:
            return
        last = symbols[-1]
        if last == PAIR_ESCAPE:
            escapes = escapes[:-1] + b"\7"
        else:
            symbols = symbols[:-1] + bytes([last - last % PAIR_SMALL + 3])
        expect_corrupt = True
    else:  # a symbol too many
        symbols = symbols + b"\0"
        expect_corrupt = True
    got = both(lambda: outcome(lambda: unpair_plane(symbols, escapes, count)))
    assert all(g == got[0] for g in got)
    assert (got[0] == "corrupt") == expect_corrupt


def _spelled_out(plane: bytes) -> tuple[bytes, bytes]:
    """The paired form by its definition, one pair at a time."""
    padded = plane + bytes(len(plane) % 2)
    symbols, escapes = bytearray(), bytearray()
    for a, b in zip(padded[0::2], padded[1::2], strict=True):
        if a < PAIR_SMALL and b < PAIR_SMALL:
            symbols.append(PAIR_SMALL * a + b)
        else:
            symbols.append(PAIR_ESCAPE)
            escapes += bytes([a, b])
    return bytes(symbols), bytes(escapes)


@pytest.mark.parametrize("size", [199, 200, 1001])
def test_pairing_at_the_boundaries_on_every_road(size: int) -> None:
    """Bytes just below and at the pairing bound (14, 15) and far above it, and symbols just
    below, at and above the escape (224, 225, 226, 255), at every offset of the vector loops'
    groups and of the portable loops' eight-pair steps, and at the end of the plane."""
    for value in (14, 15, 16, 127, 128, 255):
        for at in [0, 1, 15, 16, 17, 62, 63, 64, 65, size - 2, size - 1]:
            plane = bytearray(np.tile(np.array([1, 2, 2, 1, 0], np.uint8), size)[:size])
            plane[at] = value
            plane = bytes(plane)
            expected = _spelled_out(plane)
            for got in both(lambda plane=plane: pair_plane(plane)):
                assert got == expected, (value, at)
            for restored in both(lambda e=expected: unpair_plane(*e, size)):
                assert restored == plane, (value, at)
    symbols, escapes = _spelled_out(bytes(size))
    for value in (224, 225, 226, 255):
        for at in [0, 1, 7, 8, 31, 32, 33, len(symbols) - 1]:
            damaged = bytearray(symbols)
            damaged[at] = value
            extra = b"\3\4" if value == PAIR_ESCAPE else b""
            outcomes = both(
                lambda d=bytes(damaged), x=escapes + extra: outcome(
                    lambda: unpair_plane(d, x, size)
                )
            )
            # the last symbol of an odd plane also holds the pad byte, which must be 0
            pad = value % PAIR_SMALL if value < PAIR_ESCAPE else extra[-1:] != b"\0"
            if value > PAIR_ESCAPE or (size % 2 and at == len(symbols) - 1 and pad):
                assert outcomes == ["corrupt"] * len(outcomes), (value, at)
            else:
                assert all(o == outcomes[0] != "corrupt" for o in outcomes), (value, at)


def test_paired_form_round_trips_with_and_without_escapes() -> None:
    rng = np.random.default_rng(0)
    unit = rng.choice(np.array([1, 2], dtype=np.uint8), 10_001)
    mixed = unit.copy()
    mixed[::97] = 200  # a few escapes
    for plane in (unit, mixed):
        packed = paired_plane(memoryview(plane), 3)
        assert packed is not None
        (nsym,) = struct.unpack_from("<I", packed)
        has_escapes = bool(np.any(plane >= PAIR_SMALL))
        assert (len(packed) > 4 + nsym) == has_escapes
        for restored in both(
            lambda packed=packed, plane=plane: unpack_paired_plane(memoryview(packed), plane.size)
        ):
            assert restored == plane.tobytes()
        # and it beats the plain form by about a third here (two symbols of 1 bit -> 1 of 2)
        assert len(packed) < 0.8 * len(_zstd.compress_plane(plane, 3))


def test_pairing_is_skipped_where_it_does_not_pay() -> None:
    rng = np.random.default_rng(1)
    assert paired_plane(memoryview(np.zeros(5000, np.uint8)), 3) is None  # all zero: size 0
    noise = rng.integers(0, 256, 20_000, dtype=np.uint8)  # most pairs would escape
    assert paired_plane(memoryview(noise), 3) is None
    tiny = np.array([2], dtype=np.uint8)  # a length and a frame cost more than they save
    assert paired_plane(memoryview(tiny), 3) is None


def test_damaged_paired_plane_streams_are_corrupt() -> None:
    plane = np.tile(np.array([1, 2, 2, 1, 40], dtype=np.uint8), 2001)
    packed = paired_plane(memoryview(plane), 3)
    assert packed is not None
    (nsym,) = struct.unpack_from("<I", packed)
    no_escapes = paired_plane(memoryview(np.tile(np.array([1, 2], np.uint8), 5000)), 3)
    assert no_escapes is not None
    cases = [
        (packed[:-1], plane.size),  # escape frame cut
        (packed[: 4 + nsym], plane.size),  # escape frame missing
        (packed, plane.size + 2),  # one symbol more than the frame holds
        (struct.pack("<I", nsym + 1) + packed[4:], plane.size),  # symbols length wrong
        (no_escapes + b"\0", 10_000),  # bytes after the symbols with no escape
        (no_escapes[:3], 10_000),  # shorter than its length
        (no_escapes + _zstd.compress_plane(b"", 3), 10_000),  # an empty escape frame
        (no_escapes + _zstd.compress_plane(b"\1\1" * 5001, 3), 10_000),  # more than 2 a symbol
        (no_escapes + _zstd.compress_plane(b"\1\1", 3), 10_000),  # escapes but no escape symbol
    ]
    for data, count in cases:
        for got in both(
            lambda d=data, c=count: outcome(lambda: unpack_paired_plane(memoryview(d), c))
        ):
            assert got == "corrupt"


def _moves(rng: np.random.Generator, word: int, n: int, kind: str) -> np.ndarray:
    utype = UINT[word]
    unit = np.where(rng.random(n) < 0.5, 1, -1).astype(np.int64).astype(utype)
    if kind == "unit":
        return unit
    if kind == "escapes":  # a tenth of the moves large: escapes in both bytes
        big = rng.random(n) < 0.1
        unit[big] = rng.integers(1, 2 ** min(8 * word, 63), int(big.sum()), dtype=np.uint64)
        return unit
    assert kind == "extremes"  # the largest moves of either sign, among unit moves
    unit[::7] = utype(2 ** (8 * word - 1))
    unit[3::7] = utype(2 ** (8 * word - 1) - 1)
    return unit


@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["unit", "escapes", "extremes"])
@pytest.mark.parametrize("where", ["spread", "keyed", "end", "all"])
@pytest.mark.parametrize("context_key", [False, True])
def test_paired_codecs_round_trip_every_width(
    word: int, kind: str, where: str, context_key: bool
) -> None:
    """Blocks whose value plane 0 pairs (one-unit moves, with escapes, with the extremes),
    changes spread out, on words with small keys, only at the end of the block, or on every
    word; on floats' keys (``--level max``) too. The block must decode byte for byte by every
    road."""
    rng = np.random.default_rng(word * 7 + len(kind) + len(where))
    utype = UINT[word]
    nwords = 30_000
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    old.view(utype)[:] >>= utype(1)  # fewer keys, as in real weights
    if word >= 2:  # NaN and Inf patterns among the base words
        top = utype((1 << (8 * word - 1)) - 1)
        old.view(utype)[::101] = top  # NaN with every payload bit set
    keys = context.keys_of(old, word, KEYS[word])
    at = {
        "spread": np.flatnonzero(rng.random(nwords) < 0.2),
        # half the words with the smallest keys (exponents): where the context codec wins
        "keyed": np.flatnonzero((keys < np.quantile(keys, 0.3)) & (rng.random(nwords) < 0.5)),
        "end": np.arange(nwords - 2000, nwords),
        "all": np.arange(nwords),
    }[where]
    new = old.copy()
    new.view(utype)[at] += _moves(rng, word, at.size, kind)
    key = KEYS[word] if context_key else None
    enc = encode_block(old, new, word, 9 if context_key else 3, key)
    plain, paired = plain_codec(enc.codec)
    if kind == "unit" and where == "spread":
        # codec 6 or 7 (the changes do not follow the base's exponents here: either may win)
        assert paired and plain in (CODEC_CONTEXT, CODEC_RICE)
    if kind == "unit" and where == "keyed" and word < 8:  # F64's 2048 keys cost a large table
        assert enc.codec == (CODEC_CONTEXT_PAIRED if context_key else CODEC_RICE_PAIRED)
    for got in both(lambda: decode_block(enc.codec, enc.payload, old, new.size, word)):
        assert got.tobytes() == new.tobytes()
    in_place = old.copy()
    if patch_in_place(enc.codec, enc.payload, in_place, word):
        assert in_place.tobytes() == new.tobytes()
    moves = decode_moves(enc.codec, enc.payload, old, word)
    if moves is not None:
        out = old.copy()
        positions, moved = moves
        out.view(utype)[positions] += moved.astype(utype)
        assert out.tobytes() == new.tobytes()


def test_paired_and_plain_twins_decode_to_the_same_words() -> None:
    """The same changes written with plane 0 plain (codec 5, 4) and paired (6, 7): one block."""
    rng = np.random.default_rng(5)
    old = (rng.normal(0, 0.02, 50_000).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    at = np.flatnonzero(rng.random(old.size) < 0.05)
    new[at] += np.where(rng.random(at.size) < 0.5, 1, 0xFFFF).astype(np.uint16)
    old8, new8 = old.view(np.uint8), new.view(np.uint8)
    plain, plain_paired = context.encode(old8, new8, 2, at, KEYS[2], 3, pair=False)
    paired, paired_paired = context.encode(old8, new8, 2, at, KEYS[2], 3, pair=True)
    assert (plain_paired, paired_paired) == (False, True)
    assert len(paired) < len(plain)
    for codec, payload in ((CODEC_CONTEXT, plain), (CODEC_CONTEXT_PAIRED, paired)):
        assert decode_block(codec, payload, old8, old8.size, 2).tobytes() == new8.tobytes()
    # a paired payload read as its plain twin does not pass for it
    assert outcome(lambda: decode_block(CODEC_CONTEXT, paired, old8, old8.size, 2)) == "corrupt"
    block = encode_block(old8, new8, 2, 3)
    assert block.codec == CODEC_RICE_PAIRED
    assert outcome(lambda: decode_block(CODEC_RICE, block.payload, old8, old8.size, 2)) == (
        "corrupt"
    )


def test_codec_3_gets_plain_planes_when_the_rice_candidate_was_paired() -> None:
    """Runs of one-unit moves: the gaps are far from geometric, so codec 3 is tried beside the
    paired Rice candidate, and wins; it has no paired form, so its plane 0 is compressed plain
    again (``Planes.plain``) and the block decodes byte for byte."""
    rng = np.random.default_rng(3)
    old = rng.integers(0, 65536, 200_000, dtype=np.uint16)
    new = old.copy()
    for start in range(0, old.size, 1000):
        new[start : start + 300] += rng.choice(np.array([1, 0xFFFF], np.uint16), 300)
    old8, new8 = old.view(np.uint8), new.view(np.uint8)
    at = np.flatnonzero(old != new)
    assert change_planes(old8, new8, at, 2, 3, pair=True).paired  # the Rice candidate's planes
    enc = encode_block(old8, new8, 2, 3)
    assert enc.codec == CODEC_DELTA
    for got in both(lambda: decode_block(enc.codec, enc.payload, old8, old8.size, 2)):
        assert got.tobytes() == new8.tobytes()
