"""cast: bit for bit against torch's own ``.to()`` on every target, and cast checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsectl.cast import TARGETS, cast_checkpoint, cast_words
from pulsectl.checkpoint import Checkpoint, save_safetensors
from pulsectl.cli.app import main
from pulsectl.errors import OutputError, UsageError
from pulsectl.synth import generate_chain

torch = pytest.importorskip("torch")

TORCH_TARGETS = {
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f8_e4m3": torch.float8_e4m3fn,
    "f8_e5m2": torch.float8_e5m2,
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def torch_cast(a: np.ndarray, src: str, to: str) -> np.ndarray:
    """The words torch writes for ``torch.from_numpy(a).to(target)`` (contiguous, CPU)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if src == "BF16":
        t = t.view(torch.int16).view(torch.bfloat16)
    out = t.to(TORCH_TARGETS[to]).contiguous()
    size = out.element_size()
    raw = out.view(torch.uint8).numpy()
    return raw.view(_UINT[size]).copy()


def check_all_targets(a: np.ndarray, src: str) -> None:
    for to in TARGETS:
        got = cast_words(a, src, to)
        want = torch_cast(a, src, to)
        bad = np.flatnonzero(got != want)
        words = a.reshape(-1).view(_UINT[a.itemsize])
        assert bad.size == 0, (
            f"{src}->{to}: {bad.size} words differ, first source word "
            f"{int(words[bad[0]]):#x}: got {int(got[bad[0]]):#x}, torch {int(want[bad[0]]):#x}"
        )


def f32_patterns() -> np.ndarray:
    """Every sign and exponent with mantissas at and around the rounding points of all targets."""
    mants = {0, 1, 2, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x555555, 0x2AAAAA}
    for shift in (13, 16, 20, 21, 22):  # f16, bf16, e4m3, e5m2 kept bits; and e5m2 subnormals
        half = 1 << (shift - 1)
        for base in (0, 1 << shift, 3 << shift, 0x7FFFFF & ~((1 << shift) - 1)):
            mants.update({base + half - 1, base + half, base + half + 1})
    mant = np.array(sorted(m & 0x7FFFFF for m in mants), dtype=np.uint32)
    exps = np.arange(256, dtype=np.uint32) << np.uint32(23)
    grid = (exps[:, None] | mant[None, :]).reshape(-1)
    rng = np.random.default_rng(1)
    random = rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([grid, grid | np.uint32(0x8000_0000), random]).view(np.float32)


def test_every_bf16_pattern() -> None:
    check_all_targets(np.arange(1 << 16, dtype=np.uint16), "BF16")


def test_every_f16_pattern() -> None:
    check_all_targets(np.arange(1 << 16, dtype=np.uint16).view(np.float16), "F16")


def test_structured_f32_patterns() -> None:
    check_all_targets(f32_patterns(), "F32")


def test_f64_rounds_through_f32_like_torch() -> None:
    f32 = f32_patterns()
    finite = f32[np.isfinite(f32)].astype(np.float64)
    # Just above and below each f32 value: a direct rounding would differ from torch's two.
    ulp = np.abs(finite) * 2.0**-30 + 1e-320
    rng = np.random.default_rng(2)
    random = rng.integers(0, 2**64, 1 << 15, dtype=np.uint64, endpoint=False).view(np.float64)
    a = np.concatenate([finite, finite + ulp, finite - ulp, random, [np.inf, -np.inf, 0.0, -0.0]])
    a = a[~np.isnan(a)]
    check_all_targets(a, "F64")


def test_f64_nan_words() -> None:
    # torch's F64->BF16 kernel writes 0xFFFF in its vector body but 0x7FC0 in the scalar tail
    # (position-dependent); cast always writes 0xFFFF. Other targets agree with torch.
    nans = np.array([0x7FF8000000000000, 0xFFF8000000000000, 0x7FF5A5A5A5A5A5A5] * 32, np.uint64)
    a = nans.view(np.float64)
    assert set(cast_words(a, "F64", "bf16").tolist()) == {0xFFFF}
    assert set(torch_cast(a[:64], "F64", "bf16").tolist()) == {0xFFFF}
    for to in ("f16", "f8_e4m3", "f8_e5m2"):
        np.testing.assert_array_equal(cast_words(a, "F64", to), torch_cast(a, "F64", to))


def test_special_values() -> None:
    a = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 464.0, 480.0, 1e9, 61440.0, 65536.0])
    words = {to: cast_words(a.astype(np.float32), "F32", to).tolist() for to in TARGETS}
    assert words["bf16"][:5] == [0x0000, 0x8000, 0x7F80, 0xFF80, 0xFFFF]
    assert words["f16"][:5] == [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00]
    assert words["f8_e4m3"] == [0, 0x80, 0x7E, 0xFE, 0x7F, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E]
    assert words["f8_e5m2"][-2:] == [0x7C, 0x7C]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_random_f32_words(bits: list[int]) -> None:
    check_all_targets(np.array(bits, dtype=np.uint32).view(np.float32), "F32")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(width=64, allow_nan=False), min_size=1, max_size=200))
def test_random_f64_values(values: list[float]) -> None:
    check_all_targets(np.array(values, dtype=np.float64), "F64")


def _mixed_tensors() -> dict[str, tuple[str, list[int], np.ndarray]]:
    rng = np.random.default_rng(3)
    f32 = (rng.standard_normal((33, 7)) * 3).astype(np.float32)
    f32[0, :4] = [np.nan, np.inf, -0.0, 1e-40]
    return {
        "a.weight": ("F32", [33, 7], f32),
        "b.f64": ("F64", [5], rng.standard_normal(5)),
        "c.f16": ("F16", [9], rng.standard_normal(9).astype(np.float16)),
        "d.bf16": ("BF16", [4], np.array([0x3F80, 0x7FC1, 0x8001, 0x0001], np.uint16)),
        "e.ids": ("I32", [6], np.arange(6, dtype=np.int32)),
        "f.mask": ("BOOL", [3], np.array([1, 0, 1], np.uint8)),
    }


def _torch_state(tensors: dict[str, tuple[str, list[int], np.ndarray]], to: str) -> dict:
    out = {}
    for name, (dtype, shape, data) in tensors.items():
        if dtype in ("F32", "F64", "F16", "BF16"):
            out[name] = (TARGETS[to], shape, torch_cast(data, dtype, to))
        else:
            out[name] = (dtype, shape, data)
    return out


@pytest.mark.parametrize("to", list(TARGETS))
def test_cast_file_equals_writing_torchs_cast(tmp_path: Path, to: str) -> None:
    tensors = _mixed_tensors()
    save_safetensors(tmp_path / "in.safetensors", tensors, {"format": "pt"})
    summary = cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", to=to)
    save_safetensors(tmp_path / "want.safetensors", _torch_state(tensors, to), {"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (
        tmp_path / "want.safetensors"
    ).read_bytes()
    assert (summary.tensors, summary.converted) == (6, 3 if to in ("bf16", "f16") else 4)


def test_cast_is_chunked_and_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = _mixed_tensors()
    save_safetensors(tmp_path / "in.safetensors", tensors)
    cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "one.safetensors")
    monkeypatch.setattr("pulsectl.cast.CHUNK_ELEMENTS", 4)
    cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "two.safetensors")
    assert (tmp_path / "one.safetensors").read_bytes() == (
        tmp_path / "two.safetensors"
    ).read_bytes()


def test_cast_folder_matches_the_bf16_chain(tmp_path: Path) -> None:
    paths = generate_chain(tmp_path, "tiny", steps=1, save_fp32=True, shards=2)
    cast_checkpoint(tmp_path / "step_001.f32", tmp_path / "anchor")
    for f in sorted(p.name for p in paths[1].iterdir()):
        assert (tmp_path / "anchor" / f).read_bytes() == (paths[1] / f).read_bytes(), f
    index = json.loads((tmp_path / "anchor" / "model.safetensors.index.json").read_text())
    ckpt = Checkpoint.open(tmp_path / "anchor")
    assert index["metadata"]["total_size"] == sum(t.nbytes for _, t in ckpt.tensors())


@pytest.mark.parametrize(
    "config",
    [
        b'{"torch_dtype": "float32", "n": ' + b"7" * 5000 + b"}",  # past int's 4300 digits
        b"[" * 100_000 + b"]" * 100_000,  # nested past the recursion limit
        b"\xff not utf-8",
    ],
)
def test_cast_folder_copies_a_config_it_cannot_read(tmp_path: Path, config: bytes) -> None:
    """cast rewrites config.json's dtype when it can read it, and otherwise copies it as it is
    (these used to end in an internal error)."""
    src = tmp_path / "src"
    src.mkdir()
    save_safetensors(src / "model.safetensors", _mixed_tensors())
    (src / "config.json").write_bytes(config)
    cast_checkpoint(src, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes() == config


def test_cast_refuses_to_overwrite(tmp_path: Path) -> None:
    save_safetensors(tmp_path / "in.safetensors", _mixed_tensors())
    (tmp_path / "out.safetensors").write_bytes(b"keep")
    with pytest.raises(OutputError, match="pass -f"):
        cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == b"keep"
    cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "out.safetensors", force=True)
    with pytest.raises(UsageError, match="unknown cast target 'fp4'"):
        cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "x", to="fp4")
    # Not even -f replaces the input (an FP32 master is not to be had back from its cast),
    # nor a file by a folder checkpoint's cast.
    before = (tmp_path / "in.safetensors").read_bytes()
    with pytest.raises(UsageError, match="is CKPT; write the cast elsewhere"):
        cast_checkpoint(tmp_path / "in.safetensors", tmp_path / "in.safetensors", force=True)
    assert (tmp_path / "in.safetensors").read_bytes() == before
    folder = tmp_path / "folder"
    folder.mkdir()
    save_safetensors(folder / "model.safetensors", _mixed_tensors())
    with pytest.raises(OutputError, match="is a file, and the cast of a folder checkpoint"):
        cast_checkpoint(folder, tmp_path / "out.safetensors", force=True)
    assert (tmp_path / "out.safetensors").is_file()


@pytest.mark.parametrize("to", ["bf16", "f8_e4m3"])
def test_diff_as_then_apply_gives_the_cast(tmp_path: Path, to: str) -> None:
    generate_chain(tmp_path, "tiny", steps=2, save_fp32=True)
    old, new = tmp_path / "step_000.f32.safetensors", tmp_path / "step_002.f32.safetensors"
    anchor, patch = tmp_path / "anchor.safetensors", tmp_path / "p.pulse"
    assert main(["cast", str(old), "--to", to, "-o", str(anchor)]) == 0
    assert main(["diff", str(old), str(new), "--as", to, "-o", str(patch)]) == 0
    assert main(["apply", str(anchor), str(patch), "-o", str(tmp_path / "got")]) == 0
    cast_checkpoint(new, tmp_path / "want", to=to)
    assert (tmp_path / "got").read_bytes() == (tmp_path / "want").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temporaries gone


def test_cli_cast_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_safetensors(tmp_path / "in.safetensors", _mixed_tensors())
    args = ["cast", str(tmp_path / "in.safetensors"), "-o", str(tmp_path / "o")]
    assert main([*args, "--to", "int4"]) == 2
    assert "pulsectl: error: --to 'int4': unknown cast target;" in capsys.readouterr().err
    assert main(args) == 0
    assert main(args) == 1
    assert "exists; pass -f to overwrite" in capsys.readouterr().err
    assert main([*args, "-f"]) == 0


def test_diff_as_refuses_its_output_before_casting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`diff --as` casts both checkpoints (minutes on a big model) before the diff; an -o that
    is a folder, or a file without -f, was refused only after the casts."""
    import pulsectl.cast

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_safetensors(a, {"w": ("F32", [64], np.arange(64, dtype=np.float32))})
    save_safetensors(b, {"w": ("F32", [64], np.arange(64, dtype=np.float32) + 1)})

    def no_casts(*args: object, **kwargs: object) -> None:
        raise AssertionError("cast before the output was checked")

    monkeypatch.setattr(pulsectl.cast, "cast_temporaries", no_casts)
    folder, taken = tmp_path / "out", tmp_path / "p.pulse"
    folder.mkdir()
    taken.write_bytes(b"mine")
    assert main(["diff", str(a), str(b), "--as", "bf16", "-o", str(folder)]) == 1
    assert "is a folder; give a file path for the output" in capsys.readouterr().err
    assert main(["diff", str(a), str(b), "--as", "bf16", "-o", str(taken)]) == 1
    assert "output exists; pass -f to overwrite" in capsys.readouterr().err
    assert taken.read_bytes() == b"mine" and list(folder.iterdir()) == []
