"""Block codecs: encode_block/decode_block round trips, adversarial blocks and size bounds."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsectl._dtypes import DTYPES
from pulsectl.codecs import (
    CODEC_CONTEXT,
    CODEC_CONTEXT_PAIRED,
    CODEC_COPY,
    CODEC_DELTA,
    CODEC_RICE,
    CODEC_RICE_PAIRED,
    CODEC_STORE,
    CODEC_ZSTD,
    DELTA_CODECS,
    EncodedBlock,
    context,
    decode_block,
    delta,
    encode_block,
    patch_in_place,
)
from pulsectl.errors import CorruptPatchError, FormatError

WORDS = (1, 2, 4, 8)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
LEVEL = 3
# No context key, then the context codec's keys (exponent fields) that fit each word width.
KEYS_BY_WORD = {
    w: [None, *(k for d, k in sorted(context.KEYS.items()) if DTYPES[d].word == w)] for w in WORDS
}


def _roundtrip(
    old: np.ndarray | None, new: np.ndarray, word: int, key: tuple[int, int] | None = None
) -> int:
    """Encode, check the size bound, decode, compare; returns the codec used."""
    enc = encode_block(old, new, word, LEVEL, key)
    assert len(enc.payload) <= len(new)
    got = decode_block(enc.codec, enc.payload, old, new.size, word)
    assert got.dtype == np.uint8
    assert got.tobytes() == new.tobytes()
    if old is None:
        assert enc.changed == new.size // word
    else:
        assert enc.changed == int(np.count_nonzero(old.view(UINT[word]) != new.view(UINT[word])))
    return enc.codec


def _arr(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)


@st.composite
def block_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    word = draw(st.sampled_from(WORDS))
    nwords = draw(st.integers(1, 700))
    old = _arr(draw(st.binary(min_size=nwords * word, max_size=nwords * word)))
    new = old.copy()
    kind = draw(st.sampled_from(["random", "sparse", "same"]))
    if kind == "random":
        new = _arr(draw(st.binary(min_size=nwords * word, max_size=nwords * word)))
    elif kind == "sparse":
        for pos in draw(st.lists(st.integers(0, nwords - 1), max_size=20)):
            new[pos * word : (pos + 1) * word] = list(draw(st.binary(min_size=word, max_size=word)))
    return old, new, word


@settings(max_examples=300, deadline=None)
@given(block_pairs(), st.data())
def test_roundtrip_hypothesis(
    pair: tuple[np.ndarray, np.ndarray, int], data: st.DataObject
) -> None:
    old, new, word = pair
    key = data.draw(st.sampled_from(KEYS_BY_WORD[word]))
    _roundtrip(old, new, word, key)
    _roundtrip(None, new, word, key)


@settings(max_examples=200, deadline=None)
@given(block_pairs(), st.data())
def test_context_codec_roundtrip(
    pair: tuple[np.ndarray, np.ndarray, int], data: st.DataObject
) -> None:
    """Codecs 4 and 7 on their own (encode_block picks one only when it is the smallest)."""
    old, new, word = pair
    key = data.draw(st.sampled_from(KEYS_BY_WORD[word][1:]))
    positions = np.flatnonzero(old.view(UINT[word]) != new.view(UINT[word]))
    if positions.size == 0:
        return
    pair_up = data.draw(st.booleans())
    payload, paired = context.encode(old, new, word, positions, key, LEVEL, pair_up)
    assert paired <= pair_up
    got = decode_block(
        CODEC_CONTEXT_PAIRED if paired else CODEC_CONTEXT, payload, old, new.size, word
    )
    assert got.tobytes() == new.tobytes()


def _base(word: int, nwords: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nwords * word, dtype=np.uint8)


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("nwords", [1, 3, 8, 513, 4096 // 1])
def test_adversarial_blocks(word: int, nwords: int) -> None:
    old = _base(word, nwords)
    words = old.view(UINT[word])
    top = UINT[word](1 << (8 * word - 1))
    cases = {
        "identical": old.copy(),
        "all changed": (~words).view(np.uint8),
        "all +1": (words + UINT[word](1)).view(np.uint8),
        "wraparound": (words + top + UINT[word](7)).view(np.uint8),
        "max minus": (words - UINT[word](1)).view(np.uint8),
    }
    single = words.copy()
    single[nwords // 2] ^= UINT[word](1)
    cases["single change"] = single.view(np.uint8)
    end = words.copy()
    end[-1] += UINT[word](1)
    cases["only the end"] = end.view(np.uint8)
    start = words.copy()
    start[0] = ~start[0]
    cases["only the start"] = start.view(np.uint8)
    for name, new in cases.items():
        for key in KEYS_BY_WORD[word][:2]:
            _roundtrip(old, np.ascontiguousarray(new), word, key)
        codec = _roundtrip(old, np.ascontiguousarray(new), word)
        if name == "identical":
            assert codec == CODEC_COPY
        elif name in ("single change", "only the end") and nwords >= 64:
            assert codec in (CODEC_DELTA, CODEC_RICE, CODEC_RICE_PAIRED), name


@pytest.mark.parametrize(
    ("word", "patterns"),
    [
        (2, [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7C00, 0x7E00, 0xFC00]),
        (4, [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0xFFFFFFFF]),
        (8, [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48, (0x7FF8 << 48) | 1, 2**64 - 1]),
        (1, [0x00, 0x80, 0x7F, 0xFF, 0x7C, 0x7D, 0x7E, 0xFC]),
    ],
)
def test_nan_inf_and_signed_zero_patterns(word: int, patterns: list[int]) -> None:
    rng = np.random.default_rng(1)
    vals = np.array(patterns, dtype=UINT[word])
    old = vals[rng.integers(0, len(vals), 2048)]
    new = old.copy()
    pos = rng.choice(2048, 100, replace=False)
    new[pos] = vals[rng.integers(0, len(vals), 100)]
    for key in KEYS_BY_WORD[word]:
        _roundtrip(old.view(np.uint8), new.view(np.uint8), word, key)
    # every pair of special values, both ways: +0 <-> -0, NaN payloads, +-Inf
    a = np.repeat(vals, len(vals))
    b = np.tile(vals, len(vals))
    for key in KEYS_BY_WORD[word]:
        _roundtrip(a.view(np.uint8), b.view(np.uint8), word, key)
        _roundtrip(b.view(np.uint8), a.view(np.uint8), word, key)


@pytest.mark.parametrize("word", WORDS)
def test_incompressible_payload_never_exceeds_block(word: int) -> None:
    rng = np.random.default_rng(5)
    for nwords in (1, 2, 5, 64, 1000):
        old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
        new = rng.integers(0, 256, nwords * word, dtype=np.uint8)
        enc = encode_block(old, new, word, LEVEL, KEYS_BY_WORD[word][-1])
        assert len(enc.payload) <= new.size
        assert enc.codec == CODEC_STORE or len(enc.payload) < new.size
        assert decode_block(enc.codec, enc.payload, old, new.size, word).tobytes() == new.tobytes()
        enc = encode_block(None, new, word, LEVEL)
        assert enc.codec in (CODEC_STORE, CODEC_ZSTD) and len(enc.payload) <= new.size


def test_compressible_new_block_without_base_uses_zstd() -> None:
    new = np.zeros(4096, dtype=np.uint8)
    enc = encode_block(None, new, 2, LEVEL)
    assert enc.codec == CODEC_ZSTD
    assert decode_block(enc.codec, enc.payload, None, 4096, 2).tobytes() == new.tobytes()


def test_sparse_bf16_like_change_is_small() -> None:
    """One-ulp moves on 1% of 2-byte words: the delta codec should be far below the block."""
    rng = np.random.default_rng(2)
    old = rng.integers(0, 2**16, 2**20, dtype=np.uint16)
    new = old.copy()
    pos = rng.choice(old.size, old.size // 100, replace=False)
    new[pos] += np.where(rng.integers(0, 2, pos.size) == 1, 1, 0xFFFF).astype(np.uint16)
    enc = encode_block(old.view(np.uint8), new.view(np.uint8), 2, LEVEL)
    assert enc.codec == CODEC_RICE_PAIRED  # one-unit moves: value plane 0 pairs up
    assert len(enc.payload) < 0.05 * new.nbytes
    got = decode_block(enc.codec, enc.payload, old.view(np.uint8), new.nbytes, 2)
    assert got.tobytes() == new.tobytes()
    ctx = encode_block(old.view(np.uint8), new.view(np.uint8), 2, LEVEL, context.KEYS["BF16"])
    assert ctx.codec in DELTA_CODECS
    assert len(ctx.payload) <= len(enc.payload)
    got = decode_block(ctx.codec, ctx.payload, old.view(np.uint8), new.nbytes, 2)
    assert got.tobytes() == new.tobytes()


@pytest.mark.parametrize("word", WORDS)
def test_odd_block_lengths(word: int) -> None:
    """Blocks whose byte length is not a multiple of 8 (the tail of a tensor)."""
    for nwords in (1, 3, 5, 7, 9, 13, 1023):
        old = _base(word, nwords, seed=nwords)
        new = old.copy()
        new[-word:] ^= 0xFF
        _roundtrip(old, new, word)


# ---- damaged payloads: CorruptPatchError, never a crash or a silent wrong block ----------


def test_decode_rejects_damaged_payloads() -> None:
    old = _base(2, 1000)
    new = old.copy()
    new.view(np.uint16)[::37] += 1
    positions = delta.find_changes(old, new, 2)
    enc = EncodedBlock(CODEC_DELTA, delta.encode(old, new, 2, positions, LEVEL), positions.size)
    bad = [
        enc.payload[:5],  # shorter than the header
        enc.payload[:-1],  # planes do not add up
        enc.payload + b"\0",
        bytes([0, 0, 0, 0]) + enc.payload[4:],  # zero changes claimed
        (10**6).to_bytes(4, "little") + enc.payload[4:],  # more changes than words
    ]
    for payload in bad:
        with pytest.raises(CorruptPatchError):
            decode_block(CODEC_DELTA, payload, old, new.size, 2)
    for i in range(len(enc.payload)):  # any single damaged byte: an error or a block of the size
        damaged = bytearray(enc.payload)
        damaged[i] ^= 0xA5
        try:
            got = decode_block(CODEC_DELTA, bytes(damaged), old, new.size, 2)
        except CorruptPatchError:
            continue
        assert got.size == new.size
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_DELTA, enc.payload, old, new.size, 4)  # word size differs
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_COPY, b"", None, 10, 1)
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_COPY, b"x", old, old.size, 1)
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_STORE, b"abc", None, 4, 1)
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_ZSTD, b"not zstd at all", None, 4, 1)
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_DELTA, enc.payload, None, new.size, 2)
    # An unknown codec id is a newer writer's (its checksum held): unsupported, not damaged.
    with pytest.raises(FormatError, match="unknown block codec 9: made by a newer pulsectl"):
        decode_block(9, b"", old, old.size, 1)


def test_decode_rejects_damaged_context_payloads() -> None:
    rng = np.random.default_rng(4)
    old = rng.integers(0, 2**16, 1000, dtype=np.uint16).view(np.uint8)
    new = old.copy()
    new.view(np.uint16)[::29] += 1
    positions = np.flatnonzero(old.view(np.uint16) != new.view(np.uint16))
    payload, _ = context.encode(old, new, 2, positions, context.KEYS["BF16"], LEVEL)
    for bad in (payload[:7], payload[:-1], payload + b"\0", b"\0\0\0\0" + payload[4:]):
        with pytest.raises(CorruptPatchError):
            decode_block(CODEC_CONTEXT, bad, old, old.size, 2)
    for i in range(len(payload)):
        damaged = bytearray(payload)
        damaged[i] ^= 0x5A
        try:
            got = decode_block(CODEC_CONTEXT, bytes(damaged), old, old.size, 2)
        except CorruptPatchError:
            continue
        assert got.size == old.size  # a wrong block is caught later by the fingerprints
    with pytest.raises(CorruptPatchError):
        decode_block(CODEC_CONTEXT, payload, None, old.size, 2)


def test_zstd_payload_of_wrong_size_is_rejected() -> None:
    enc = encode_block(None, np.zeros(4096, np.uint8), 1, LEVEL)
    with pytest.raises(CorruptPatchError, match="4096"):
        decode_block(CODEC_ZSTD, enc.payload, None, 4000, 1)


def test_dense_change_to_a_compressible_block_is_stored_whole() -> None:
    """Every word changed, to zeros: the whole new block compressed beats any change list,
    even though the raw alternative is judged from a sample first."""
    rng = np.random.default_rng(5)
    old = rng.integers(0, 65536, 2 << 20, dtype=np.uint16).view(np.uint8)
    new = np.zeros_like(old)
    new[:100] = 7
    assert _roundtrip(old, new, 2) == CODEC_ZSTD


def test_dense_random_change_keeps_the_change_list() -> None:
    """Half the words moved by one unit in a random block: the raw block is incompressible,
    so the change list wins (and the sampled probe skips compressing the block whole)."""
    rng = np.random.default_rng(6)
    old = rng.integers(0, 65536, 2 << 20, dtype=np.uint16)
    new = old.copy()
    new[rng.random(old.size) < 0.5] += np.uint16(1)
    assert _roundtrip(old.view(np.uint8), new.view(np.uint8), 2) == CODEC_RICE_PAIRED


@pytest.mark.parametrize("word", [1, 2, 4, 8])
@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_codec_3_patched_in_place_a_chunk_at_a_time(
    word: int, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """apply patches codec 3 blocks in place, a chunk of changes at a time (its whole-block
    decoding held ~120 MiB for an 8 MiB block whose words all moved): the same words as
    decode_block, across chunk edges, with gaps of every byte width; a position past the end
    is refused."""
    monkeypatch.setattr(delta, "_CHUNK", chunk)
    rng = np.random.default_rng(word)
    utype = np.dtype(f"<u{word}")
    nwords = 70_000
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    # a run, scattered words, then a gap of over 65,535 words (3 gap bytes) to the last word
    at = np.unique(np.concatenate([np.arange(0, 1000), rng.integers(1000, 3000, 500)]))
    at = np.concatenate([at, [nwords - 1]])
    new = old.copy()
    new.view(utype)[at] += rng.integers(1, 2**8 - 1, at.size).astype(utype)
    payload = delta.encode(old, new, word, np.flatnonzero(old.view(utype) != new.view(utype)), 3)
    assert payload[4] == 3  # gap_bytes
    work = old.copy()
    assert patch_in_place(CODEC_DELTA, payload, work, word)
    assert work.tobytes() == new.tobytes()
    assert decode_block(CODEC_DELTA, payload, old, old.size, word).tobytes() == new.tobytes()
    with pytest.raises(CorruptPatchError, match="past the end"):
        patch_in_place(CODEC_DELTA, payload, old[: old.size - word].copy(), word)


def test_codec_3_in_place_holds_a_few_mib_for_a_dense_block() -> None:
    old = np.random.default_rng(3).integers(0, 1 << 16, 4 * 2**20, dtype=np.uint16)
    new = old + 1  # every word moves: codec 3 (its gap planes are all zero)
    enc = encode_block(old.view(np.uint8), new.view(np.uint8), 2, 3)
    assert enc.codec == CODEC_DELTA
    work = old.view(np.uint8).copy()
    tracemalloc.start()
    try:
        assert patch_in_place(enc.codec, enc.payload, work, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert work.tobytes() == new.view(np.uint8).tobytes()
    assert peak < 32 * 2**20, f"peak allocation {peak / 2**20:.1f} MiB"
