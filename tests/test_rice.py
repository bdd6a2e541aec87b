"""Codec 5 (Rice-coded gaps): exact round trips, and damaged payloads fail cleanly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsectl.codecs import CODEC_RICE_PAIRED, decode_block, encode_block, rice
from pulsectl.errors import CorruptPatchError

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@settings(max_examples=150, deadline=None)
@given(
    word=st.sampled_from([1, 2, 4, 8]),
    nwords=st.integers(1, 3000),
    density=st.sampled_from([0.0005, 0.01, 0.2, 1.0]),
    big=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip(word, nwords, density, big, seed):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    mask = rng.random(nwords) < density
    mask[rng.integers(0, nwords)] = True
    positions = np.flatnonzero(mask)
    utype = _UINT[word]
    moves = (
        rng.integers(1, 2**63, positions.size, dtype=np.uint64).astype(utype)
        if big
        else np.where(rng.random(positions.size) < 0.5, utype(1), utype(np.iinfo(utype).max))
    )
    moves[moves == 0] = 1
    new = old.copy()
    new.view(utype)[positions] += moves
    payload = rice.encode_moves(positions, moves, word, 3)
    got_pos, got_moves = rice.decode_moves(payload, word, nwords)
    assert np.array_equal(got_pos, positions) and np.array_equal(got_moves, moves)
    assert np.array_equal(rice.decode(old, payload, word), new)


def test_encoder_picks_rice_for_scattered_unit_moves():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 65536, 1 << 20, dtype=np.uint16)
    new = old.copy()
    mask = rng.random(old.size) < 0.01
    new[mask] += np.where(rng.random(int(mask.sum())) < 0.5, 1, 0xFFFF).astype(np.uint16)
    enc = encode_block(old.view(np.uint8), new.view(np.uint8), 2, 3)
    assert enc.codec == CODEC_RICE_PAIRED  # codec 5 with one-unit moves paired up
    assert len(enc.payload) < 1.3 * mask.sum()  # ~8.1 bits of position, ~1.0 of value
    assert np.array_equal(
        decode_block(enc.codec, enc.payload, old.view(np.uint8), old.nbytes, 2), new.view(np.uint8)
    )


@pytest.mark.parametrize("cut", [0, 3, 8, 11, -5, -1])
def test_truncated_payload_is_corrupt(cut):
    old = np.zeros(4096, dtype=np.uint8)
    new = old.copy()
    new[::97] = 1
    payload = rice.encode_moves(np.flatnonzero(new), new[new != 0].astype(np.uint8), 1, 3)
    with pytest.raises(CorruptPatchError):
        rice.decode(old, payload[:cut] if cut >= 0 else payload[:cut], 1)


def test_positions_past_the_block_are_corrupt():
    payload = rice.encode_moves(np.array([10, 4000]), np.array([1, 1], dtype=np.uint8), 1, 3)
    with pytest.raises(CorruptPatchError, match="past the end"):
        rice.decode(np.zeros(100, dtype=np.uint8), payload, 1)


def test_any_damaged_byte_is_an_error_or_a_block_of_the_right_size():
    rng = np.random.default_rng(3)
    old = rng.integers(0, 256, 2000, dtype=np.uint8)
    new = old.copy()
    new.view(np.uint16)[::23] += 1
    positions = np.flatnonzero(old.view(np.uint16) != new.view(np.uint16))
    payload = rice.encode_moves(positions, np.ones(positions.size, np.uint16), 2, 3)
    assert np.array_equal(rice.decode(old, payload, 2), new)
    for i in range(len(payload)):
        damaged = bytearray(payload)
        damaged[i] ^= 0x5A
        try:
            got = rice.decode(old, bytes(damaged), 2)
        except CorruptPatchError:
            continue
        assert got.size == new.size


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 31),
    count=st.integers(0, 300),
    seed=st.integers(0, 2**32 - 1),
)
def test_fixed_width_bits_round_trip(k, count, seed):
    from pulsectl.codecs._bits import pack_fixed, unpack_bits, unpack_fixed

    rng = np.random.default_rng(seed)
    values = rng.integers(0, 1 << k, count, dtype=np.int64) if k else np.zeros(count, np.int64)
    data = pack_fixed(values, k)
    assert len(data) == (count * k + 7) // 8
    # MSB first, as the general variable-width reader reads them
    assert np.array_equal(unpack_bits(memoryview(data), np.full(count, k, np.int64)), values)
    assert np.array_equal(unpack_fixed(memoryview(data), count, k), values)
    if data:
        with pytest.raises(CorruptPatchError):
            unpack_fixed(memoryview(data[:-1]), count, k)


@pytest.mark.parametrize("layout", ["runs", "stride"])
def test_clustered_changes_fall_back_to_codec_3(layout):
    """Rows of consecutive changes or a fixed stride are far from geometric gaps: codec 3's
    zstd planes code them in a fraction of what one Rice parameter can."""
    from pulsectl.codecs import CODEC_DELTA

    rng = np.random.default_rng(2)
    old = rng.integers(0, 65536, 1 << 20, dtype=np.uint16)
    new = old.copy()
    if layout == "runs":  # 64 whole rows of 512 words each, at random rows
        rows = rng.choice(old.size // 512, 64, replace=False)
        positions = (rows[:, None] * 512 + np.arange(512)).ravel()
    else:  # one column of a 96-wide matrix
        positions = np.arange(5, old.size, 96)
    positions = np.sort(positions)
    new[positions] += np.uint16(1)
    enc = encode_block(old.view(np.uint8), new.view(np.uint8), 2, 3)
    assert enc.codec == CODEC_DELTA
    rice_only = rice.encode_moves(positions, np.ones(positions.size, np.uint16), 2, 3)
    assert len(enc.payload) < 0.5 * len(rice_only)
    assert np.array_equal(
        decode_block(enc.codec, enc.payload, old.view(np.uint8), old.nbytes, 2), new.view(np.uint8)
    )
