"""apply(base, diff(base, new)) == new, byte for byte, over dtypes, shapes, densities and layouts.

Checkpoints are written with the official safetensors writers; the structure of each version
(dtypes, shapes, which tensors change and how) is drawn by hypothesis, the bytes come from a
seeded numpy generator so that examples stay cheap and reproducible.
"""

from __future__ import annotations

import io
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from conftest import TEMP_GLOB, assert_roundtrip, patch_bytes, raw_tensors, tree_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pulsectl._dtypes import DTYPES
from pulsectl.apply import apply_patches
from pulsectl.diff import DiffOptions, diff_checkpoints, diff_to_path
from pulsectl.info import read_patch_info
from pulsectl.synth import generate_chain

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Two NaNs with different payloads per float dtype (little-endian word values); the FNUZ FP8
# types have one NaN word (0x80), which random bytes hold often enough.
NANS = {
    "BF16": (0x7FC0, 0xFFC1),
    "F16": (0x7E00, 0x7E01),
    "F32": (0x7FC00000, 0x7FC00001),
    "F64": (0x7FF8000000000000, 0xFFF8000000000001),
    "F8_E4M3": (0x7F, 0xFF),
    "F8_E5M2": (0x7D, 0x7F),
}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Scalars, empty tensors, odd sizes, sizes that are not a multiple of 8 bytes, and a few
# that span several 4096-byte blocks for every dtype width.
SHAPES = [(), (0,), (3, 0), (1,), (3,), (7,), (5, 3), (2, 1, 3), (1031,), (33, 65), (4099,)]
FILLS = ["random", "zeros", "nan"]
MUTATIONS = ["same", "single", "tail", "sparse", "all", "bits", "signflip", "nanpayload", "wrap"]
SHAPE_OPS = ["reshape", "resize", "retype", "remove"]
NAMES = ["a", "b.weight", "layer.0.bias", "emb", "w\u00e9ird name", "z"]
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)

Tensor = tuple[str, tuple[int, ...], np.ndarray]  # dtype, shape, raw bytes (uint8)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPES[dtype].nbytes(math.prod(shape))


def _fill(dtype: str, shape: tuple[int, ...], fill: str, rng: np.random.Generator) -> np.ndarray:
    n = _nbytes(dtype, shape)
    w = DTYPES[dtype].word
    if dtype == "BOOL":
        return (rng.integers(0, 2, n) if fill == "random" else np.zeros(n)).astype(np.uint8)
    if fill == "zeros":
        return np.zeros(n, np.uint8)
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    if fill == "nan" and dtype in NANS:
        raw.view(UINT[w])[:] = NANS[dtype][0]
    return raw


def _mutate(dtype: str, raw: np.ndarray, mode: str, rng: np.random.Generator) -> np.ndarray:
    """A changed copy of ``raw``; every mode changes words in place (same dtype and shape)."""
    w = DTYPES[dtype].word
    new = raw.copy()
    n = raw.size // w
    if n == 0 or mode == "same":
        return new
    if mode == "single":
        pos = rng.integers(0, n, 1)
    elif mode == "tail":
        pos = np.array([n - 1])
    elif mode == "sparse":
        pos = rng.choice(n, max(1, n // 100), replace=False)
    elif mode == "all":
        pos = np.arange(n)
    else:
        pos = rng.choice(n, max(1, n // 3), replace=False)
    if dtype == "BOOL":
        new[pos] ^= 1
        return new
    words = new.view(UINT[w])
    top = UINT[w](1 << (8 * w - 1))
    if mode in ("single", "tail", "sparse"):
        # Small moves either way (one ulp up or down, wrapping at the ends of the range).
        step = np.where(rng.integers(0, 2, pos.size) == 1, UINT[w](1), ~UINT[w](0))
        words[pos] = words[pos] + step.astype(UINT[w])
    elif mode == "all":
        words[pos] = ~words[pos]
    elif mode == "bits":
        bit = rng.integers(0, 8 * w, pos.size).astype(UINT[w])
        words[pos] ^= UINT[w](1) << bit
    elif mode == "signflip" or (mode == "nanpayload" and dtype not in NANS):
        words[pos] ^= top  # +0 <-> -0 on a zero-filled float tensor
    elif mode == "nanpayload":
        words[pos] = NANS[dtype][1]
    elif mode == "wrap":
        words[pos] = words[pos] + (top | UINT[w](0x5A))  # huge deltas that wrap around
    return new


def _to_torch(t: Tensor) -> torch.Tensor:
    dtype, shape, raw = t
    if raw.size == 0:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=TORCH_DTYPES[dtype]).reshape(shape)


def _save(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None) -> None:
    safetensors.torch.save_file({k: _to_torch(v) for k, v in tensors.items()}, path, metadata)


tensor_st = st.tuples(
    st.sampled_from(sorted(TORCH_DTYPES)), st.sampled_from(SHAPES), st.sampled_from(FILLS)
)
metadata_st = st.sampled_from([None, {"format": "pt"}, {"format": "pt", "step": "7"}])


def _new_tensor(spec: tuple[str, tuple[int, ...], str], rng: np.random.Generator) -> Tensor:
    dtype, shape, fill = spec
    return dtype, shape, _fill(dtype, shape, fill, rng)


def _step(
    data: st.DataObject, tensors: dict[str, Tensor], rng: np.random.Generator
) -> dict[str, Tensor]:
    """The next version: each tensor kept, changed, reshaped, re-typed or removed; some added."""
    out: dict[str, Tensor] = {}
    for name, (dtype, shape, raw) in tensors.items():
        op = data.draw(st.sampled_from(MUTATIONS + SHAPE_OPS), label=f"op {name}")
        if op == "remove":
            continue
        if op == "reshape":
            numel = math.prod(shape)
            new_shape = (numel,) if shape != (numel,) else (1, numel)
            out[name] = (dtype, new_shape, raw.copy())
        elif op == "resize":
            new_shape = data.draw(st.sampled_from([s for s in SHAPES if s != shape]))
            out[name] = (dtype, new_shape, _fill(dtype, new_shape, "random", rng))
        elif op == "retype":
            new_dtype = data.draw(st.sampled_from(sorted(set(TORCH_DTYPES) - {dtype})))
            out[name] = (new_dtype, shape, _fill(new_dtype, shape, "random", rng))
        else:
            out[name] = (dtype, shape, _mutate(dtype, raw, op, rng))
    added = data.draw(st.dictionaries(st.sampled_from(NAMES), tensor_st, max_size=2), label="add")
    for name, spec in added.items():
        out.setdefault(name, _new_tensor(spec, rng))
    return out


@settings(SETTINGS, max_examples=100)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_file_roundtrip(data: st.DataObject, seed: int) -> None:
    rng = np.random.default_rng(seed)
    specs = data.draw(st.dictionaries(st.sampled_from(NAMES), tensor_st, max_size=4), label="base")
    base = {k: _new_tensor(v, rng) for k, v in specs.items()}
    new = _step(data, base, rng)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        _save(t / "base.safetensors", base, data.draw(metadata_st, label="base meta"))
        _save(t / "new.safetensors", new, data.draw(metadata_st, label="new meta"))
        ctx = data.draw(st.booleans(), label="context codec (--level max)")
        a, b = t / "base.safetensors", t / "new.safetensors"
        patch = assert_roundtrip(a, b, t, block_bytes=4096, context=ctx)
        assert patch_bytes(a, b, block_bytes=4096, workers=3, context=ctx) == patch


@settings(SETTINGS, max_examples=25)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), length=st.integers(1, 5))
def test_chain_roundtrip(data: st.DataObject, seed: int, length: int) -> None:
    rng = np.random.default_rng(seed)
    specs = data.draw(
        st.dictionaries(st.sampled_from(NAMES), tensor_st, min_size=1, max_size=3), label="base"
    )
    versions = [{k: _new_tensor(v, rng) for k, v in specs.items()}]
    for _ in range(length):
        versions.append(_step(data, versions[-1], rng))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        paths = [t / f"v{i}.safetensors" for i in range(len(versions))]
        for path, version in zip(paths, versions, strict=True):
            _save(path, version, {"format": "pt"})
        patches = []
        for i in range(length):
            p = t / f"p{i + 1}.pulse"
            options = DiffOptions(block_bytes=4096, workers=2, context=i % 2 == 1)
            diff_to_path(paths[i], paths[i + 1], p, options=options)
            patches.append(p)
        apply_patches(paths[0], patches, t / "out.safetensors", workers=2)
        assert (t / "out.safetensors").read_bytes() == paths[-1].read_bytes()
        assert raw_tensors(t / "out.safetensors") == raw_tensors(paths[-1])
        assert not list(t.glob(TEMP_GLOB))


# ---- sharded folders ----------------------------------------------------------------------

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
Folder = dict[str, Any]  # relpath -> dict of tensors (a shard) or bytes (a blob)


def _write_folder(root: Path, folder: Folder) -> None:
    root.mkdir()
    weight_map = {}
    for rel, content in sorted(folder.items()):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, dict):
            _save(path, content, {"format": "pt"})
            weight_map.update(dict.fromkeys(sorted(content), rel))
        else:
            path.write_bytes(content)
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _config(rng: np.random.Generator, width: int = 4) -> bytes:
    return json.dumps({"model_type": "qwen2", "seed": int(rng.integers(0, 10**width))}).encode()


def _folder_step(data: st.DataObject, folder: Folder, rng: np.random.Generator) -> Folder:
    out: Folder = {}
    moved: dict[str, Tensor] = {}
    for rel, content in folder.items():
        if not isinstance(content, dict):
            op = data.draw(st.sampled_from(["same", "same size", "resize", "remove"]), label=rel)
            if op == "same":
                out[rel] = content
            elif op == "same size":
                out[rel] = content[:-2] + bytes(rng.integers(0, 256, 2, dtype=np.uint8))
            elif op == "resize":
                out[rel] = content + b"\n"
            continue
        if data.draw(st.booleans(), label=f"drop {rel}") and len(folder) > 2:
            continue
        tensors = _step(data, {k[len(rel) + 1 :]: v for k, v in content.items()}, rng)
        tensors = {f"{rel}.{k}": v for k, v in tensors.items()}
        if tensors and data.draw(st.booleans(), label=f"move from {rel}"):
            name = sorted(tensors)[0]
            moved[name] = tensors.pop(name)
        out[rel] = tensors
    if data.draw(st.booleans(), label="add file"):
        out.setdefault("extra/tokenizer.txt", bytes(rng.integers(0, 256, 300, dtype=np.uint8)))
    shards = [rel for rel, c in out.items() if isinstance(c, dict)] or [SHARDS[1]]
    out.setdefault(shards[-1], {}).update(moved)  # a tensor moved to another shard
    return out


@settings(SETTINGS, max_examples=25)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_folder_roundtrip(data: st.DataObject, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base: Folder = {"config.json": _config(rng)}
    for rel in SHARDS:
        specs = data.draw(st.dictionaries(st.sampled_from(NAMES), tensor_st, max_size=3), label=rel)
        base[rel] = {f"{rel}.{k}": _new_tensor(v, rng) for k, v in specs.items()}
    new = _folder_step(data, base, rng)
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        _write_folder(t / "base", base)
        _write_folder(t / "new", new)
        patch = assert_roundtrip(t / "base", t / "new", t, block_bytes=4096)
        assert patch_bytes(t / "base", t / "new", block_bytes=4096, workers=3) == patch


# ---- realistic chains and hand-made cases ------------------------------------------------


@pytest.mark.parametrize(
    ("block_bytes", "context", "level"),
    [(4096, False, 3), (8 * 1024 * 1024, False, 1), (4096, True, 19), (8 * 1024 * 1024, True, 3)],
)
def test_synth_chain_each_step(
    chain: list[Path], tmp_path: Path, block_bytes: int, context: bool, level: int
) -> None:
    for old, new in zip(chain, chain[1:], strict=False):
        assert_roundtrip(old, new, tmp_path, block_bytes=block_bytes, context=context, level=level)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5])
def test_synth_chain_apply(chain: list[Path], tmp_path: Path, length: int) -> None:
    patches = []
    for i in range(length):
        p = tmp_path / f"p{i + 1}.pulse"
        p.write_bytes(patch_bytes(chain[i], chain[i + 1], block_bytes=4096))
        patches.append(p)
    out = tmp_path / "out.safetensors"
    summary = apply_patches(chain[0], patches, out, workers=2)
    assert out.read_bytes() == chain[length].read_bytes()
    assert summary.patches == length
    assert not list(tmp_path.glob(TEMP_GLOB))


def test_sharded_chain(sharded_chain: list[Path], tmp_path: Path) -> None:
    patches = []
    for i, (old, new) in enumerate(zip(sharded_chain, sharded_chain[1:], strict=False)):
        patches.append(tmp_path / f"p{i}.pulse")
        patches[-1].write_bytes(assert_roundtrip(old, new, tmp_path, block_bytes=4096))
    apply_patches(sharded_chain[0], patches, tmp_path / "out", workers=2)
    assert tree_bytes(tmp_path / "out") == tree_bytes(sharded_chain[-1])
    assert raw_tensors(tmp_path / "out") == raw_tensors(sharded_chain[-1])


def test_sharded_config_changes_and_files_come_and_go(
    sharded_chain: list[Path], tmp_path: Path
) -> None:
    import shutil

    base, new = tmp_path / "base", tmp_path / "new"
    shutil.copytree(sharded_chain[0], base)
    shutil.copytree(sharded_chain[1], new)
    config = json.loads((new / "config.json").read_text())
    config["torch_dtype"] = "float16"  # a blob whose size changes
    (new / "config.json").write_text(json.dumps(config))
    (new / "generation_config.json").write_text('{"do_sample": true}')  # a file added
    (base / "tokenizer.json").write_text('{"vocab": {}}')  # a file removed
    (new / "sub").mkdir()
    (new / "sub" / "notes.txt").write_bytes(b"")  # an empty file in a subfolder
    assert_roundtrip(base, new, tmp_path, block_bytes=4096)


def test_metadata_only_change(tmp_path: Path) -> None:
    tensors = {"x": torch.arange(2000, dtype=torch.float32)}
    safetensors.torch.save_file(tensors, tmp_path / "a.safetensors", {"format": "pt"})
    safetensors.torch.save_file(tensors, tmp_path / "b.safetensors", {"format": "pt", "k": "v"})
    patch = assert_roundtrip(tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path)
    info = read_patch_info(io.BytesIO(patch))
    assert info.changed_words == 0


def test_many_tensors_roundtrip(tmp_path: Path) -> None:
    """An MoE-like checkpoint of 6,000 small tensors: its header and trailer JSON pass 1 MiB
    (written at the faster zstd level), and every tensor still round-trips and is listed."""
    from pulsectl.format import LARGE_JSON_BYTES, PatchReader, canonical_json

    g = torch.Generator().manual_seed(1)
    old = torch.randn(6000, 32, generator=g).to(torch.bfloat16)
    new = old.clone()
    new[::7, 3] += 0.5
    a = {f"model.layers.{i // 100}.mlp.experts.{i % 100}.w": old[i].clone() for i in range(6000)}
    b = {k: new[i].clone() for i, k in enumerate(a)}
    safetensors.torch.save_file(a, tmp_path / "a.safetensors")
    safetensors.torch.save_file(b, tmp_path / "b.safetensors")
    patch = assert_roundtrip(tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path)
    assert len(canonical_json(PatchReader(io.BytesIO(patch), "p").header)) > LARGE_JSON_BYTES
    info = read_patch_info(io.BytesIO(patch))
    tensors = info.to_json()["tensors"]
    assert len(tensors) == 6000
    assert all(t["dtype"] == "BF16" and t["shape"] == [32] for t in tensors)
    assert info.changed_words == int((new != old).sum())


def test_identical_checkpoints_make_a_copy_only_patch(chain: list[Path], tmp_path: Path) -> None:
    patch = assert_roundtrip(chain[0], chain[0], tmp_path, block_bytes=4096)
    info = read_patch_info(io.BytesIO(patch))
    assert info.changed_words == 0
    assert info.trailer.target_fingerprint == info.header.base_fingerprint


def test_numpy_writer_every_integer_width(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    dtypes = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.float16, np.float32, np.float64]
    base = {f"t{i}": rng.integers(-100, 100, 777).astype(d) for i, d in enumerate(dtypes)}
    base["flag"] = rng.integers(0, 2, 13).astype(bool)
    new = {k: v.copy() for k, v in base.items()}
    for v in new.values():
        v[::50] = v[::50] + 1 if v.dtype != bool else ~v[::50]
    safetensors.numpy.save_file(base, tmp_path / "a.safetensors")
    safetensors.numpy.save_file(new, tmp_path / "b.safetensors")
    assert_roundtrip(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path, block_bytes=4096
    )
    loaded = safetensors.numpy.load_file(tmp_path / "roundtrip.out")
    assert loaded.keys() == new.keys()
    for k, v in new.items():
        np.testing.assert_array_equal(loaded[k], v)


def test_empty_file_to_full_and_back(tmp_path: Path) -> None:
    safetensors.torch.save_file({}, tmp_path / "empty.safetensors")
    safetensors.torch.save_file({"x": torch.ones(3, 5)}, tmp_path / "full.safetensors")
    assert_roundtrip(tmp_path / "empty.safetensors", tmp_path / "full.safetensors", tmp_path)
    assert_roundtrip(tmp_path / "full.safetensors", tmp_path / "empty.safetensors", tmp_path)


# ---- determinism -------------------------------------------------------------------------


def test_same_inputs_same_patch_bytes(chain: list[Path], sharded_chain: list[Path]) -> None:
    for old, new in [(chain[0], chain[3]), (sharded_chain[0], sharded_chain[2])]:
        patches = {patch_bytes(old, new, block_bytes=4096, workers=w) for w in (1, 1, 2, 4, 7)}
        assert len(patches) == 1
        patches = {patch_bytes(old, new, context=True, workers=w) for w in (1, 1, 3)}
        assert len(patches) == 1
        buf = io.BytesIO()
        diff_checkpoints(old, new, buf)  # default options: all cores, 8 MiB blocks
        assert buf.getvalue() == patch_bytes(old, new)


@pytest.mark.parametrize("held", [0, 1 << 30])
def test_diff_bytes_do_not_depend_on_workers_or_the_base_scan(
    chain: list[Path], monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    """The base is hashed on its own thread while blocks are encoded; frames wait in memory
    until the header can be written (``held`` = 0: every frame waits for the scan at once).
    The patch is the same bytes whatever the workers and the timing."""
    import pulsectl.diff

    monkeypatch.setattr(pulsectl.diff, "HELD_BYTES", held)
    one = patch_bytes(chain[0], chain[3], block_bytes=4096, workers=1)
    for workers in (2, 5):
        assert patch_bytes(chain[0], chain[3], block_bytes=4096, workers=workers) == one


def test_higher_levels_are_never_larger_than_the_default(tmp_path: Path):
    """`--level` is a size/speed trade-off: above the default level the value planes keep the
    default level's frame when the level's own zstd parameters do worse on them (they did at
    levels 4-18, by 1-3% of the patch), so no level above it writes a larger patch."""
    old, new = generate_chain(tmp_path, "tiny", steps=1, lr=3e-5, seed=3)
    default = len(patch_bytes(old, new, level=3))
    sizes = {level: len(patch_bytes(old, new, level=level)) for level in (4, 6, 9, 12)}
    assert all(size <= default for size in sizes.values()), (default, sizes)
