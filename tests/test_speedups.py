"""The compiled speedups (pulsectl/_speedups.c) give exactly what the numpy code gives.

Every function is run both ways on the same input: with ``_fast.native`` set (the extension) and
with it None (numpy), and the bytes must be equal; damaged streams must be refused both ways.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _native import pure_numpy, simd_modes
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsectl.codecs import _fast, context, decode_block, encode_block, rice
from pulsectl.codecs._bits import UINT_OF_WORD, add_moves, change_planes, unpack_moves
from pulsectl.codecs.delta import find_changes
from pulsectl.errors import CorruptPatchError

NATIVE = _fast.native
needs_native = pytest.mark.skipif(NATIVE is None, reason="pulsectl._speedups is not built")
WORDS = [1, 2, 4, 8]


def both(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` with the extension, then with numpy."""
    fast = fn()
    with pure_numpy():
        slow = fn()
    return fast, slow


def test_speedups_are_built_where_a_compiler_is():
    """CI must exercise the compiled paths: a checkout installed with a C compiler builds them."""
    if os.environ.get("PULSECTL_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("PULSECTL_PURE_PYTHON is set")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    assert NATIVE is not None, (
        "pulsectl._speedups did not build although a C compiler is on PATH: reinstall with "
        "`pip install -e . -v` and read the build log (or set PULSECTL_PURE_PYTHON=1)"
    )


@st.composite
def block_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int]:
    word = draw(st.sampled_from(WORDS))
    nwords = draw(st.integers(1, 700))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    new = old.copy()
    kind = draw(st.sampled_from(["sparse", "dense", "all", "tail", "small-moves", "none"]))
    words = new.view(UINT_OF_WORD[word])
    if kind == "sparse":
        at = rng.integers(0, nwords, max(1, nwords // 50))
        words[at] += np.asarray(1, dtype=words.dtype)
    elif kind == "dense":
        mask = rng.random(nwords) < 0.4
        words[mask] = rng.integers(0, 2 ** min(8 * word, 63), mask.sum(), dtype=np.uint64).astype(
            words.dtype
        )
    elif kind == "all":
        words ^= np.asarray(1, dtype=words.dtype)
    elif kind == "tail":
        words[-1] -= np.asarray(1, dtype=words.dtype)
    elif kind == "small-moves":
        at = np.sort(rng.choice(nwords, size=max(1, nwords // 7), replace=False))
        words[at] += rng.integers(-3, 4, at.size).astype(words.dtype)
    return old, new, word


@needs_native
@settings(max_examples=300, deadline=None)
@given(block_pairs())
def test_find_changes_and_encode_block_agree(pair: tuple[np.ndarray, np.ndarray, int]):
    old, new, word = pair
    fast, slow = both(lambda: find_changes(old, new, word))
    assert fast.dtype == slow.dtype == np.int64
    assert np.array_equal(fast, slow)
    for level in (1, 3, 7):
        a, b = both(lambda level=level: encode_block(old, new, word, level))
        assert a == b
        restored = both(lambda a=a: decode_block(a.codec, a.payload, old, new.size, word))
        assert all(r.tobytes() == new.tobytes() for r in restored)
    if fast.size:
        for pair in (False, True):
            planes = both(lambda pair=pair: change_planes(old, new, fast, word, 3, pair=pair))
            assert planes[0] == planes[1]


def expected_planes(old: np.ndarray, new: np.ndarray, word: int) -> tuple[np.ndarray, list[bytes]]:
    """Changed positions and the raw zigzag planes of their moves, by numpy."""
    utype, stype = UINT_OF_WORD[word], np.dtype(f"i{word}")
    positions = np.flatnonzero(old.view(utype) != new.view(utype))
    signed = (new.view(utype)[positions] - old.view(utype)[positions]).view(stype)
    zigzag = ((signed << 1) ^ (signed >> (8 * word - 1))).view(utype).astype(f"<u{word}")
    raw = zigzag.view(np.uint8).reshape(-1, word)
    return positions, [raw[:, p].tobytes() for p in range(word)]


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.lists(block_pairs(), min_size=1, max_size=4))
def test_listing_into_reused_buffers(pairs: list[tuple[np.ndarray, np.ndarray, int]]):
    """encode_block lists changes into buffers its thread keeps from block to block: blocks of
    other sizes and word widths in between must not leave anything behind in the results."""
    from pulsectl.codecs import _list_changes

    for old, new, word in pairs:
        want_positions, want_planes = expected_planes(old, new, word)
        for loops in simd_modes():
            positions, planes = _list_changes(old, new, word)
            assert np.array_equal(positions, want_positions), loops
            assert [bytes(p) for p in planes] == want_planes, loops


@needs_native
@pytest.mark.parametrize("bits", range(32))
def test_rice_streams_at_every_parameter(bits: int):
    """Every Rice parameter (so every way the AVX-512 encoder packs remainders: 16, 8 or 4 to a
    put, or one by one), on counts around the 16 codes it takes at a time: the streams equal
    numpy's with every set of loops, and decode to the positions with each (the vector walks
    take k up to 24 with AVX-512 and 14 with AVX2, in blocks under 2^27 words)."""
    rng = np.random.default_rng(bits)
    for count in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000):
        steps = rng.integers(2**bits, 2 ** (bits + 1), count) if bits else np.ones(count, int)
        positions = (np.cumsum(steps) - 1).astype(np.int64)
        slow = both(lambda positions=positions: rice.rice_streams(positions))[1]
        k, unary, remainder = slow
        for loops in simd_modes():
            assert rice.rice_streams(positions) == slow, (count, loops)
            for nwords in (int(positions[-1]) + 1, int(positions[-1]) + 100):
                got = NATIVE.rice_decode(unary, remainder, count, k, nwords)
                assert np.array_equal(np.frombuffer(got, np.int64), positions), (count, loops)


@needs_native
def test_listing_into_refuses_buffers_that_are_too_small():
    old = np.zeros(64, np.uint8)
    new = np.ones(64, np.uint8)
    room = 64 // 2 + 1
    assert (
        NATIVE.changes_into(old, new, 2, np.empty(room, np.int64), np.empty(2 * room, np.uint8))
        == 32
    )
    with pytest.raises(ValueError, match="too small"):
        NATIVE.changes_into(old, new, 2, np.empty(room - 1, np.int64), np.empty(2 * room, np.uint8))
    with pytest.raises(ValueError, match="too small"):
        NATIVE.changes_into(old, new, 2, np.empty(room, np.int64), np.empty(2 * room - 1, np.uint8))
    with pytest.raises(ValueError):
        NATIVE.changes_into(
            old, new[:62], 2, np.empty(room, np.int64), np.empty(2 * room, np.uint8)
        )
    with pytest.raises(TypeError):  # the outputs must be writable
        NATIVE.changes_into(old, new, 2, bytes(8 * room), np.empty(2 * room, np.uint8))


@st.composite
def sorted_positions(draw: st.DrawFn) -> np.ndarray:
    count = draw(st.integers(1, 3000))
    scale = draw(st.sampled_from([1, 2, 5, 40, 1000, 10**6, 2**30]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    steps = rng.geometric(1 / scale, count) if scale > 1 else np.ones(count, dtype=np.int64)
    if draw(st.booleans()):  # a few huge gaps among small ones
        steps[rng.integers(0, count, 3)] += 2**27
    return (np.cumsum(steps) - 1).astype(np.int64)


@needs_native
@settings(max_examples=300, deadline=None)
@given(sorted_positions())
def test_rice_streams_and_decoding_agree(positions: np.ndarray):
    slow = both(lambda: rice.rice_streams(positions))[1]
    for loops in simd_modes():  # the parameter search sums gaps with AVX-512 where it can
        fast = rice.rice_streams(positions)
        assert fast == slow, loops  # the same k (fewest bits, smallest on a tie), same bytes
    k, unary, remainder = fast
    # rice_size measures what rice_encode writes (`--level max` only measures it), both ways.
    for size in both(lambda: rice.rice_size(positions)):
        assert size == (k, len(unary), len(remainder))
    nwords = int(positions[-1]) + 1
    for loops in simd_modes():  # decoded 16 (AVX-512) or 8 (AVX2) codes at a time
        for streams_nwords in (nwords, nwords + 12345):
            decoded = NATIVE.rice_decode(unary, remainder, positions.size, k, streams_nwords)
            assert np.array_equal(np.frombuffer(decoded, np.int64), positions), loops
        if positions.size < nwords:  # (more changes than words is refused before decoding)
            with pytest.raises(CorruptPatchError):  # one word short of the last position
                NATIVE.rice_decode(unary, remainder, positions.size, k, nwords - 1)


def _rice_payload(positions: np.ndarray, word: int = 2) -> bytes:
    moved = np.ones(positions.size, dtype=UINT_OF_WORD[word])
    return rice.encode_moves(positions, moved, word, 3)


@needs_native
@pytest.mark.parametrize(
    "damage",
    ["unary-truncated", "remainder-short", "remainder-long", "unary-all-ones", "count-high"],
)
def test_damaged_rice_streams_are_refused_both_ways(damage: str):
    positions = np.array([3, 9, 10, 400, 401, 4000], dtype=np.int64)
    k, unary, remainder = rice.rice_streams(positions)
    count = positions.size
    if damage == "unary-truncated":
        unary = unary[: len(unary) // 2]
    elif damage == "remainder-short":
        remainder = remainder[:-1]
    elif damage == "remainder-long":
        remainder = remainder + b"\0"
    elif damage == "unary-all-ones":
        unary = b"\xff" * len(unary)
    elif damage == "count-high":
        count += 3
    payload = b"".join(
        [
            rice._HEAD.pack(count, 2, k, 0),
            len(unary).to_bytes(4, "little"),
            unary,
            len(remainder).to_bytes(4, "little"),
            remainder,
            (0).to_bytes(4, "little") * 2,
        ]
    )
    for use_numpy in (False, True):
        with pytest.raises(CorruptPatchError):
            if use_numpy:
                with pure_numpy():
                    rice.decode_moves(payload, 2, 5000)
            else:
                rice.decode_moves(payload, 2, 5000)
    with pytest.raises(CorruptPatchError):  # and decoded straight into a block
        rice.add_in_place(np.zeros(2 * 5000, dtype=np.uint8), payload, 2)


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    word=st.sampled_from(WORDS),
    count=st.integers(1, 3000),
    scale=st.sampled_from([1, 2, 5, 40, 1000]),
    spare=st.integers(0, 70),
    seed=st.integers(0, 2**32 - 1),
)
def test_rice_blocks_applied_in_place_agree(word, count, scale, spare, seed):
    """rice_scatter (decoding straight into the block) against numpy's positions and moves:
    every word width, moves of every size, a last change at the very end or not."""
    rng = np.random.default_rng(seed)
    steps = rng.geometric(1 / scale, count) if scale > 1 else np.ones(count, dtype=np.int64)
    positions = (np.cumsum(steps) - 1).astype(np.int64)
    nwords = int(positions[-1]) + 1 + spare
    utype = UINT_OF_WORD[word]
    moved = rng.integers(1, 2 ** min(8 * word, 63), count, dtype=np.uint64).astype(utype)
    moved[rng.random(count) < 0.8] = np.asarray(1, dtype=utype)  # mostly one unit up or down
    moved[rng.random(count) < 0.4] = np.asarray(-1 & (2 ** (8 * word) - 1), dtype=utype)
    payload = rice.encode_moves(positions, moved, word, 3)
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    with pure_numpy():
        slow = old.copy()
        assert not rice.add_in_place(slow, payload, word)  # the numpy path takes over
        at, moves = rice.decode_moves(payload, word, nwords)
        add_moves(slow, at, moves, word)
    want = old.copy()
    want.view(utype)[positions] += moved
    assert slow.tobytes() == want.tobytes()
    for loops in simd_modes():  # the vector walks decode 16 (AVX-512) or 8 (AVX2) at a time
        fast = old.copy()
        assert rice.add_in_place(fast, payload, word)
        assert fast.tobytes() == want.tobytes(), loops


def _damaged_rice_payload(
    word: int, positions: np.ndarray, cut: int, flips: list[int], rflips: list[int], pad: bytes
) -> bytes:
    """A Rice payload (unit moves) with its unary stream cut short by ``cut`` bytes, or
    followed by ``pad`` (bits after the last code are not read), and the bits at ``flips`` of it
    and ``rflips`` of the remainder stream flipped."""
    payload = _rice_payload(positions, word)
    view, count, k, unary, remainder, offset = rice._streams(payload, word, int(positions[-1]) + 1)
    streams = []
    for stream, at in ((bytearray(unary), flips), (bytearray(remainder), rflips)):
        for f in at if stream else ():
            stream[(f // 8) % len(stream)] ^= 0x80 >> (f % 8)
        streams.append(stream)
    unary_bytes = bytes(streams[0][: max(0, len(streams[0]) - cut)]) + (pad if not cut else b"")
    return b"".join(
        [
            payload[: rice._HEAD.size],
            len(unary_bytes).to_bytes(4, "little"),
            unary_bytes,
            len(streams[1]).to_bytes(4, "little"),
            bytes(streams[1]),
            payload[offset:],
        ]
    )


def _rice_bits(
    quotients: list[int], remainders: list[int], k: int, pad: bytes
) -> tuple[bytes, bytes]:
    """Unary and remainder streams written bit by bit (most significant first), the unary one
    followed by ``pad``."""

    def packed(bits: str) -> bytes:
        bits += "0" * (-len(bits) % 8)
        return bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))

    unary = packed("".join("1" * q + "0" for q in quotients)) + pad
    remainder = packed("".join(format(r, f"0{k}b") for r in remainders)) if k else b""
    return unary, remainder


@needs_native
@pytest.mark.parametrize("count", [16, 64, 1000])
@pytest.mark.parametrize("pad", [b"", b"\xff" * 8, b"\x00" * 16])
def test_rice_last_position_at_the_block_end(count: int, pad: bytes):
    """A last position of exactly nwords - 1 decodes; one block word fewer is refused, in every
    walk (the padding puts the last codes in whole 64-bit words, where the vector walks take
    them)."""
    rng = np.random.default_rng(count)
    k = 3
    gaps = rng.integers(0, 40, count)
    unary, remainder = _rice_bits(list(gaps >> k), list(gaps & 7), k, pad)
    positions = np.cumsum(gaps + 1) - 1
    nwords = int(positions[-1]) + 1
    for loops in simd_modes():
        got = NATIVE.rice_decode(unary, remainder, count, k, nwords)
        assert np.array_equal(np.frombuffer(got, np.int64), positions), loops
        words = np.zeros(2 * nwords, dtype=np.uint8)
        NATIVE.rice_scatter(words, unary, remainder, count, k, (b"\2" * count, b"\0" * count), 2)
        assert np.array_equal(np.flatnonzero(words.view(np.uint16)), positions), loops
        with pytest.raises(CorruptPatchError):
            NATIVE.rice_decode(unary, remainder, count, k, nwords - 1)
        with pytest.raises(CorruptPatchError):
            short = np.zeros(2 * (nwords - 1), dtype=np.uint8)
            NATIVE.rice_scatter(
                short, unary, remainder, count, k, (b"\2" * count, b"\0" * count), 2
            )


@needs_native
@pytest.mark.parametrize("k", [8, 14, 20, 24])  # 14, 24: the most the AVX2, AVX-512 walks take
def test_rice_quotients_past_the_block_are_refused(k: int):
    """A quotient whose shifted value wraps around 32 bits back into the block (2^(32 - k)
    ones) is refused as the scalar walk refuses it, not taken for a small position."""
    count, nwords = 64, 64 << k
    quotients = [0] * count
    quotients[20] = 1 << (32 - k)
    unary, remainder = _rice_bits(quotients, [1] * count, k, b"\xff" * 8)
    for loops in simd_modes():
        with pytest.raises(CorruptPatchError):
            NATIVE.rice_decode(unary, remainder, count, k, nwords)
        quotients[20] = 0
        fine, rem = _rice_bits(quotients, [1] * count, k, b"\xff" * 8)
        got = np.frombuffer(NATIVE.rice_decode(fine, rem, count, k, nwords), np.int64)
        assert np.array_equal(got, np.arange(count) * 2 + 1), loops
        quotients[20] = 1 << (32 - k)


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    word=st.sampled_from(WORDS),
    count=st.integers(1, 2000),
    scale=st.sampled_from([1, 2, 3, 40, 5000]),
    spare=st.sampled_from([0, 0, 3, 1000]),
    seed=st.integers(0, 2**32 - 1),
    cut=st.sampled_from([0, 0, 1, 9, 100]),
    flips=st.lists(st.integers(0, 2**20), max_size=3),
    rflips=st.lists(st.integers(0, 2**20), max_size=2),
    pad=st.sampled_from([b"", b"\xff" * 8, b"\x00" * 8]),
)
def test_damaged_rice_streams_agree_with_numpy(
    word, count, scale, spare, seed, cut, flips, rflips, pad
):
    """With unary streams cut short or bits flipped in either stream, the compiled walks (the
    vector ones, 16 codes at a time with AVX-512 and 8 with AVX2, and the scalar one) refuse what
    numpy refuses and give its positions and words otherwise."""
    rng = np.random.default_rng(seed)
    steps = rng.geometric(1 / scale, count) if scale > 1 else np.ones(count, dtype=np.int64)
    positions = (np.cumsum(steps) - 1).astype(np.int64)
    nwords = int(positions[-1]) + 1 + spare
    damaged = _damaged_rice_payload(word, positions, cut, flips, rflips, pad)
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    with pure_numpy():
        try:
            slow: bytes | None = rice.decode(old, damaged, word).tobytes()
            slow_at: np.ndarray | None = rice.decode_moves(damaged, word, nwords)[0]
        except CorruptPatchError:
            slow = slow_at = None
    for loops in simd_modes():
        patched = old.copy()
        try:
            assert rice.add_in_place(patched, damaged, word)
            fast: bytes | None = patched.tobytes()
            fast_at: np.ndarray | None = rice.decode_moves(damaged, word, nwords)[0]
        except CorruptPatchError:
            fast = fast_at = None
        assert fast == slow, loops
        assert (fast_at is None) == (slow_at is None), loops
        if fast_at is not None:
            assert np.array_equal(fast_at, slow_at), loops


@needs_native
@pytest.mark.parametrize("word", WORDS)
def test_moves_unpack_and_scatter_agree(word: int):
    rng = np.random.default_rng(word)
    utype = UINT_OF_WORD[word]
    old = rng.integers(0, 256, 4096 * word, dtype=np.uint8)
    new = old.copy()
    words = new.view(utype)
    at = np.sort(rng.choice(4096, size=900, replace=False)).astype(np.int64)
    # every size of move: +-1, small, the largest, and both signs' extremes
    moves = rng.integers(0, 2 ** min(8 * word, 63), at.size, dtype=np.uint64).astype(utype)
    moves[:4] = np.array([1, -1 & (2 ** (8 * word) - 1), 2 ** (8 * word - 1), 0x7F], dtype=utype)
    words[at] += moves
    table = change_planes(old, new, at, word, 3).joined()
    fast, slow = both(lambda: unpack_moves(memoryview(table), 0, at.size, word))
    assert fast.dtype == slow.dtype == utype
    assert np.array_equal(fast, slow)
    assert np.array_equal(fast, moves)
    patched = both(lambda: _added(old, at, fast, word))
    assert patched[0].tobytes() == patched[1].tobytes() == new.tobytes()


def _added(old: np.ndarray, at: np.ndarray, moves: np.ndarray, word: int) -> np.ndarray:
    out = old.copy()
    add_moves(out, at, moves, word)
    return out


@needs_native
def test_cli_writes_the_same_patch_without_the_extension(tmp_path: Path, chain: list[Path]):
    """End to end through the CLI: PULSECTL_PURE_PYTHON=1 (numpy) and PULSECTL_SIMD=portable (the
    portable C loops, not AVX2 where the CPU has it) give the same patch bytes."""
    base, target = chain[0], chain[-1]
    patches = []
    for pure in ("0", "1", "portable"):
        out = tmp_path / f"p{pure}.pulse"
        env = {
            k: v for k, v in os.environ.items() if k not in ("PULSECTL_SIMD", "PULSECTL_NO_AVX512")
        }
        env["PULSECTL_PURE_PYTHON"] = "1" if pure == "1" else "0"
        if pure == "portable":
            env["PULSECTL_SIMD"] = "portable"
        subprocess.run(
            [sys.executable, "-m", "pulsectl", "diff", str(base), str(target), "-o", str(out)],
            check=True,
            env=env,
            capture_output=True,
        )
        if pure == "portable":  # the run really used the portable loops
            version = subprocess.run(
                [sys.executable, "-m", "pulsectl", "--version"],
                check=True,
                env=env,
                capture_output=True,
                text=True,
            ).stdout
            assert "compiled, portable" in version, version
        patches.append(out.read_bytes())
        restored = tmp_path / f"r{pure}.safetensors"
        subprocess.run(
            [sys.executable, "-m", "pulsectl", "apply", str(base), str(out), "-o", str(restored)],
            check=True,
            env=env,
            capture_output=True,
        )
        assert restored.read_bytes() == Path(target).read_bytes()
    assert patches[0] == patches[1] == patches[2]


@needs_native
def test_simd_environment_caps_the_loops():
    def loops(**env: str) -> tuple[str, str]:
        code = "from pulsectl.codecs import _fast; print(_fast.native.simd(None))"
        clean = {
            k: v for k, v in os.environ.items() if k not in ("PULSECTL_SIMD", "PULSECTL_NO_AVX512")
        }
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**clean, **env},
            check=True,
            capture_output=True,
            text=True,
        )
        return run.stdout.strip(), run.stderr

    saved = NATIVE.simd(None)
    try:
        best = NATIVE.simd(True)  # "avx512" or "avx2" where this CPU has them
        with_avx2 = NATIVE.simd("avx2")  # "avx2" where the CPU has AVX2, else "portable"
    finally:
        NATIVE.simd(saved)
    assert loops() == (best, "")
    assert loops(PULSECTL_SIMD="portable") == ("portable", "")
    assert loops(PULSECTL_SIMD="avx2") == (with_avx2, "")
    assert loops(PULSECTL_SIMD="avx512") == (best, "")
    assert loops(PULSECTL_NO_AVX512="1") == (with_avx2, "")
    assert loops(PULSECTL_NO_AVX512="0") == (best, "")
    assert loops(PULSECTL_SIMD="portable", PULSECTL_NO_AVX512="1") == ("portable", "")
    chosen, warning = loops(PULSECTL_SIMD="sse9")
    assert chosen == best
    assert "PULSECTL_SIMD='sse9' is not one of avx512, avx2, portable; ignored" in warning
    with pytest.raises(ValueError, match="not one of"):
        NATIVE.simd("sse9")


@needs_native
def test_a_bad_pure_python_value_is_ignored_with_a_warning_by_the_library() -> None:
    """The CLI refuses PULSECTL_PURE_PYTHON=yes (tests/test_cli.py); a program that imports
    pulsectl is told, and keeps the compiled loops, as for a bad PULSECTL_SIMD. It used to
    switch them off without a word (any value but '' and '0')."""
    code = "from pulsectl.codecs import _fast; print(_fast.describe())"
    for value, loops, warned in (("yes", "compiled", True), ("1", "numpy", False)):
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PULSECTL_PURE_PYTHON": value},
            check=True,
            capture_output=True,
            text=True,
        )
        assert run.stdout.startswith(loops), (value, run.stdout)
        warning = f"pulsectl: warning: PULSECTL_PURE_PYTHON={value!r} is not 0 or 1; ignored\n"
        assert run.stderr == (warning if warned else ""), value


CONTEXT_KEYS = {1: (3, 4), 2: (7, 8), 4: (23, 8), 8: (52, 11)}


@needs_native
@settings(max_examples=200, deadline=None)
@given(block_pairs(), st.booleans())
def test_context_codec_agrees(pair: tuple[np.ndarray, np.ndarray, int], few_keys: bool):
    """`--level max`'s codec: the same payload both ways, and both decode it to the target."""
    old, new, word = pair
    if few_keys:  # most words in a handful of contexts, as in real weights
        top = np.asarray(0x7 << (8 * word - 4), dtype=np.uint64).astype(UINT_OF_WORD[word])
        old = old.copy()
        old.view(UINT_OF_WORD[word])[:] &= ~top
    key = CONTEXT_KEYS[word]
    fast, slow = both(lambda: encode_block(old, new, word, 9, key=key))
    assert fast == slow
    for result in both(lambda: decode_block(fast.codec, fast.payload, old, new.size, word)):
        assert result.tobytes() == new.tobytes()


@needs_native
def test_context_positions_refuses_ranks_past_a_context():
    old = np.zeros(64, dtype=np.uint8)  # every BF16 word has key 0: 32 words in one context
    keys = np.zeros(2, dtype=np.int64)
    ok = NATIVE.context_positions(old, 2, 7, 8, keys, np.array([3, 31], dtype=np.int64))
    assert list(np.frombuffer(ok, np.int64)) == [3, 31]
    for ranks in ([3, 32], [5, 5], [7, 2]):
        with pytest.raises(CorruptPatchError):
            NATIVE.context_positions(old, 2, 7, 8, keys, np.array(ranks, dtype=np.int64))
    with pytest.raises(CorruptPatchError):  # keys out of order
        NATIVE.context_positions(
            old, 2, 7, 8, np.array([1, 0], dtype=np.int64), np.array([0, 0], dtype=np.int64)
        )


@needs_native
@settings(max_examples=300, deadline=None)
@given(block_pairs(), st.booleans())
def test_context_payloads_agree(pair: tuple[np.ndarray, np.ndarray, int], few_keys: bool):
    """context_encode against the numpy encoder, payload byte for byte, whichever codec
    encode_block would pick; blocks over 1/12 changed take the compiled branch-free walk, the
    others the walk that stops at each change. context_scatter then applies the payload in
    place, as numpy's positions and moves do."""
    old, new, word = pair
    if few_keys:
        top = np.asarray(0x7 << (8 * word - 4), dtype=np.uint64).astype(UINT_OF_WORD[word])
        old = old.copy()
        old.view(UINT_OF_WORD[word])[:] &= ~top
        new = new.copy()
        new.view(UINT_OF_WORD[word])[:] &= ~top
    positions = find_changes(old, new, word)
    if positions.size == 0:
        return
    key = CONTEXT_KEYS[word]
    slow = context._encode_numpy(old, new, word, positions, key, 9)
    for loops in simd_modes():  # runs of 16 codes or more are written 16 at a time on AVX-512
        fast, _ = context.encode(old, new, word, positions, key, 9)
        assert (fast, False) == slow, loops
    patched = old.copy()
    assert context.add_in_place(patched, fast, word)
    with pure_numpy():
        untouched = old.copy()
        assert not context.add_in_place(untouched, fast, word)  # numpy takes the other road
        at, moves = context.decode_moves(old, fast, word)
    assert untouched.tobytes() == old.tobytes()
    assert patched.tobytes() == _added(old, at, moves, word).tobytes() == new.tobytes()


@needs_native
@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("fraction", [0.01, 0.3, 1.0])
def test_context_codec_on_every_width_and_density(word: int, fraction: float):
    """Blocks of real size on both sides of the dense walk's threshold, every word width, with
    moves of every size (one unit, large, both extremes) and a change in the last word. At this
    size the dense walk's two walkers are not 4 KiB apart, so one of them walks on alone at the
    end (the first for words of 1, 2 and 4 bytes, the second for 8)."""
    rng = np.random.default_rng(int(fraction * 100) + word)
    utype = UINT_OF_WORD[word]
    nwords = 50_000
    old = rng.integers(0, 256, nwords * word, dtype=np.uint8)
    old.view(utype)[:] >>= np.asarray(2, dtype=utype)  # fewer keys, as in real weights
    new = old.copy()
    at = np.flatnonzero(rng.random(nwords) < fraction)
    at = np.union1d(at, [nwords - 1]).astype(np.int64)
    moves = np.where(rng.random(at.size) < 0.5, 1, -1).astype(np.int64).astype(utype)
    big = rng.random(at.size) < 0.05
    moves[big] = rng.integers(1, 2 ** min(8 * word, 63), big.sum(), dtype=np.uint64).astype(utype)
    moves[:2] = np.array([2 ** (8 * word - 1), 2 ** (8 * word - 1) - 1], dtype=np.uint64).astype(
        utype
    )
    new.view(utype)[at] += moves
    positions = find_changes(old, new, word)
    key = CONTEXT_KEYS[word]
    slow = context._encode_numpy(old, new, word, positions, key, 3, pair=True)
    for loops in simd_modes():
        fast, paired = context.encode(old, new, word, positions, key, 3, pair=True)
        assert (fast, paired) == slow, loops
    assert paired  # most moves are one unit: value plane 0 pairs up (codec 7)
    for restored in both(lambda: context.decode(old, fast, word, paired)):
        assert restored.tobytes() == new.tobytes()
    for loops in simd_modes():  # BF16's dense walk has a version for AVX-512 machines
        patched = old.copy()
        assert context.add_in_place(patched, fast, word, paired)
        assert patched.tobytes() == new.tobytes(), loops


@needs_native
def test_context_encode_refuses_positions_that_are_not_the_changes():
    old = np.zeros(2 * 1000, dtype=np.uint8)
    new = old.copy()
    new[::2] = 1  # every word changes: the dense walk, which finds the changes itself
    with pytest.raises(ValueError, match="not the changed words"):
        NATIVE.context_encode(old, new, 2, 7, 8, np.arange(0, 1000, 2, dtype=np.int64))
    with pytest.raises(ValueError, match="increase"):
        NATIVE.context_encode(old, new, 2, 7, 8, np.array([5, 3], dtype=np.int64))
    # Far fewer positions than changes: the walk stops a chunk past them instead of writing
    # 200,000 slots into room for 20,000 (it once did: a heap overflow under AddressSanitizer).
    old = np.zeros(2 * 200_000, dtype=np.uint8)
    new = np.ones_like(old)
    with pytest.raises(ValueError, match="not the changed words"):
        NATIVE.context_encode(old, new, 2, 7, 8, np.arange(20_000, dtype=np.int64))


@needs_native
def test_context_encode_refuses_wrong_positions_with_every_walk():
    """Many changes (1 in 4 words: the select walk where it runs, the dense walk elsewhere):
    positions out of order, one at a word that did not change (with or without the change it
    stands for), and one changed word left out. The select walk refuses each; the dense walk,
    which finds the changes itself and checks only their count, refuses or codes the changes."""
    rng = np.random.default_rng(5)
    old = _bf16_block(10_000, np.arange(110, 126), rng)
    new = old.copy()
    new[::4] += np.uint16(1)
    changed = np.arange(0, 10_000, 4, dtype=np.int64)
    cases = [
        ("increase", changed[::-1].copy()),
        ("not the changed words", np.sort(np.append(changed, 1))),  # word 1 did not change
        ("not the changed words", np.sort(np.append(changed[1:], 1))),  # ... nor is 0 listed
        ("not the changed words", changed[:-1].copy()),  # the last change is left out
    ]
    old8, new8 = old.view(np.uint8), new.view(np.uint8)
    for loops in simd_modes():
        right = NATIVE.context_encode(old8, new8, 2, 7, 8, changed)
        for match, positions in cases:
            try:
                got = NATIVE.context_encode(old8, new8, 2, 7, 8, positions)
            except ValueError as error:
                assert match in str(error), (loops, str(error))
            else:
                assert not NATIVE.select_walk(), (match, loops)
                assert got == right, (match, loops)


@needs_native
def test_context_scatter_refuses_damaged_streams():
    """The in-place decoder refuses what the numpy decoder refuses (CorruptPatchError)."""
    rng = np.random.default_rng(3)
    old = rng.integers(0, 256, 2 * 4000, dtype=np.uint8)
    new = old.copy()
    new.view(np.uint16)[rng.random(4000) < 0.1] += np.uint16(1)
    payload, _ = context.encode(old, new, 2, find_changes(old, new, 2), CONTEXT_KEYS[2], 3)
    view, count, shift, bits, keys, ks, counts, unary, remainder, _ = context._parse(
        payload, 2, 4000
    )
    planes = (bytes(count), None)
    cases = {
        "short unary": (keys, ks, counts, bytes(unary)[:2], remainder),
        "remainder length": (keys, ks, counts, unary, bytes(remainder) + b"\0"),
        "gaps too long": (keys, ks, counts, b"\xff" * len(unary) + b"\x00" * 8, remainder),
        "keys out of order": (keys[::-1].copy(), ks, counts, unary, remainder),
        "k too large": (keys, ks + 40, counts, unary, remainder),
    }
    for name, (k, kk, c, u, r) in cases.items():
        block = old.copy()
        with pytest.raises(CorruptPatchError):
            NATIVE.context_scatter(block, 2, shift, bits, k, kk, c, u, r, planes)
            pytest.fail(name)
    # 32 words, all with key 0; gaps 3 and 30 (k = 0) give ranks 3 and 34: past the context.
    zeros = np.zeros(64, dtype=np.uint8)
    one = np.zeros(1, dtype=np.int64)
    bits_ = "1110" + "1" * 30 + "0"
    unary_ = int(bits_.ljust(40, "0"), 2).to_bytes(5, "big")
    args = (np.zeros(1, np.int64), one, np.array([2], np.int64), unary_, b"", (bytes(2), None))
    with pytest.raises(CorruptPatchError, match="past the end of a context"):
        NATIVE.context_scatter(zeros, 2, 7, 8, *args)
    ok = "1110" + "1" * 27 + "0"  # gaps 3 and 27: ranks 3 and 31, the last word
    args = (args[0], one, args[2], int(ok.ljust(40, "0"), 2).to_bytes(5, "big"), b"", args[5])
    NATIVE.context_scatter(zeros, 2, 7, 8, *args)
    # 8 changes in 32 words take the dense walk: ranks 0-6, then 32 (past) or 31 (the last).
    eight = np.array([8], np.int64)
    for last, fails in ((25, True), (24, False)):
        bits_ = "0" * 7 + "1" * last + "0"
        unary_ = int(bits_.ljust(40, "0"), 2).to_bytes(5, "big")
        block = np.zeros(64, dtype=np.uint8)
        args = (np.zeros(1, np.int64), one * 0, eight, unary_, b"", (bytes([2] * 8), None))
        if fails:
            with pytest.raises(CorruptPatchError, match="past the end of a context"):
                NATIVE.context_scatter(block, 2, 7, 8, *args)
        else:
            NATIVE.context_scatter(block, 2, 7, 8, *args)
            moved = np.flatnonzero(block.view(np.uint16))
            assert list(moved) == [0, 1, 2, 3, 4, 5, 6, 31]
            assert set(block.view(np.uint16)[moved]) == {1}  # zigzag 2: +1


def _bf16_block(nwords: int, exponents: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """BF16 words (as uint16) with exponent fields drawn from ``exponents``, random signs and
    mantissas."""
    exps = rng.choice(exponents, nwords).astype(np.uint16)
    signs = rng.integers(0, 2, nwords).astype(np.uint16) << np.uint16(15)
    return signs | exps << np.uint16(7) | rng.integers(0, 128, nwords).astype(np.uint16)


def _apply_each_way(old: np.ndarray, new: np.ndarray) -> None:
    """The context payload of old -> new (uint16 BF16 words), encoded with each set of loops
    (the select walk where this CPU runs it, from 1 change in 28 words) as numpy encodes it,
    and applied in place with each and by numpy: each gives ``new``."""
    old8, new8 = old.view(np.uint8), new.view(np.uint8)
    positions = find_changes(old8, new8, 2)
    if positions.size == 0:
        return
    slow = context._encode_numpy(old8, new8, 2, positions, CONTEXT_KEYS[2], 3, pair=True)
    for loops in simd_modes():
        got = context.encode(old8, new8, 2, positions, CONTEXT_KEYS[2], 3, pair=True)
        assert got == slow, loops
    payload, paired = slow
    for loops in simd_modes():
        patched = old8.copy()
        assert context.add_in_place(patched, payload, 2, paired)
        assert patched.tobytes() == new8.tobytes(), loops
    with pure_numpy():
        assert context.decode(old8, payload, 2, paired).tobytes() == new8.tobytes()


@needs_native
def test_select_walk_runs_where_pdep_is_fast():
    """The select walk runs with the AVX2 loops on CPUs with a fast PDEP, never without them."""
    saved = NATIVE.simd(None)
    try:
        if NATIVE.simd("portable") == "portable":
            assert not NATIVE.select_walk()
        if NATIVE.simd("avx2") != "avx2":
            assert not NATIVE.select_walk()
    finally:
        NATIVE.simd(saved)


@needs_native
@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([1, 63, 64, 65, 4095, 4096, 4097, 9000, 70_000]),
    st.sampled_from(["one", "few", "normal", "spread", "all"]),
    st.sampled_from([0.0005, 0.01, 0.15, 0.5, 1.0]),
    st.sampled_from(["one-unit", "any", "early", "late"]),
    st.integers(0, 2**32 - 1),
)
def test_select_walk_agrees_with_the_other_walks(nwords, keys, fraction, moves, seed):
    """BF16 context blocks of every shape the select walk treats apart: 64-word groups whole
    and cut short (1 to 65 words, and the last words past the chunks of 4096), every word of a
    group in one key (its bits read past the 57 of one load), many keys (most met one word at a
    time, outside the range of the vector pass), keys whose changes end early in the block
    (dropped from the pass at the next chunk) or start late, every word changed."""
    rng = np.random.default_rng(seed)
    exponents = {
        "one": np.array([120]),
        "few": np.array([118, 119, 120, 121]),
        "normal": np.clip(np.round(rng.normal(118, 3, 64)), 1, 254),
        "spread": np.arange(256),
        "all": np.arange(0, 256, 5),
    }[keys]
    old = _bf16_block(nwords, exponents, rng)
    mask = rng.random(nwords) < fraction
    if moves == "early":
        mask[nwords // 3 :] = False
    elif moves == "late":
        mask[: 2 * nwords // 3] = False
    mask[-1] |= fraction >= 0.5  # a change in the last word
    new = old.copy()
    if moves == "one-unit":
        step = np.ones(nwords, np.uint16)
    else:
        step = rng.integers(1, 2**16, nwords, np.uint16)
    new[mask] += np.where(rng.random(nwords) < 0.5, step, np.uint16(0) - step)[mask]
    _apply_each_way(old, new)


@needs_native
def test_select_walk_on_real_sized_blocks():
    """Blocks of 4 Mi words (8 MiB, a real block) of Adam-like changes at three densities,
    with two exponents' words far apart in the block."""
    rng = np.random.default_rng(17)
    nwords = 1 << 22
    weights = rng.normal(0, 0.02, nwords).astype(np.float32)
    weights[: nwords // 8] *= 64  # a stretch of larger weights: keys of their own
    old = (weights.view(np.uint32) >> 16).astype(np.uint16)
    for fraction in (0.005, 0.08, 0.35):
        new = old.copy()
        at = np.flatnonzero(rng.random(nwords) < fraction)
        new[at] += np.where(rng.random(at.size) < 0.5, 1, -1).astype(np.int16).view(np.uint16)
        _apply_each_way(old, new)


@needs_native
def test_select_walk_refuses_contexts_longer_than_the_block():
    """Contexts whose ranks each fit in the block but together claim more words than it has
    (keys 0 and 1, of 64 words all with key 0): refused as damaged, whichever walk reads them.
    Each context has one change, coded with k = 6: no unary bits, its rank in the remainder."""
    block = np.zeros(128, dtype=np.uint8)
    for ranks in ((60, 60), (60, 0)):  # 122 ranks in all; or key 1 (no words) at rank 0
        bits = "".join(format(r, "06b") for r in ranks)
        args = (
            np.array([0, 1], np.int64),
            np.full(2, 6, np.int64),
            np.ones(2, np.int64),
            bytes(1),  # two codes with quotient 0
            int(bits.ljust(16, "0"), 2).to_bytes(2, "big"),
            (bytes([2, 2]), None),
        )
        for loops in simd_modes():
            with pytest.raises(CorruptPatchError, match="past the end of a context"):
                NATIVE.context_scatter(block.copy(), 2, 7, 8, *args)
                pytest.fail(f"{ranks} {loops}")


@needs_native
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")
def test_buffers_of_ended_threads_are_freed():
    """The compiled loops keep buffers per thread (listing changes, the context codec's
    ranks, bitmaps and scratch); a thread that ends frees them. A program that applies a
    patch at every training step gets new worker threads each time, and kept every dead
    thread's buffers: 730 MB after these 20 threads (64 MB with them freed: malloc keeps
    some)."""
    code = """
import threading
import numpy as np
from pulsectl.codecs import _fast, context
from pulsectl.codecs._bits import value_plane_bytes
native = _fast.native
rng = np.random.default_rng(0)
nwords = 1 << 22
old = (rng.normal(0, 0.02, nwords).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
new = old.copy()
at = rng.random(nwords) < 0.3
new[at] += np.uint16(1)
old8, new8 = old.view(np.uint8), new.view(np.uint8)
positions = np.flatnonzero(at).astype(np.int64)
payload, _ = context.encode(old8, new8, 2, positions, context.KEYS["BF16"], 3)
parts = context._parse(payload, 2, nwords)
planes = value_plane_bytes(parts[0], parts[-1], parts[1], 2)

def work():
    native.changes(old8, new8, 2)
    native.context_encode(old8, new8, 2, 7, 8, positions)
    block = old8.copy()
    native.context_scatter(block, 2, *parts[2:9], planes)
    assert block.tobytes() == new8.tobytes()

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

work()
before = rss()
for _ in range(20):
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
print(rss() - before)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(run.stdout) < 250 * 2**20, run.stdout


def _damaged_context_block(
    nwords: int, fraction: float, seed: int, cut: int, flips: list[int]
) -> tuple[np.ndarray, bytes]:
    """A BF16 context block (unary runs with k = 0 and k > 0) with its unary stream cut short
    by ``cut`` bytes and the bits at ``flips`` (indices into the stream) flipped."""
    rng = np.random.default_rng(seed)
    old = (rng.normal(0, 0.02, nwords).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    at = np.flatnonzero(rng.random(nwords) < fraction)
    new[at] += np.where(rng.random(at.size) < 0.5, 1, -1).astype(np.int16).view(np.uint16)
    old8, new8 = old.view(np.uint8), new.view(np.uint8)
    payload, _ = context.encode(old8, new8, 2, find_changes(old8, new8, 2), CONTEXT_KEYS[2], 3)
    # The payload: header, u32-sized context table, u32-sized unary stream, the rest.
    (table_size,) = struct.unpack_from("<I", payload, context._HEAD.size)
    head = context._HEAD.size + 4 + table_size + 4  # the unary stream's offset
    (size,) = struct.unpack_from("<I", payload, head - 4)
    unary = payload[head : head + size]
    assert unary == bytes(context._parse(payload, 2, nwords)[7])
    stream = bytearray(unary)
    for f in flips:
        stream[(f // 8) % len(stream)] ^= 0x80 >> (f % 8)
    stream = stream[: max(0, len(stream) - cut)]
    # unary is length-prefixed (u32) in the payload: rewrite the prefix with the new length.
    damaged = (
        payload[: head - 4]
        + len(stream).to_bytes(4, "little")
        + bytes(stream)
        + payload[head + len(unary) :]
    )
    return old8, damaged


@needs_native
@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([3000, 20_000]),
    st.sampled_from([0.02, 0.3, 0.6]),
    st.integers(0, 2**32 - 1),
    st.sampled_from([0, 0, 1, 3]),
    st.lists(st.integers(0, 2**20), max_size=3),
)
def test_damaged_context_streams_agree_with_numpy(nwords, fraction, seed, cut, flips):
    """With unary streams cut short or with bits flipped, the in-place walks (dense and sparse,
    runs with k = 0 copied as bitmaps) refuse what numpy refuses and give its words otherwise."""
    old, damaged = _damaged_context_block(nwords, fraction, seed, cut, flips)
    with pure_numpy():
        try:
            slow: bytes | None = context.decode(old, damaged, 2).tobytes()
        except CorruptPatchError:
            slow = None
    for loops in simd_modes():  # runs of 16 codes or more are read 16 at a time with AVX-512
        patched = old.copy()
        try:
            context.add_in_place(patched, damaged, 2)
            fast: bytes | None = patched.tobytes()
        except CorruptPatchError:
            fast = None
        assert fast == slow, loops


@needs_native
@pytest.mark.parametrize(
    "positions",
    [[5, 3], [3, 3], [-1, 4], [0, -(2**63) + 5], [2**62, -(2**62)], [7, 2**63 - 1, 5]],
)
def test_rice_encode_refuses_positions_out_of_order(positions: list[int]):
    """The order check folded into the encoder's sums: equal, decreasing and negative
    positions, and steps whose difference wraps around 2^64, are all refused."""
    with pytest.raises(ValueError, match="increase"):
        NATIVE.rice_encode(np.array(positions, dtype=np.int64))
    with pytest.raises(ValueError, match="increase"):
        NATIVE.rice_size(np.array(positions, dtype=np.int64))


@needs_native
@pytest.mark.parametrize("at", [0, 1, 7, 15, 16, 17, 31, 32, 33, 38])
@pytest.mark.parametrize("damage", ["equal", "negative", "past_last", "wraps"])
def test_rice_encode_refuses_long_positions_out_of_order(at: int, damage: str):
    """The same on 40 positions, where the parameter search sums the gaps several at a time
    (with AVX-512 too where the CPU has it): a bad position at the start, at the edges of 8
    and 16 positions or near the end is refused by both loops, and so is one past the last
    position (the gaps would add up to more than the last position allows for)."""
    positions = np.arange(0, 40 * 1000, 1000, dtype=np.int64)
    if damage == "equal":
        positions[at] = positions[at - 1] if at else positions[1]
    elif damage == "negative":
        positions[at] = -5
    elif damage == "past_last":
        positions[at] = 2**40
    else:
        positions[at] = -(2**63) + 3
    for _loops in simd_modes():
        with pytest.raises(ValueError, match="increase"):
            NATIVE.rice_encode(positions)
        with pytest.raises(ValueError, match="increase"):
            NATIVE.rice_size(positions)


@needs_native
def test_rice_encode_takes_large_steps():
    positions = np.array([0, 2**40, 2**41 + 3], dtype=np.int64)
    k, unary, remainder = NATIVE.rice_encode(positions)
    with pure_numpy():
        assert (k, unary, remainder) == rice.rice_streams(positions)
