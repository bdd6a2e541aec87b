"""The golden patches pin .pulse v1 byte for byte (regenerate: python fixtures/make_golden.py)."""

from __future__ import annotations

import filecmp
import struct
from pathlib import Path

import pytest

from pulsectl.apply import apply_patches
from pulsectl.format import END_MAGIC, FORMAT_VERSION, MAGIC
from pulsectl.info import read_patch_info

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"
CASES = [
    ("single.pulse", "single_base.safetensors", "single_target.safetensors"),
    ("single_max.pulse", "single_base.safetensors", "single_target.safetensors"),
    ("dir.pulse", "dir_base", "dir_target"),
]


def _load_maker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN.parent / "make_golden.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same_tree(a: Path, b: Path) -> bool:
    if a.is_file():
        return a.read_bytes() == b.read_bytes()
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


# Patches written before codec 5 existed (delta blocks are codec 3): still read, byte for byte.
LEGACY = [
    ("codec3/single.pulse", "single_base.safetensors", "single_target.safetensors"),
    ("codec3/dir.pulse", "dir_base", "dir_target"),
    # written before value planes were compressed with the literal-oriented zstd parameters
    ("planes-level3/single.pulse", "single_base.safetensors", "single_target.safetensors"),
    # written while the header and trailer JSON were compressed at zstd level 19, and the
    # value planes of --level max's context blocks at level 19 too
    ("json19/single.pulse", "single_base.safetensors", "single_target.safetensors"),
    ("json19/single_max.pulse", "single_base.safetensors", "single_target.safetensors"),
    ("json19/dir.pulse", "dir_base", "dir_target"),
    # written before codecs 6 and 7 (value plane 0 in pairs): codecs 5 and 4
    ("plain-planes/single.pulse", "single_base.safetensors", "single_target.safetensors"),
    ("plain-planes/single_max.pulse", "single_base.safetensors", "single_target.safetensors"),
]


@pytest.mark.parametrize(("patch", "base", "target"), CASES + LEGACY)
def test_golden_patch_applies_to_exact_target(tmp_path: Path, patch: str, base: str, target: str):
    out = tmp_path / "out"
    apply_patches(GOLDEN / base, [GOLDEN / patch], out)
    assert _same_tree(out, GOLDEN / target)


@pytest.mark.parametrize(("patch", "base", "target"), CASES)
def test_diff_reproduces_golden_bytes(tmp_path: Path, patch: str, base: str, target: str):
    maker = _load_maker()
    out = tmp_path / patch
    options = maker.MAX_OPTIONS if "max" in patch else maker.OPTIONS
    maker.diff_golden(GOLDEN / base, GOLDEN / target, out, options=options)
    assert out.read_bytes() == (GOLDEN / patch).read_bytes()


def test_golden_inputs_are_what_the_maker_writes(tmp_path: Path):
    maker = _load_maker()
    maker.make_single(tmp_path)
    maker.make_folder(tmp_path)
    for _, base, target in CASES:
        assert _same_tree(tmp_path / base, GOLDEN / base)
        assert _same_tree(tmp_path / target, GOLDEN / target)
    for patch, _, _ in CASES:
        assert (tmp_path / patch).read_bytes() == (GOLDEN / patch).read_bytes()


def test_golden_preamble_and_footer_bytes():
    data = (GOLDEN / "single.pulse").read_bytes()
    assert data[:8] == MAGIC == b"\x89PULSE\r\n"
    version, flags, header_len = struct.unpack_from("<HHI", data, 8)
    assert (version, flags) == (FORMAT_VERSION, 0) == (1, 0)
    assert data[24 : 24 + 4] == b"\x28\xb5\x2f\xfd"  # the header is one zstd frame
    assert data[24 + header_len : 24 + header_len + 4] == b"PFRM"
    assert data[-8:] == END_MAGIC == b"PULSEEND"
    (trailer_offset,) = struct.unpack_from("<Q", data, len(data) - 24)
    assert data[trailer_offset : trailer_offset + 4] == b"PTRL"


def test_golden_contents():
    info = read_patch_info(GOLDEN / "single.pulse", check=True)
    by_name = {t["name"]: t for t in info.to_json()["tensors"]}
    import numpy as np

    from pulsectl.checkpoint import read_header

    def words(path: Path) -> np.ndarray:
        info = next(t for t in read_header(path).tensors if t.name.endswith("up_proj.weight"))
        return np.frombuffer(path.read_bytes()[info.start : info.end], dtype=np.uint16)

    expected = int(
        (
            words(GOLDEN / "single_base.safetensors") != words(GOLDEN / "single_target.safetensors")
        ).sum()
    )
    assert by_name["model.layers.0.mlp.up_proj.weight"]["changed_words"] == expected > 4
    assert by_name["model.layers.0.input_layernorm.weight"]["changed_words"] == 1  # -0.0
    assert by_name["model.new_only"]["from_base"] is False
    assert by_name["model.reshaped"]["from_base"] is False
    assert "model.old_only" not in by_name
    assert info.checked


def _codecs(name: str) -> set[int]:
    from pulsectl.format import PatchReader, blocks_in
    from pulsectl.patch import header_from_json

    with open(GOLDEN / name, "rb") as f:
        reader = PatchReader(f, name)
        header = header_from_json(reader.header, reader.name)
        codecs = set()
        for index, item in enumerate(header.items):
            nblocks = blocks_in(item.nbytes, header.block_bytes)
            reader.read_frame(index, nblocks)
            codecs |= {reader.read_block(1 << 24, "x").codec for _ in range(nblocks)}
        reader.read_trailer()
    return codecs


def test_golden_patches_pin_each_delta_codec():
    """The current goldens hold codec 6 (default level) and 7 (`--level max`); the legacy ones
    their plain twins, 5 and 4, and codec 3."""
    from pulsectl.codecs import (
        CODEC_CONTEXT,
        CODEC_CONTEXT_PAIRED,
        CODEC_DELTA,
        CODEC_RICE,
        CODEC_RICE_PAIRED,
    )

    assert CODEC_RICE_PAIRED in _codecs("single.pulse")
    assert CODEC_CONTEXT_PAIRED in _codecs("single_max.pulse")
    assert CODEC_RICE in _codecs("plain-planes/single.pulse")
    assert CODEC_CONTEXT in _codecs("plain-planes/single_max.pulse")
    assert CODEC_DELTA in _codecs("codec3/single.pulse")
