"""Every single-bit flip anywhere in a small patch is detected, and leaves no output behind.

Exhaustive over one ~1.8 KB patch that uses all eight block codecs: for each of its bits, apply
(in-process, the library API) must fail with a PulseError, write nothing at OUT and leave no
temp file. A flip that still produced the exact target would need a proof that it is harmless;
there is none to prove: the file checksum covers every byte before it, and the footer's
checksum and END_MAGIC are compared exactly.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from _faultkit import apply_outcome, make_patch, parse_patch, report, scratch_dir, write_small_pair

from pulsectl.apply import apply_patches
from pulsectl.codecs import CODEC_NAMES
from pulsectl.errors import CorruptPatchError, FormatError, IntegrityError, PulseError


@pytest.fixture(scope="module")
def small() -> Iterator[tuple[Path, Path, bytes]]:
    with scratch_dir() as folder, pytest.MonkeyPatch.context() as mp:
        # Hashing a 30 KB file should not zero a 16 MiB buffer 11 000 times.
        mp.setattr("pulsectl.hashing.READ_CHUNK", 1 << 16)
        base, new = write_small_pair(folder)
        yield base, new, make_patch(base, new, level="max")


def test_the_patch_uses_every_codec(small: tuple[Path, Path, bytes]) -> None:
    base, new, patch = small
    assert parse_patch(patch).codecs() == set(CODEC_NAMES)
    assert 1024 <= len(patch) <= 2048
    assert apply_outcome(base, patch, base.parent / "out", new.read_bytes()) == "ok"


def test_every_single_bit_flip_is_detected(
    small: tuple[Path, Path, bytes], request: pytest.FixtureRequest
) -> None:
    base, new, patch = small
    expected = new.read_bytes()
    out = base.parent / "out"
    kinds: Counter[str] = Counter()
    undetected: list[int] = []
    for bit in range(len(patch) * 8):
        flipped = bytearray(patch)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            outcome = apply_outcome(base, bytes(flipped), out, expected)
        except AssertionError:
            undetected.append(bit)
            continue
        if outcome == "ok":
            undetected.append(bit)
        kinds[outcome] += 1
    bits = len(patch) * 8
    report(
        request.config,
        "bit flips",
        f"{bits} single-bit flips of a {len(patch)}-byte patch: {bits - len(undetected)} "
        f"detected, {len(undetected)} missed",
    )
    assert not undetected, f"flips not detected at bits {undetected[:20]}"


@pytest.mark.parametrize(
    ("offset", "error", "match"),
    [
        (0, FormatError, "not a .pulse patch"),  # magic
        (8, FormatError, "version 17 is not supported"),  # version
        (10, CorruptPatchError, "unknown preamble flags"),  # flags
        (12, CorruptPatchError, None),  # header length
        (16, CorruptPatchError, "header checksum mismatch"),  # header checksum
        (30, CorruptPatchError, "header checksum mismatch"),  # header body
        (-30, CorruptPatchError, None),  # trailer
        (-20, CorruptPatchError, "file checksum mismatch"),  # file checksum
        (-1, CorruptPatchError, "file checksum mismatch"),  # END_MAGIC
    ],
)
def test_flip_error_classes(
    small: tuple[Path, Path, bytes], offset: int, error: type[PulseError], match: str | None
) -> None:
    """Where a flip lands decides the error: damage exits 3, a foreign file or version exits 1;
    a field's own check names it, before the file checksum at the end would catch the flip."""
    base, _, patch = small
    flipped = bytearray(patch)
    flipped[offset] ^= 0x10
    out = base.parent / "out"
    with pytest.raises(error, match=match) as info:
        apply_patches(base, [io.BytesIO(bytes(flipped))], out, workers=1)
    assert isinstance(info.value, IntegrityError) == (error is CorruptPatchError)
    assert not out.exists()
