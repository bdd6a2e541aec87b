"""Synthetic chains: shapes, determinism, files the official library reads, realistic change."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pulsectl.synth import INDEX_NAME, PRESETS, ModelShape, generate_chain, shapes


def _words(path: Path) -> dict[str, np.ndarray]:
    """BF16 tensors of a file or HF directory as uint16 words, read by the official library."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    out: dict[str, np.ndarray] = {}
    for f in files:
        for name, t in load_file(f).items():
            assert t.dtype == torch.bfloat16, name
            out[name] = t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
    return out


def _change(old: Path, new: Path) -> tuple[float, float]:
    """(share of words changed, share of changed words that moved by exactly +-1)."""
    a, b = _words(old), _words(new)
    deltas = np.concatenate([b[k].astype(np.int32) - a[k].astype(np.int32) for k in sorted(a)])
    changed = np.count_nonzero(deltas)
    return changed / deltas.size, np.count_nonzero(np.abs(deltas) == 1) / max(changed, 1)


def test_presets_have_the_real_parameter_counts() -> None:
    assert PRESETS["qwen2.5-0.5b"].num_params() == 494_032_768
    assert PRESETS["qwen2.5-7b"].num_params() == 7_615_616_512
    assert PRESETS["tiny"].num_params() * 2 < 100_000
    assert 10e6 <= PRESETS["small"].num_params() * 2 <= 20e6


def test_shapes_use_hf_qwen2_names() -> None:
    s = shapes("qwen2.5-0.5b")
    assert s["model.embed_tokens.weight"] == (151936, 896)
    assert s["model.layers.23.self_attn.k_proj.weight"] == (128, 896)
    assert s["model.layers.0.self_attn.k_proj.bias"] == (128,)
    assert s["model.layers.0.mlp.down_proj.weight"] == (896, 4864)
    assert s["model.norm.weight"] == (896,)
    assert "lm_head.weight" not in s
    assert "model.layers.24.mlp.up_proj.weight" not in s
    assert shapes("qwen2.5-7b")["lm_head.weight"] == (152064, 3584)
    assert len(shapes(ModelShape(64, 16, 32, 3, 4, 1, tie_embeddings=True))) == 1 + 3 * 12 + 1


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model shape 'huge'"):
        shapes("huge")
    with pytest.raises(ValueError, match="shards"):
        generate_chain(tmp_path, shards=1000)
    with pytest.raises(ValueError, match="steps"):
        generate_chain(tmp_path, steps=-1)
    assert not list(tmp_path.iterdir())


def test_tiny_chain_files_and_determinism(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    a = generate_chain(tmp_path / "a", steps=2, seed=7, progress=lambda d, t: calls.append((d, t)))
    b = generate_chain(tmp_path / "b", steps=2, seed=7)
    c = generate_chain(tmp_path / "c", steps=2, seed=8)
    assert [p.name for p in a] == [f"step_00{i}.safetensors" for i in range(3)]
    assert calls == [(1, 3), (2, 3), (3, 3)]
    for pa, pb, pc in zip(a, b, c, strict=True):
        assert pa.read_bytes() == pb.read_bytes()
        assert pa.read_bytes() != pc.read_bytes()
    expected = shapes("tiny")
    for p in a:
        loaded = load_file(p)
        assert {k: tuple(t.shape) for k, t in loaded.items()} == expected
        assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    assert a[0].read_bytes() != a[1].read_bytes()


def test_fp32_masters_cast_to_the_bf16_files(tmp_path: Path) -> None:
    paths = generate_chain(tmp_path, steps=1, save_fp32=True)
    for p in paths:
        masters = load_file(p.with_name(p.name.replace(".safetensors", ".f32.safetensors")))
        published = load_file(p)
        for name, t in masters.items():
            assert t.dtype == torch.float32
            assert torch.equal(
                t.to(torch.bfloat16).view(torch.int16), published[name].view(torch.int16)
            )
    init = load_file(tmp_path / "step_000.f32.safetensors")
    norms = init["model.layers.0.input_layernorm.weight"]
    assert float(norms.min()) > 0.8 and float(norms.max()) < 1.2
    assert float(init["model.embed_tokens.weight"].std()) == pytest.approx(0.025, rel=0.3)


def test_sharded_directory_like_transformers_writes_it(tmp_path: Path) -> None:
    single = generate_chain(tmp_path / "single", steps=1)
    sharded = generate_chain(tmp_path / "sharded", steps=1, shards=3)
    assert [p.name for p in sharded] == ["step_000", "step_001"]
    for one, folder in zip(single, sharded, strict=True):
        names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [*names, INDEX_NAME, "config.json"]
        )
        raw = (folder / INDEX_NAME).read_text()
        index = json.loads(raw)
        assert raw == json.dumps(index, indent=2, sort_keys=True) + "\n"
        seen = {}
        for name in names:
            for tensor in load_file(folder / name):
                assert tensor not in seen
                seen[tensor] = name
        assert index["weight_map"] == seen
        assert set(seen) == set(shapes("tiny"))
        total = sum(math.prod(s) * 2 for s in shapes("tiny").values())
        assert index["metadata"] == {"total_size": total}
        whole, parts = _words(one), _words(folder)
        assert whole.keys() == parts.keys()
        assert all(np.array_equal(whole[k], parts[k]) for k in whole)
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == "qwen2" and config["torch_dtype"] == "bfloat16"
        assert config["tie_word_embeddings"] is False


@pytest.fixture(scope="module")
def small_chains(tmp_path_factory: pytest.TempPathFactory) -> dict[float, list[Path]]:
    root = tmp_path_factory.mktemp("small")
    steps = {1e-6: 1, 3e-6: 3, 1e-5: 1}  # k-step growth is checked at 3e-6 only
    return {
        lr: generate_chain(root / f"{lr:g}", "small", steps=k, lr=lr) for lr, k in steps.items()
    }


def test_step_density_is_realistic_and_grows_with_lr(small_chains: dict[float, list[Path]]) -> None:
    densities = []
    for _, paths in sorted(small_chains.items()):
        density, unit = _change(paths[0], paths[1])
        assert 0.001 < density < 0.05
        assert unit > 0.7, "most changed words should move by one step of the raw word"
        densities.append(density)
    assert densities == sorted(densities) and densities[0] * 1.5 < densities[-1]


def test_k_step_density_grows_with_k(small_chains: dict[float, list[Path]]) -> None:
    paths = small_chains[3e-6]
    k_step = [_change(paths[0], paths[k])[0] for k in (1, 2, 3)]
    assert k_step[0] < k_step[1] < k_step[2]
    assert k_step[2] < 3 * k_step[0], "k-step change should not simply add up step changes"


def test_cold_start_moves_more_than_warm(tmp_path: Path) -> None:
    warm = generate_chain(tmp_path / "warm", steps=1, lr=1e-5)
    cold = generate_chain(tmp_path / "cold", steps=1, lr=1e-5, warm_start=False)
    assert _change(*cold)[0] > 1.5 * _change(*warm)[0]
