"""Checkpoints as real trainers and hubs write them, beyond what pulsectl.synth generates.

Each case builds small checkpoints with torch and the official safetensors writers (nothing is
downloaded) and checks what a user would: the round trip is exact (bytes and the tensors the
official loader reads), ``hash`` agrees with the target, ``stats`` of the pair and of the patch
agree, the patch is never much larger than what it carries, and refusals are one line naming
the tensor and the fix. Layouts and dtypes drawn at random are covered by test_roundtrip.py;
this file holds the update patterns (AdamW in mixed precision and in pure BF16, LoRA merges,
re-initialized layers, frozen layers, weight decay) and the hub conventions (sharded folders
whose shards are renamed, tied weights deduplicated by ``save_model``, diffusers pipelines).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import assert_roundtrip, raw_tensors

from pulsectl.checkpoint import Checkpoint
from pulsectl.cli.app import main
from pulsectl.inventory import fingerprint_of
from pulsectl.stats import pair_stats, patch_stats

# What a patch costs beyond the bytes it must carry: preamble, header (fingerprints, the target
# header), trailer and footer. A copy-only patch of one tensor is ~540 bytes.
OVERHEAD = 1024


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bf16(*shape: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _save(path: Path, tensors: dict[str, torch.Tensor], **kw: Any) -> Path:
    safetensors.torch.save_file(tensors, path, metadata=kw.get("metadata", {"format": "pt"}))
    return path


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _check(base: Path, new: Path, tmp: Path, **options: Any) -> tuple[bytes, dict[str, Any]]:
    """Round trip, fingerprints and the two kinds of stats; returns the patch and the pair's
    total figures."""
    patch = assert_roundtrip(base, new, tmp, **options)
    out = tmp / "roundtrip.out"
    assert fingerprint_of(Checkpoint.open(out)) == fingerprint_of(Checkpoint.open(new))
    pair = pair_stats(base, new, workers=1, measure_patch=False).to_json()["total"]
    (tmp / "p.pulse").write_bytes(patch)
    from_patch = patch_stats(tmp / "p.pulse").to_json()["total"]
    for key in ("words", "changed_words", "target_bytes"):
        assert pair[key] == from_patch[key], key
    assert sum(from_patch["histogram"].values()) == from_patch["changed_words"]
    return patch, pair


def _changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Words whose bits differ (bit comparison: -0.0 != +0.0, NaN payloads count)."""
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(word) != b.contiguous().view(word)).sum())


# ---- update patterns -----------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    """A transformer-shaped toy: embedding tied to the LM head, norms, biases, a router."""

    def __init__(self, vocab: int = 97, dim: int = 32) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "input_layernorm": torch.nn.LayerNorm(dim),
                    "q_proj": torch.nn.Linear(dim, dim),
                    "router": torch.nn.Linear(dim, 4, bias=False),
                    "up_proj": torch.nn.Linear(dim, 2 * dim),
                    "down_proj": torch.nn.Linear(2 * dim, dim),
                }
            )
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("position_ids", torch.arange(64).unsqueeze(0), persistent=True)
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x)
        for layer in self.layers:
            h = h + layer["q_proj"](layer["input_layernorm"](h))
            h = h + layer["down_proj"](torch.relu(layer["up_proj"](h)))
            h = h * torch.sigmoid(layer["router"](h)).mean(-1, keepdim=True)
        return self.lm_head(self.norm(h))


def _train_step(model: _Tiny, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    x = torch.randint(0, model.vocab, (4, 16), generator=g)
    logits = model(x).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, model.vocab), x.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The worker's BF16 checkpoint of an FP32 master: floats cast, buffers kept, tied head
    left out (as HF save_pretrained does)."""
    return {
        k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }


def test_adamw_mixed_precision_chain(tmp_path: Path) -> None:
    """FP32 master weights, AdamW at a small learning rate, BF16 casts published each step:
    most BF16 words stay put, the patch is much smaller than the checkpoint, and the buffers
    (I64 position ids) never change."""
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = _gen(1)
    paths = [_save(tmp_path / "s0.safetensors", _bf16_state(model))]
    for i in range(1, 4):
        _train_step(model, opt, g)
        paths.append(_save(tmp_path / f"s{i}.safetensors", _bf16_state(model)))
    for a, b in zip(paths, paths[1:], strict=False):
        patch, pair = _check(a, b, tmp_path)
        assert pair["density"] < 0.5
        assert len(patch) < _size(b) / 3
    # the whole chain in one go, and squashed
    ps = []
    for i, (a, b) in enumerate(zip(paths, paths[1:], strict=False)):
        ps.append(tmp_path / f"p{i}.pulse")
        assert main(["-q", "diff", str(a), str(b), "-o", str(ps[-1])]) == 0
    assert main(["-q", "apply", str(paths[0]), *map(str, ps), "-o", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o").read_bytes() == paths[-1].read_bytes()
    sq = tmp_path / "sq.pulse"
    assert main(["-q", "squash", *map(str, ps), "-o", str(sq)]) == 0
    assert main(["-q", "apply", str(paths[0]), str(sq), "-o", str(tmp_path / "o2")]) == 0
    assert (tmp_path / "o2").read_bytes() == paths[-1].read_bytes()


def test_adamw_pure_bf16_with_frozen_embedding(tmp_path: Path) -> None:
    """Training in BF16 itself (the update is rounded in BF16), with the embedding frozen:
    the frozen tensor has zero changes in stats, and the round trip is exact."""
    torch.manual_seed(0)
    model = _Tiny().to(torch.bfloat16)
    model.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    a = tmp_path / "a.safetensors"
    b = tmp_path / "b.safetensors"
    safetensors.torch.save_model(model, str(a), metadata={"format": "pt"})
    _train_step(model, opt, _gen(2))
    safetensors.torch.save_model(model, str(b), metadata={"format": "pt"})
    _check(a, b, tmp_path)
    figures = pair_stats(a, b, workers=1, measure_patch=False).to_json()
    by_name = {t["name"]: t for t in figures["tensors"]}
    assert by_name["embed_tokens.weight"]["changed_words"] == 0
    assert by_name["position_ids"]["changed_words"] == 0
    assert by_name["layers.0.q_proj.weight"]["changed_words"] > 0


def test_weight_decay_only_and_lr_zero_warmup(tmp_path: Path) -> None:
    """Decoupled weight decay alone (w *= 1 - lr*wd) moves a few BF16 words by one ulp; the
    first step of a warmup from lr 0 moves none: a copy-only patch of constant size."""
    w = torch.randn(128, 128, generator=_gen(3))
    a = _save(tmp_path / "a.safetensors", {"w": w.to(torch.bfloat16)})
    b = _save(tmp_path / "b.safetensors", {"w": (w * (1 - 1e-3 * 0.1)).to(torch.bfloat16)})
    patch, pair = _check(a, b, tmp_path)
    assert 0 < pair["changed_words"] < pair["words"] // 20
    assert pair["histogram"]["1"] == pair["changed_words"]  # all one-ulp moves
    assert len(patch) < OVERHEAD + 2 * pair["changed_words"]
    patch, pair = _check(a, a, tmp_path)
    assert pair["changed_words"] == 0 and len(patch) < OVERHEAD


def test_lora_merge_is_dense_but_small(tmp_path: Path) -> None:
    """A LoRA adapter merged into a BF16 weight (W + A @ B, rank 8) changes most words by a few
    ulps: the patch stays far below the tensor's size."""
    g = _gen(4)
    w = _bf16(256, 256, g=g)
    lora_a = torch.randn(256, 8, generator=g) * 0.05
    lora_b = torch.randn(8, 256, generator=g) * 0.05
    merged = (w.float() + lora_a @ lora_b).to(torch.bfloat16)
    a = _save(tmp_path / "a.safetensors", {"q_proj.weight": w, "bias": torch.zeros(256)})
    b = _save(tmp_path / "b.safetensors", {"q_proj.weight": merged, "bias": torch.zeros(256)})
    patch, pair = _check(a, b, tmp_path)
    assert pair["changed_words"] == _changed(w, merged)
    assert len(patch) < w.numel() * 2 * 0.8


@pytest.mark.parametrize(
    ("dtype", "numel"),
    [(torch.bfloat16, 70_000), (torch.float32, 40_000), (torch.uint8, 150_000)],
)
def test_reinitialized_layer_costs_at_most_its_size(
    tmp_path: Path, dtype: torch.dtype, numel: int
) -> None:
    """A layer re-initialized with random values (or an incompressible U8 quantized weight
    replaced) cannot compress: the patch falls back to storing it raw and must not exceed the
    tensor's size by more than the fixed overhead, at every level."""
    g = _gen(5)

    def rand() -> torch.Tensor:
        if dtype == torch.uint8:
            return torch.randint(0, 256, (numel,), generator=g, dtype=torch.uint8)
        return torch.randn(numel, generator=g).to(dtype)

    keep = _bf16(64, g=g)
    a = _save(tmp_path / "a.safetensors", {"layer.w": rand(), "keep": keep})
    b = _save(tmp_path / "b.safetensors", {"layer.w": rand(), "keep": keep})
    tensor_bytes = numel * torch.empty(0, dtype=dtype).element_size()
    for level in ({}, {"context": True, "level": 19}, {"block_bytes": 65536}):
        patch, _ = _check(a, b, tmp_path, **level)
        assert len(patch) <= tensor_bytes + OVERHEAD, level


def test_special_values_are_kept_bit_for_bit(tmp_path: Path) -> None:
    """-0.0 vs +0.0, NaNs (two payloads), +-Inf and denormals appearing in NEW, sign flips of a
    whole tensor: all are changes, counted by bits, and rebuilt exactly."""
    g = _gen(6)
    zeros = torch.zeros(1000, dtype=torch.bfloat16)
    x = _bf16(1000, g=g)
    nan_inf = x.clone()
    nan_inf[::7] = float("nan")
    nan_inf[1::7] = float("inf")
    nan_inf[2::7] = float("-inf")
    nan_inf.view(torch.int16)[3::7] = 0x7FC1  # another NaN payload
    denorm = torch.zeros(999, dtype=torch.float32)
    denorm[::3] = 1e-40
    denorm[1::3] = -1e-45
    base = {"z": zeros, "x": x, "d": torch.zeros(999), "s": x.clone(), "f16": x.half()}
    new = {"z": -zeros, "x": nan_inf, "d": denorm, "s": -x, "f16": (-x).half()}
    a = _save(tmp_path / "a.safetensors", base)
    b = _save(tmp_path / "b.safetensors", new)
    _, pair = _check(a, b, tmp_path)
    assert pair["changed_words"] == sum(_changed(base[k], new[k]) for k in base)
    loaded = safetensors.torch.load_file(tmp_path / "roundtrip.out")
    assert torch.signbit(loaded["z"]).all()
    assert loaded["x"].view(torch.int16)[3].item() == 0x7FC1


# ---- dtypes, names and layouts real models have ----------------------------------------------


def _mixed(g: torch.Generator) -> dict[str, torch.Tensor]:
    long_name = "model." + ".".join(f"very_long_module_name_{i}" for i in range(30)) + ".weight"
    return {
        "model.embed_tokens.weight": _bf16(300, 32, g=g),
        "model.layers.0.input_layernorm.weight": torch.ones(32),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(33, generator=g),
        "model.layers.0.mlp.gate.weight": torch.randn(8, 32, generator=g),  # F32 router
        "model.layers.0.f16": torch.randn(17, 5, generator=g).half(),
        "model.position_ids": torch.arange(512).unsqueeze(0),
        "model.causal_mask": torch.tril(torch.ones(16, 16, dtype=torch.bool)),
        "fp8.weight": torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn),
        "fp8.grad_like": torch.randn(63, generator=g).to(torch.float8_e5m2),
        "fp8.weight_scale": torch.tensor(0.5),
        "q.qweight": torch.randint(0, 256, (64, 16), generator=g, dtype=torch.uint8),
        "q.qweight_i8": torch.randint(-128, 128, (64, 16), generator=g, dtype=torch.int8),
        "q.scales": torch.rand(64, generator=g),
        "q.scales_bf16": torch.rand(64, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 7, dtype=torch.bfloat16),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "odd": _bf16(101, g=g),
        long_name: _bf16(7, 3, g=g),
        "a/b/c.weight": _bf16(9, g=g),
        "ünïcödé.名前.weight": _bf16(11, g=g),
        "dots...weight": _bf16(5, g=g),
    }


def test_mixed_dtypes_and_names_small_update(tmp_path: Path) -> None:
    """One file as quantized and FP8 models have them: BF16 weights, F32 norms, biases and
    router, F16, I64 position ids, BOOL masks, FP8 weights with F32 scales, U8/I8 weights with
    F32/BF16 scales, empty, scalar and odd-length tensors, long and unicode names."""
    base = _mixed(_gen(7))
    new = {k: v.clone() for k, v in base.items()}
    new["model.embed_tokens.weight"][::7] += 0.01
    new["model.layers.0.input_layernorm.weight"][3] = 1.0001
    new["model.position_ids"][0, 5] = 7
    new["model.causal_mask"][0, 1] = True
    new["fp8.weight"] = (base["fp8.weight"].float() * 1.05).to(torch.float8_e4m3fn)
    new["fp8.weight_scale"] = torch.tensor(0.51)
    new["q.qweight"][0] += 1
    new["q.scales"] *= 1.001
    new["scalar"] = torch.tensor(-0.0, dtype=torch.bfloat16)
    new["odd"][-1] = float("nan")
    new["ünïcödé.名前.weight"] = -new["ünïcödé.名前.weight"]
    a = _save(tmp_path / "a.safetensors", base)
    b = _save(tmp_path / "b.safetensors", new)
    patch, pair = _check(a, b, tmp_path)
    assert pair["changed_words"] == sum(_changed(base[k], new[k]) for k in base)
    assert len(patch) < _size(b) / 4
    assert raw_tensors(tmp_path / "roundtrip.out").keys() == set(new)


def _write_raw(
    path: Path,
    tensors: dict[str, torch.Tensor],
    json_order: list[str],
    data_order: list[str],
    metadata_last: bool = False,
    extra_pad: int = 0,
) -> Path:
    """A safetensors file as other writers lay it out: data in ``data_order``, JSON keys in
    ``json_order``, ``__metadata__`` first or last, padded with spaces past the 8-byte mark."""
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}
    entries, blobs, offset = {}, [], 0
    for name in data_order:
        t = tensors[name].contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        entries[name] = {
            "dtype": dtypes[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        blobs.append(raw)
    doc: dict[str, Any] = {} if metadata_last else {"__metadata__": {"format": "pt"}}
    doc.update({name: entries[name] for name in json_order})
    if metadata_last:
        doc["__metadata__"] = {"format": "pt"}
    header = json.dumps(doc).encode()  # with spaces after ':' and ',', as json.dumps writes
    header += b" " * (-len(header) % 8 + extra_pad)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"".join(blobs))
    return path


def test_other_writers_layouts(tmp_path: Path) -> None:
    """Tensors stored out of name order, JSON keys in a different order in BASE and NEW,
    metadata last, extra header padding: tensors are matched by name, the target's header is
    kept byte for byte, and only the changed words are sent."""
    g = _gen(8)
    base = {"z.weight": _bf16(64, 64, g=g), "a.bias": torch.randn(64, generator=g)}
    base["m.ids"] = torch.arange(33)
    new = dict(base)
    new["z.weight"] = (base["z.weight"].float() * 1.001).to(torch.bfloat16)
    a = _write_raw(tmp_path / "a.safetensors", base, ["z.weight", "a.bias", "m.ids"],
                   ["z.weight", "m.ids", "a.bias"])  # fmt: skip
    b = _write_raw(tmp_path / "b.safetensors", new, ["m.ids", "a.bias", "z.weight"],
                   ["a.bias", "z.weight", "m.ids"], metadata_last=True, extra_pad=16)  # fmt: skip
    patch, pair = _check(a, b, tmp_path)
    assert pair["changed_words"] == _changed(base["z.weight"], new["z.weight"])
    assert len(patch) < 2 * pair["changed_words"] + OVERHEAD


def test_shape_and_dtype_changes(tmp_path: Path) -> None:
    """A vocabulary resize of the embedding, a norm cast from F32 to BF16, a tensor removed
    and one added: carried whole, exact, and each counted as all-changed in stats."""
    g = _gen(9)
    emb = _bf16(500, 32, g=g)
    base = {"embed_tokens.weight": emb, "norm.weight": torch.ones(32), "old": _bf16(10, g=g)}
    new = {
        "embed_tokens.weight": torch.cat([emb, _bf16(12, 32, g=g)]),
        "norm.weight": torch.ones(32, dtype=torch.bfloat16),
        "new": _bf16(10, g=g),
    }
    a = _save(tmp_path / "a.safetensors", base)
    b = _save(tmp_path / "b.safetensors", new)
    patch, pair = _check(a, b, tmp_path)
    assert pair["changed_words"] == pair["words"] == 512 * 32 + 32 + 10
    assert pair["histogram"]["no_delta"] == pair["words"]
    assert len(patch) <= _size(b) + OVERHEAD


# ---- Hugging Face folders ------------------------------------------------------------------


def _hf_folder(root: Path, shards: list[dict[str, torch.Tensor]], readme: str = "# card\n") -> Path:
    root.mkdir()
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(root / name, tensors)
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    (root / "generation_config.json").write_text('{"do_sample": true}')
    tokenizer = {"model": {"vocab": {f"tok{i}": i for i in range(300)}}}
    (root / "tokenizer.json").write_text(json.dumps(tokenizer))
    (root / "tokenizer_config.json").write_text("{}")
    (root / "README.md").write_text(readme)
    return root


def _layers(g: torch.Generator, n: int = 6) -> list[dict[str, torch.Tensor]]:
    return [
        {
            f"model.layers.{i}.mlp.weight": _bf16(48, 48, g=g),
            f"model.layers.{i}.norm": torch.ones(48),
        }
        for i in range(n)
    ]


def _trained(layers: list[dict[str, torch.Tensor]], g: torch.Generator) -> list[dict[str, Any]]:
    out = []
    for layer in layers:
        step = {}
        for k, v in layer.items():
            noise = 0.005 * torch.randn(v.shape, generator=g)
            step[k] = (v.float() + noise).to(v.dtype) if v.dtype == torch.bfloat16 else v
        out.append(step)
    return out


def _merge(layers: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: v for layer in layers for k, v in layer.items()}


def test_hf_sharded_folder_reshards(tmp_path: Path) -> None:
    """A 3-shard HF folder with its index, config, tokenizer and README, then the same model
    re-sharded (tensors move between shards; 3 shards become 4, so every shard name changes)
    and back: tensors are found by name wherever they are, the non-tensor files are carried
    when they change, hidden files are left out, and every round trip is exact."""
    g = _gen(10)
    layers = _layers(g)
    trained = _trained(layers, g)
    a = _hf_folder(tmp_path / "a", [_merge(layers[0:2]), _merge(layers[2:4]), _merge(layers[4:])])
    b = _hf_folder(
        tmp_path / "b",
        [_merge(trained[0:1]), _merge(trained[1:4]), _merge(trained[4:5]), _merge(trained[5:])],
        readme="# card v2\n",
    )
    (b / "tokenizer_config.json").unlink()
    (a / ".cache" / "huggingface").mkdir(parents=True)  # hidden: not part of the checkpoint
    (a / ".cache" / "huggingface" / "meta").write_text("x")
    (a / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    work = tmp_path / "work"
    work.mkdir()
    patch, pair = _check(a, b, work)
    assert not (work / "roundtrip.out" / ".gitattributes").exists()
    same = _hf_folder(tmp_path / "same", [_merge(trained[0:3]), _merge(trained[3:])])
    (same / "README.md").write_text("# card v2\n")
    (same / "tokenizer_config.json").unlink()
    patch2, pair2 = _check(b, same, work)
    assert pair2["changed_words"] == 0  # the same tensors in other shards: nothing to send
    assert len(patch2) < len(patch) / 4


def test_hf_folder_cli_messages(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """diff between a folder and a single file is refused on one line naming both; hash of
    the folder agrees before and after apply."""
    g = _gen(11)
    layers = _layers(g, 2)
    a = _hf_folder(tmp_path / "a", [_merge(layers)])
    single = _save(tmp_path / "single.safetensors", _merge(layers))
    assert main(["diff", str(a), str(single), "-o", str(tmp_path / "p.pulse")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "folder" in err and "single file" in err
    b = shutil.copytree(a, tmp_path / "b")
    (b / "config.json").write_text('{"model_type": "llama", "vocab_size": 65}')
    p = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(a), str(b), "-o", str(p)]) == 0
    assert main(["-q", "apply", str(a), str(p), "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["hash", str(b), str(tmp_path / "out")]) == 0
    hashes = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert len(hashes) == 1


def test_as_bf16_patch_applied_to_the_fp32_master(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `diff --as bf16` patch applies to the BF16 cast, not to the FP32 master it was made
    from. Applied to the master, the refusal used to say "apply the patch to the checkpoint it
    was made from", which is what the user did; it now says to apply it to the cast."""
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    safetensors.torch.save_model(model, str(a), metadata={"format": "pt"})
    _train_step(model, opt, _gen(12))
    safetensors.torch.save_model(model, str(b), metadata={"format": "pt"})
    p = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(a), str(b), "--as", "bf16", "-o", str(p)]) == 0
    capsys.readouterr()
    assert main(["apply", str(a), str(p), "-o", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "F32" in err and "BF16" in err and "pulsectl cast" in err, err
    assert not (tmp_path / "out").exists()
    anchor, cast_b = tmp_path / "anchor.safetensors", tmp_path / "b16.safetensors"
    assert main(["-q", "cast", str(a), "--to", "bf16", "-o", str(anchor)]) == 0
    assert main(["-q", "cast", str(b), "--to", "bf16", "-o", str(cast_b)]) == 0
    assert main(["-q", "apply", str(anchor), str(p), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").read_bytes() == cast_b.read_bytes()
    ids = safetensors.torch.load_file(tmp_path / "out")["position_ids"]
    assert ids.dtype == torch.int64  # buffers are not cast


def test_diffusers_pipeline_with_same_names_in_two_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A diffusers pipeline folder holds several models whose tensors have the same names
    (text_encoder/ and text_encoder_2/). pulsectl matches tensors by name across a folder, so
    it refuses the folder; the message used to say "remove one copy" (of a model's weights).
    It now says to diff each model's folder, which works."""
    g = _gen(13)
    root = tmp_path / "a"
    for sub in ("text_encoder", "text_encoder_2"):
        (root / sub).mkdir(parents=True)
        clip = {"text_model.embeddings.position_embedding.weight": _bf16(77, 16, g=g)}
        _save(root / sub / "model.safetensors", clip)
        (root / sub / "config.json").write_text("{}")
    (root / "unet").mkdir()
    _save(root / "unet" / "diffusion_pytorch_model.safetensors", {"conv_in.weight": _bf16(8, g=g)})
    (root / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    b = shutil.copytree(root, tmp_path / "b")
    assert main(["diff", str(root), str(b), "-o", str(tmp_path / "p.pulse")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "text_encoder/model.safetensors" in err and "text_encoder_2/model.safetensors" in err
    assert "remove one copy" not in err and "each model's folder" in err, err
    enc = "text_encoder_2"
    _check(root / enc, b / enc, tmp_path)


def test_git_lfs_pointer_instead_of_a_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hugging Face repo cloned without git-lfs holds ~130-byte pointer files where its
    shards should be. They were refused as "header length 2336927755350992246 exceeds the
    limit"; the message now says what the file is and how to get the weights."""
    root = tmp_path / "clone"
    root.mkdir()
    (root / "model-00001-of-00002.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 4976698672\n"
    )
    (root / "config.json").write_text("{}")
    assert main(["hash", str(root)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "model-00001-of-00002.safetensors: a Git LFS pointer" in err, err
    assert "git lfs pull" in err, err
