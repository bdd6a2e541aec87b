"""pulsectl.floats against torch, the independent reference, bit for bit."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pulsectl.floats import (
    BF16_NAN_CUDA,
    BF16_NAN_TORCH_CPU,
    BF16_NAN_TORCH_SCALAR,
    bf16_to_f32,
    f32_to_bf16,
)

LOWER_HALVES = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000, 0x7FFE]


def _torch_bf16(bits: np.ndarray) -> np.ndarray:
    """torch's cast of float32 bit patterns (contiguous CPU tensor), as uint16 words."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _torch_nan_word() -> int:
    words = _torch_bf16(np.array([0x7FC0_0000, 0xFFC0_0001, 0x7F80_0001], dtype=np.uint32))
    assert len(set(words.tolist())) == 1, "torch maps NaNs to several words on this platform"
    return int(words[0])


def _assert_matches_torch(bits: np.ndarray) -> None:
    ours = f32_to_bf16(bits.view(np.float32), nan=_torch_nan_word())
    ref = _torch_bf16(bits)
    bad = np.flatnonzero(ours != ref)
    if bad.size:
        i = bad[0]
        pytest.fail(
            f"{bad.size} mismatches; first: f32 {bits[i]:#010x} -> ours {ours[i]:#06x}, "
            f"torch {ref[i]:#06x}"
        )


def _upper_times_lower(lowers: list[int]) -> np.ndarray:
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return (upper[:, None] | np.array(lowers, dtype=np.uint32)[None, :]).reshape(-1)


def test_all_upper_halves_with_interesting_lower_halves() -> None:
    rng = np.random.default_rng(0)
    lowers = LOWER_HALVES + rng.integers(0, 1 << 16, size=8).tolist()
    _assert_matches_torch(_upper_times_lower(lowers))


def test_torch_nan_word_on_x86_is_the_default() -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("torch's vectorised NaN word is pinned on x86 only")
    assert _torch_nan_word() == BF16_NAN_TORCH_CPU


def test_torch_nan_words_differ_by_path() -> None:
    """Why ``nan`` is a parameter: torch's scalar path disagrees with its vector path."""
    scalar = torch.tensor(float("nan"), dtype=torch.float32).to(torch.bfloat16)
    assert int(scalar.view(torch.int16).item()) & 0xFFFF == BF16_NAN_TORCH_SCALAR


@pytest.mark.parametrize(
    ("bits", "word"),
    [
        (0x0000_0000, 0x0000),  # +0
        (0x8000_0000, 0x8000),  # -0
        (0x7F80_0000, 0x7F80),  # +inf
        (0xFF80_0000, 0xFF80),  # -inf
        (0x7F7F_FFFF, 0x7F80),  # max float rounds up to inf
        (0xFF7F_8000, 0xFF80),  # tie at the top, odd -> overflows to -inf
        (0x7F7F_7FFF, 0x7F7F),  # just below the tie: largest finite bf16
        (0x3F80_8000, 0x3F80),  # tie, even below: stays
        (0x3F81_8000, 0x3F82),  # tie, odd below: rounds up to even
        (0x3F80_8001, 0x3F81),  # above the tie
        (0x0000_0001, 0x0000),  # smallest subnormal rounds to +0
        (0x8000_8001, 0x8001),  # negative subnormal, kept (no flush to zero)
        (0x007F_FFFF, 0x0080),  # largest subnormal rounds up to the smallest normal
    ],
)
def test_edge_cases(bits: int, word: int) -> None:
    x = np.array([bits], dtype=np.uint32)
    assert int(f32_to_bf16(x.view(np.float32))[0]) == word
    assert int(_torch_bf16(x)[0]) == word


@pytest.mark.parametrize("bits", [0x7FC0_0000, 0xFFC0_0000, 0x7F80_0001, 0xFFFF_FFFF, 0x7FBF_0000])
def test_nan_choices(bits: int) -> None:
    x = np.array([bits], dtype=np.uint32).view(np.float32)
    assert int(f32_to_bf16(x)[0]) == BF16_NAN_TORCH_CPU
    assert int(f32_to_bf16(x, nan=BF16_NAN_CUDA)[0]) == BF16_NAN_CUDA
    kept = int(f32_to_bf16(x, nan=None)[0])
    assert kept == (bits >> 16) | 0x0040
    assert np.isnan(bf16_to_f32(np.array([kept], dtype=np.uint16))[0])


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.uint32, st.integers(0, 300), elements=st.integers(0, 2**32 - 1)))
def test_random_patterns_match_torch(bits: np.ndarray) -> None:
    _assert_matches_torch(bits)


def test_widen_is_exact_for_every_word() -> None:
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = bf16_to_f32(words)
    ref = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).to(torch.float32)
    np.testing.assert_array_equal(ours.view(np.uint32), ref.numpy().view(np.uint32))
    np.testing.assert_array_equal(ours.view(np.uint32), words.astype(np.uint32) << 16)
    not_nan = ~np.isnan(ours)
    np.testing.assert_array_equal(f32_to_bf16(ours)[not_nan], words[not_nan])
    np.testing.assert_array_equal(f32_to_bf16(ours, nan=None)[~not_nan], words[~not_nan] | 0x40)


def test_shapes_layouts_and_input_untouched() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    before = x.copy()
    out = f32_to_bf16(x)
    assert out.shape == x.shape and out.dtype == np.uint16
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(out, _torch_bf16(x.view(np.uint32)).reshape(x.shape))
    strided = x[:, ::2, 1:]
    np.testing.assert_array_equal(f32_to_bf16(strided), out[:, ::2, 1:])
    assert f32_to_bf16(np.float32(1.0).reshape(())).shape == ()
    assert f32_to_bf16(np.empty((0, 4), np.float32)).shape == (0, 4)
    assert bf16_to_f32(out).shape == x.shape


def test_chunk_boundaries() -> None:
    """Inputs longer than one internal chunk convert the same as piece by piece."""
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 1 << 32, size=(1 << 20) * 2 + 123, dtype=np.uint32)
    _assert_matches_torch(bits)


def test_rejects_wrong_dtypes() -> None:
    with pytest.raises(TypeError, match="float32"):
        f32_to_bf16(np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="uint16"):
        bf16_to_f32(np.zeros(3, np.int16))
    with pytest.raises(ValueError, match="16-bit"):
        f32_to_bf16(np.zeros(3, np.float32), nan=0x10000)


@pytest.mark.slow
def test_every_float32_pattern_matches_torch() -> None:
    """All 2**32 patterns, in chunks (minutes)."""
    chunk = 1 << 26
    start_time = time.perf_counter()
    for start in range(0, 1 << 32, chunk):
        _assert_matches_torch(np.arange(start, start + chunk, dtype=np.uint32))
    print(f"2**32 patterns checked in {time.perf_counter() - start_time:.0f} s")
