"""docs/FORMAT.md is enough to read every patch: tests/spec_reader.py, a reader written from the
document alone, rebuilds each golden patch's target and what pulsectl applies from fresh patches
of every kind byte for byte, and refuses what the document says to refuse."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import spec_reader
from conftest import tree_bytes
from safetensors.numpy import save_file

from pulsectl.cli.app import main
from pulsectl.synth import generate_chain

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"
GOLDEN_PATCHES = sorted(str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.pulse"))


def _spec_apply(base: Path, patch: Path, out: Path) -> dict[str, bytes]:
    spec_reader.apply_patch(str(base), patch.read_bytes(), str(out), check_base_fp=True)
    return tree_bytes(out)


def _pulsectl_apply(base: Path, patch: Path, out: Path) -> dict[str, bytes]:
    assert main(["-q", "apply", str(base), str(patch), "-o", str(out)]) == 0
    return tree_bytes(out)


def test_every_golden_patch_is_covered() -> None:
    assert len(GOLDEN_PATCHES) >= 11
    assert {"single.pulse", "single_max.pulse", "dir.pulse", "codec3/single.pulse"} <= set(
        GOLDEN_PATCHES
    )


@pytest.mark.parametrize("name", GOLDEN_PATCHES)
def test_the_document_rebuilds_each_golden_target(name: str, tmp_path: Path) -> None:
    kind = "dir" if Path(name).name.startswith("dir") else "single"
    base = GOLDEN / ("dir_base" if kind == "dir" else "single_base.safetensors")
    target = GOLDEN / ("dir_target" if kind == "dir" else "single_target.safetensors")
    assert _spec_apply(base, GOLDEN / name, tmp_path / "out") == tree_bytes(target)


def _mixed_dtypes(path: Path, seed: int, changed: float) -> None:
    """Tensors of each word width and of the sub-byte dtypes' containers; a fraction of words
    nudged by small integer moves (seed 0 = the base)."""
    rng = np.random.default_rng(0)
    tensors = {
        "bf16": rng.integers(0, 2**16, 5000, dtype=np.uint16),
        "f32": rng.standard_normal(3000).astype(np.float32),
        "f64": rng.standard_normal(700).astype(np.float64),
        "i8": rng.integers(-100, 100, 4000, dtype=np.int8),
        "empty": np.zeros(0, np.float32),
        "last": rng.standard_normal(64).astype(np.float32),
    }
    if seed:
        moves = np.random.default_rng(seed)
        for t in tensors.values():
            if t.size:
                raw = t.view(f"u{t.itemsize}")
                at = moves.random(t.size) < changed
                raw[at] += moves.integers(1, 3, int(at.sum())).astype(raw.dtype)
        tensors["last"][-1] += 1  # a change at the very end of a tensor
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of a synthetic training run (a file and a folder of shards) and of mixed
    dtypes, in one folder."""
    root = tmp_path_factory.mktemp("fresh")
    files = generate_chain(root / "file", "tiny", steps=2, lr=1e-3, seed=3)
    folders = generate_chain(root / "dir", "tiny", steps=1, lr=1e-3, seed=4, shards=2)
    for i, p in enumerate(files):
        shutil.copy(p, root / f"f{i}.safetensors")
    shutil.copytree(folders[0], root / "d0")
    shutil.copytree(folders[1], root / "d1")
    (root / "d1" / "notes").mkdir()
    (root / "d1" / "notes" / "run.txt").write_text("a blob only the target has\n")
    _mixed_dtypes(root / "m0.safetensors", 0, 0.0)
    _mixed_dtypes(root / "m1.safetensors", 1, 0.05)
    return root


CASES = {
    "file, default level": ("f0.safetensors", "f1.safetensors", []),
    "file, level max": ("f0.safetensors", "f1.safetensors", ["--level", "max"]),
    "file, level 19": ("f0.safetensors", "f2.safetensors", ["--level", "19"]),
    "folder of shards and blobs": ("d0", "d1", []),
    "folder, level max": ("d0", "d1", ["--level", "max"]),
    "mixed dtypes": ("m0.safetensors", "m1.safetensors", []),
    "mixed dtypes, level max": ("m0.safetensors", "m1.safetensors", ["--level", "max"]),
    "tensors matching a glob": ("f0.safetensors", "f1.safetensors", ["--tensors", "*mlp*"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_document_reads_what_pulsectl_writes(case: str, fresh: Path, tmp_path: Path) -> None:
    old, new, options = CASES[case]
    patch = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(fresh / old), str(fresh / new), "-o", str(patch), *options]) == 0
    ours = _spec_apply(fresh / old, patch, tmp_path / "spec")
    assert ours == _pulsectl_apply(fresh / old, patch, tmp_path / "pulsectl")
    if "--tensors" not in options:  # a block patch's target is BASE with its tensors replaced
        assert ours == tree_bytes(fresh / new)


def test_the_document_reads_each_block_patch(fresh: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "b"
    argv = ["-q", "diff", str(fresh / "f0.safetensors"), str(fresh / "f1.safetensors")]
    assert main([*argv, "-o", str(prefix), "--blocks", "2"]) == 0
    parts = sorted(tmp_path.glob("b*.pulse"))
    assert len(parts) == 3
    state = fresh / "f0.safetensors"
    for i, part in enumerate(parts):
        ours = _spec_apply(state, part, tmp_path / f"spec{i}")
        assert ours == _pulsectl_apply(state, part, tmp_path / f"pulsectl{i}")
        state = tmp_path / f"spec{i}"
    assert state.read_bytes() == (fresh / "f1.safetensors").read_bytes()


def test_the_document_refuses_what_pulsectl_refuses(fresh: Path, tmp_path: Path) -> None:
    """A few damages the document names: both readers refuse each."""
    patch = tmp_path / "p.pulse"
    argv = ["-q", "diff", str(fresh / "f0.safetensors"), str(fresh / "f1.safetensors")]
    assert main([*argv, "-o", str(patch)]) == 0
    good = patch.read_bytes()
    damages = {
        "a flipped payload byte": bytearray(good),
        "a byte after END_MAGIC": bytearray(good + b"\0"),
        "version 2": bytearray(good),
        "cut short": bytearray(good[:-30]),
    }
    damages["a flipped payload byte"][len(good) // 2] ^= 0x40
    damages["version 2"][8] = 2
    for what, data in damages.items():
        bad = tmp_path / "bad.pulse"
        bad.write_bytes(bytes(data))
        with pytest.raises(spec_reader.SpecError):
            spec_reader.parse_patch(bytes(data))
        out = tmp_path / "out.safetensors"
        assert main(["-q", "apply", str(fresh / "f0.safetensors"), str(bad), "-o", str(out)]) in (
            1,
            3,
        ), what
        assert not out.exists()


def _whole_patch(base: Path, header_text: str, data: bytes, items: list, out: Path) -> Path:
    """A patch from the document, every item stored whole (codec 1), over ``base``; ``items``
    are (name, begin, end, word) in the document's order. Returns the target's path."""
    import struct

    import xxhash
    from _faultkit import build_patch

    def fp(b: bytes) -> str:
        return xxhash.xxh3_128_hexdigest(b)

    raw = header_text.encode()
    target = struct.pack("<Q", len(raw)) + raw + data
    old = base.read_bytes()
    one = {"path": "", "size": len(old), "fingerprint": fp(old)}
    header = {
        "layout": "file",
        "block_bytes": 8388608,
        "writer": "test",
        "base": {"fingerprint": fp(old), "files": [one]},
        "files": [{"path": "", "kind": "safetensors", "header": header_text}],
        "items": [
            {
                "file": 0,
                "name": n,
                "nbytes": e - b,
                "word": w,
                "base": None,
                "base_fingerprint": None,
            }
            for n, b, e, w in items
        ],
    }
    frames = [[(1, data[b:e])] if e > b else [] for _, b, e, _ in items]
    trailer = {
        "target": {
            "fingerprint": fp(target),
            "files": [{"path": "", "size": len(target), "fingerprint": fp(target)}],
        },
        "items": [
            {
                "fingerprint": fp(data[b:e]),
                "changed": (e - b) // w,
                "encoded": 16 + 16 * len(f) + (e - b),
            }
            for (_, b, e, w), f in zip(items, frames, strict=True)
        ],
    }
    out.write_bytes(build_patch(header, frames, trailer))
    path = out.with_suffix(".target")
    path.write_bytes(target)
    return path


_F32 = '"dtype":"F32","shape":[1],"data_offsets":[0,4]'
_NOT_SAFETENSORS = {
    "an F4 tensor that ends inside a byte": (
        '{"q":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}',
        b"\x12\x03",
        [("q", 0, 2, 1)],
    ),
    "an F6 tensor that ends inside a byte": (
        '{"q":{"dtype":"F6_E2M3","shape":[3],"data_offsets":[0,3]}}',
        b"\1\2\3",
        [("q", 0, 3, 1)],
    ),
    "__metadata__ with a number": (
        '{"__metadata__":{"n":1},"a":{' + _F32 + "}}",
        b"\1\2\3\4",
        [("a", 0, 4, 4)],
    ),
    "__metadata__ a string": (
        '{"__metadata__":"s","a":{' + _F32 + "}}",
        b"\1\2\3\4",
        [("a", 0, 4, 4)],
    ),
    "a key twice": ('{"a":{' + _F32 + '},"a":{' + _F32 + "}}", b"\1\2\3\4", [("a", 0, 4, 4)]),
    "a float in a shape": (
        '{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
        b"\1\2\3\4",
        [("a", 0, 4, 4)],
    ),
    "negative dimensions": (
        '{"a":{"dtype":"F32","shape":[-1,-4],"data_offsets":[0,16]}}',
        b"\1" * 16,
        [("a", 0, 16, 4)],
    ),
    "a float offset": (
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}',
        b"\1\2\3\4",
        [("a", 0, 4, 4)],
    ),
}


@pytest.mark.parametrize("case", list(_NOT_SAFETENSORS))
def test_a_stored_header_that_is_not_valid_is_refused_by_both(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FORMAT.md said only 'a valid safetensors header' (and `ceil(n·b/8)` bytes, which admits
    a sub-byte tensor ending inside a byte): a reader from the document took patches pulsectl
    refuses. The official safetensors reader refuses each of these headers too, but the key
    given twice (it keeps the last). The document now says what valid is; both readers refuse
    each, and take the same patch with a plain header."""
    base = tmp_path / "base.safetensors"
    save_file({"x": np.zeros(1, dtype=np.uint8)}, str(base))
    control = tmp_path / "control.pulse"
    target = _whole_patch(base, '{"a":{' + _F32 + "}}", b"\1\2\3\4", [("a", 0, 4, 4)], control)
    assert _spec_apply(base, control, tmp_path / "s0") == {"": target.read_bytes()}
    assert _pulsectl_apply(base, control, tmp_path / "p0") == {"": target.read_bytes()}
    bad = tmp_path / "bad.pulse"
    _whole_patch(base, *_NOT_SAFETENSORS[case], bad)
    with pytest.raises(spec_reader.SpecError):
        spec_reader.apply_patch(str(base), bad.read_bytes(), str(tmp_path / "s1"))
    capsys.readouterr()
    assert main(["-q", "apply", str(base), str(bad), "-o", str(tmp_path / "p1")]) == 3
    assert "stored safetensors header is invalid" in capsys.readouterr().err
    assert not (tmp_path / "p1").exists()


def test_the_header_fields_the_document_requires(tmp_path: Path) -> None:
    """writer is required (pulsectl refused a patch without it; the document called it only
    informational), and the trailer's changed is at most the item's words."""
    import json

    base = tmp_path / "base.safetensors"
    save_file({"x": np.zeros(1, dtype=np.uint8)}, str(base))
    good = tmp_path / "good.pulse"
    _whole_patch(base, '{"a":{' + _F32 + "}}", b"\1\2\3\4", [("a", 0, 4, 4)], good)
    from _faultkit import build_patch, parse_patch

    parts = parse_patch(good.read_bytes())
    no_writer = {k: v for k, v in parts.header.items() if k != "writer"}
    too_many = json.loads(json.dumps(parts.trailer))
    too_many["items"][0]["changed"] = 2
    cases = [(no_writer, parts.trailer), (parts.header, too_many)]
    for drop in ("base.fingerprint", "items.name", "items.base", "base.files.size"):
        header = json.loads(json.dumps(parts.header))
        where, key = drop.rsplit(".", 1)
        obj = header
        for part in where.split("."):
            obj = obj[part][0] if isinstance(obj[part], list) else obj[part]
        del obj[key]
        cases.append((header, parts.trailer))
    for header, trailer in cases:
        bad = tmp_path / "bad.pulse"
        bad.write_bytes(build_patch(header, parts.frames, trailer))
        with pytest.raises(spec_reader.SpecError):
            spec_reader.apply_patch(str(base), bad.read_bytes(), str(tmp_path / "s"))
        assert main(["-q", "apply", str(base), str(bad), "-o", str(tmp_path / "p")]) == 3


def test_a_folder_base_with_a_file_more_is_refused_by_both(tmp_path: Path) -> None:
    """The document says the base holds the files of base.files and no other; the reader from
    the document rebuilt the target from such a base, which pulsectl refuses (exit 3)."""
    chain = generate_chain(tmp_path / "c", "tiny", steps=1, lr=3e-6, seed=4, shards=2)
    patch = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch)]) == 0
    base = tmp_path / "base"
    shutil.copytree(chain[0], base)
    (base / "notes.txt").write_text("a file more")
    with pytest.raises(spec_reader.SpecError, match="base has a file"):
        spec_reader.apply_patch(str(base), patch.read_bytes(), str(tmp_path / "s"))
    assert main(["-q", "apply", str(base), str(patch), "-o", str(tmp_path / "o")]) == 3
