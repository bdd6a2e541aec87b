"""The torch API: patches from and to live state dicts, byte-identical to the file path."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pulsectl.apply import apply_patches
from pulsectl.diff import DiffOptions, diff_checkpoints
from pulsectl.errors import CorruptPatchError, IntegrityError, OutputError, UsageError
from pulsectl.hashing import fingerprint_file
from pulsectl.stats import pair_stats
from pulsectl.torch_api import (
    Publisher,
    apply_patch,
    make_patch,
    state_dict_fingerprint,
    write_patch,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": (torch.randn(300, 64, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.weight": (torch.randn(64, 128, generator=g) * 0.05).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.0.bias": torch.randn(128, generator=g).to(torch.float32),
        "model.step": torch.tensor(7, dtype=torch.int64),
        "model.mask": torch.tensor([True, False, True]),
        "model.empty": torch.zeros(0, 3),
    }


def _step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """A copy with ~frac of the 16-bit words moved by one unit, like an Adam step in BF16."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    for name in ("model.embed.weight", "model.layers.0.mlp.weight"):
        bits = out[name].view(torch.int16)
        mask = torch.rand(bits.shape, generator=g) < frac
        bits[mask] += torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)[
            mask
        ]
    out["model.step"] = out["model.step"] + 1
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)
        ):
            return False
    return True


def test_make_patch_equals_the_file_path(tmp_path: Path):
    old, new = _state(), _step(_state(), 1)
    save_file(old, tmp_path / "a.safetensors")
    save_file(new, tmp_path / "b.safetensors")
    buf = io.BytesIO()
    diff_checkpoints(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", buf, options=DiffOptions(workers=1)
    )
    assert make_patch(old, new, workers=1) == buf.getvalue()
    assert make_patch(old, new, level="max", workers=2) == make_patch(
        old, new, level="max", workers=1
    )


def test_state_dict_fingerprint_is_the_saved_files(tmp_path: Path):
    state = _state()
    save_file(state, tmp_path / "a.safetensors")
    assert state_dict_fingerprint(state) == fingerprint_file(tmp_path / "a.safetensors")


@pytest.mark.parametrize("level", [3, "max"])
def test_apply_patch_in_place(level):
    old, new = _state(), _step(_state(), 2, frac=0.05)
    # also: -0.0 and a NaN payload change, a removed, an added and a reshaped tensor
    new["model.layers.0.bias"][3] = (
        -0.0 if old["model.layers.0.bias"][3] == 0 else -old["model.layers.0.bias"][3]
    )
    new["model.layers.0.norm.weight"].view(torch.int16)[5] = 0x7FC1
    del new["model.mask"]
    new["model.extra"] = torch.arange(6, dtype=torch.float16)
    new["model.layers.0.bias"] = new["model.layers.0.bias"].reshape(2, 64)
    patch = make_patch(old, new, level=level)
    state = {k: v.clone() for k, v in old.items()}
    embed_storage = state["model.embed.weight"].data_ptr()
    fp = apply_patch(state, patch)
    assert _same(state, new)
    assert state["model.embed.weight"].data_ptr() == embed_storage  # updated in place
    assert fp == state_dict_fingerprint(new)


def test_apply_patch_refuses_wrong_base_and_touches_nothing():
    old, new = _state(), _step(_state(), 3)
    patch = make_patch(old, new)
    wrong = {k: v.clone() for k, v in old.items()}
    wrong["model.layers.0.norm.weight"][0] = 2.0
    before = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(IntegrityError, match="model.layers.0.norm.weight"):
        apply_patch(wrong, patch)
    assert _same(wrong, before)


def test_apply_patch_refuses_damaged_patch_and_touches_nothing():
    old, new = _state(), _step(_state(), 4)
    patch = bytearray(make_patch(old, new))
    patch[len(patch) // 2] ^= 0x10
    state = {k: v.clone() for k, v in old.items()}
    with pytest.raises((CorruptPatchError, IntegrityError)):
        apply_patch(state, bytes(patch))
    assert _same(state, old)


def test_publisher_chain_and_worker(tmp_path: Path):
    states = [_state()]
    for i in range(4):
        states.append(_step(states[-1], 10 + i))
    publisher = Publisher(level="max")
    fp0 = publisher.anchor(states[0], tmp_path / "anchor.safetensors")
    assert fp0 == fingerprint_file(tmp_path / "anchor.safetensors")
    worker = load_file(tmp_path / "anchor.safetensors")
    for i, state in enumerate(states[1:], start=1):
        if i % 2:
            patch = publisher.publish(state)
        else:
            publisher.publish(state, tmp_path / f"p{i}.pulse")
            patch = (tmp_path / f"p{i}.pulse").read_bytes()
        assert apply_patch(worker, patch) == publisher.fingerprint == state_dict_fingerprint(state)
        assert _same(worker, state)


def test_file_patch_applies_to_a_module(tmp_path: Path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new = _step_module(old)
    save_file(old, tmp_path / "a.safetensors")
    save_file(new, tmp_path / "b.safetensors")
    with open(tmp_path / "p.pulse", "wb") as f:
        diff_checkpoints(tmp_path / "a.safetensors", tmp_path / "b.safetensors", f)
    apply_patch(model.state_dict(), tmp_path / "p.pulse")
    assert _same({k: v for k, v in model.state_dict().items()}, new)


def _step_module(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in state.items()}
    for v in out.values():
        v.view(torch.int16).view(-1)[::37] += 1
    return out


def test_write_patch_to_a_file_object_matches_bytes():
    old, new = _state(), _step(_state(), 5)
    buf = io.BytesIO()
    summary = write_patch(old, new, buf, workers=1)
    assert buf.getvalue() == make_patch(old, new, workers=1)
    assert summary.changed_words == int(
        sum(
            (
                old[k]
                .contiguous()
                .view(-1)
                .view(torch.uint8)
                .numpy()
                .view(np.uint16 if old[k].element_size() == 2 else np.uint8)
                != new[k]
                .contiguous()
                .view(-1)
                .view(torch.uint8)
                .numpy()
                .view(np.uint16 if old[k].element_size() == 2 else np.uint8)
            ).sum()
            for k in ("model.embed.weight", "model.layers.0.mlp.weight")
        )
        + 1  # model.step: one I64 word
    )


def test_device_path_over_live_tensors_is_byte_identical():
    from pulsectl.torch_api import StateDictSource

    old, new = _state(), _step(_state(), 6)
    for context in (False, True):
        buf = io.BytesIO()
        options = DiffOptions(workers=2, device="cpu", context=context, level=19 if context else 3)
        diff_checkpoints(StateDictSource(old), StateDictSource(new), buf, options=options)
        assert buf.getvalue() == make_patch(old, new, level="max" if context else 3)


def test_apply_patch_moves_every_word_width() -> None:
    """Changed words come from the codec's moves, scattered as unsigned words that wrap: 1-, 2-,
    4- and 8-byte dtypes (negative moves included) end byte-exact."""
    from pulsectl.torch_api import apply_patch, make_patch

    gen = torch.Generator().manual_seed(3)
    old = {
        "u8": torch.randint(0, 256, (4096,), generator=gen, dtype=torch.uint8),
        "bf16": torch.randn(4096, generator=gen).to(torch.bfloat16),
        "f32": torch.randn(4096, generator=gen),
        "f64": torch.randn(4096, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (4096,), generator=gen, dtype=torch.int64),
    }
    new = {k: v.clone() for k, v in old.items()}
    new["u8"][::5] += 3
    new["bf16"][::9] = new["bf16"][::9] * 1.01
    new["f32"][::4] -= 1e-3
    new["f64"][::6] *= -1.0
    new["i64"][::3] -= 2**61
    state = {k: v.clone() for k, v in old.items()}
    apply_patch(state, make_patch(old, new))
    for k in new:
        assert torch.equal(state[k].view(torch.uint8), new[k].view(torch.uint8)), k


def _nudge_all(state: dict[str, torch.Tensor], step: float = 0.01) -> dict[str, torch.Tensor]:
    return {
        k: (v + step).to(v.dtype) if v.is_floating_point() else v.clone() for k, v in state.items()
    }


def test_apply_patch_patches_non_contiguous_tensors_through_their_strides():
    """A channels_last Conv2d weight or a transposed view is patched where it lies: the patch is
    about the logical row-major bytes (what safetensors saves), and every tensor ends exact with
    its layout and storage kept. This used to write the contiguous tensors, then refuse the
    non-contiguous one: a half-updated model."""
    torch.manual_seed(0)
    net = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Conv2d(3, 4, 3))  # noqa: E731
    trainer = net()
    worker = net()
    worker.load_state_dict(trainer.state_dict())
    worker = worker.to(memory_format=torch.channels_last)
    assert not worker[1].weight.is_contiguous()
    publisher = Publisher()
    publisher.anchor(trainer.state_dict())
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    patch = publisher.publish(trainer.state_dict())
    ptr = worker[1].weight.data_ptr()
    assert apply_patch(worker.state_dict(), patch) == publisher.fingerprint
    assert state_dict_fingerprint(worker.state_dict()) == publisher.fingerprint
    assert worker[1].weight.data_ptr() == ptr
    assert worker[1].weight.is_contiguous(memory_format=torch.channels_last)
    for k, v in trainer.state_dict().items():
        assert torch.equal(worker.state_dict()[k], v), k

    # Views of every kind: transposed, strided 1-D (whose fingerprint used to fail), a sliced
    # complex tensor, a permuted bf16 tensor with NaN payloads and -0.0.
    g = torch.Generator().manual_seed(1)
    old = {
        "a": torch.randn(6, 5, generator=g),
        "b": torch.randn(5, 7, generator=g).t(),
        "c": torch.randn(20, generator=g)[::3],
        "d": torch.randn(4, 6, dtype=torch.complex64, generator=g)[:, 1::2],
        "e": torch.randn(3, 4, 5, generator=g).to(torch.bfloat16).permute(2, 0, 1),
    }
    new = {k: v.contiguous() for k, v in _nudge_all(old).items()}
    new["e"].view(torch.int16)[0, 0, 0] = 0x7FC1
    new["e"][1, 1, 1] = -0.0
    assert state_dict_fingerprint(old) == state_dict_fingerprint(
        {k: v.contiguous() for k, v in old.items()}
    )
    patch = make_patch(old, new)
    state = dict(old)
    ptrs = {k: v.data_ptr() for k, v in state.items()}
    assert apply_patch(state, patch) == state_dict_fingerprint(new)
    assert _same(state, new)
    assert {k: v.data_ptr() for k, v in state.items()} == ptrs
    assert state["b"].stride() == (1, 7)


def test_apply_patch_refuses_an_expanded_tensor_before_writing():
    """A view whose elements share memory cannot take a patch changing one of them: refused
    before any tensor is written, naming it."""
    old = {"a": torch.zeros(8), "b": torch.zeros(4).expand(3, 4)}
    new = {"a": torch.ones(8), "b": torch.zeros(3, 4)}
    new["b"][1, 2] = 1.0
    patch = make_patch(old, new)
    state = dict(old)
    with pytest.raises(UsageError, match="'b'.*share memory"):
        apply_patch(state, patch)
    assert torch.equal(state["a"], torch.zeros(8)) and torch.equal(state["b"], old["b"])


def _linear_pair() -> tuple[torch.nn.Linear, torch.nn.Linear, Publisher]:
    torch.manual_seed(0)
    trainer, worker = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    worker.load_state_dict(trainer.state_dict())
    publisher = Publisher()
    publisher.anchor(trainer.state_dict())
    return trainer, worker, publisher


@pytest.mark.parametrize("change", ["dtype", "shape", "add", "remove"])
def test_apply_patch_refuses_to_replace_a_modules_tensors(change: str):
    """A patch that replaces, adds or removes an entry cannot reach the module through
    model.state_dict() (only that temporary dict would change): it used to return the target
    fingerprint while worker.bias kept its dtype and values. Refused before any write."""
    trainer, worker, publisher = _linear_pair()
    new = {k: v.clone() for k, v in trainer.state_dict().items()}
    new["weight"] += 1  # an in-place change that must not be written either
    if change == "dtype":
        new["bias"] = new["bias"].double() + 1
    elif change == "shape":
        new["bias"] = new["bias"].reshape(2, 2)
    elif change == "add":
        new["extra"] = torch.ones(3)
    else:
        del new["bias"]
    patch = publisher.publish(new)
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    with pytest.raises(UsageError, match="nn.Module.*replace=True") as err:
        apply_patch(worker.state_dict(), patch)
    assert err.value.tensor == ("extra" if change == "add" else "bias")
    assert _same(dict(worker.state_dict()), before)
    # keep_vars=True, or a dict of the module's Parameters: refused the same way.
    if change != "add":
        with pytest.raises(UsageError, match="nn.Module"):
            apply_patch(dict(worker.named_parameters()), patch)
        assert _same(dict(worker.state_dict()), before)

    # A dict of the module's Parameters and buffers, where the patch replaces a buffer (found in
    # review: the dict's buffer entry was swapped and the module kept its old one).
    if change in ("dtype", "shape"):
        worker.register_buffer("scale", torch.ones(2))
        mixed = {**dict(worker.named_parameters()), **dict(worker.named_buffers())}
        base = {k: v.detach().clone() for k, v in mixed.items()}
        resized = {**{k: v.clone() for k, v in base.items()}, "scale": torch.ones(3)}
        with pytest.raises(UsageError, match="nn.Module") as err:
            apply_patch(mixed, make_patch(base, resized))
        assert err.value.tensor == "scale" and worker.scale.shape == (2,)
        del worker.scale

    # replace=True changes the mapping, and only the mapping: the docs say so.
    mapping = worker.state_dict()
    assert apply_patch(mapping, patch, replace=True) == publisher.fingerprint
    assert state_dict_fingerprint(mapping) == publisher.fingerprint
    assert torch.equal(worker.weight, new["weight"])  # in place: the module sees it
    assert worker.bias.dtype == torch.float32 and worker.bias.shape == (4,)


def test_apply_patch_replace_false_refuses_entry_changes_of_a_plain_dict():
    old = _state()
    new = {k: v.clone() for k, v in old.items()}
    new["model.step"] = new["model.step"].to(torch.int32)
    patch = make_patch(old, new)
    state = {k: v.clone() for k, v in old.items()}
    with pytest.raises(UsageError, match="'model.step'.*replace=False"):
        apply_patch(state, patch, replace=False)
    assert _same(state, old)
    assert apply_patch(state, patch) == state_dict_fingerprint(new)  # a plain dict: replaced
    assert _same(state, new)


def test_apply_patch_refuses_an_item_patched_from_another_tensor():
    """The format lets an item name a base tensor of another name (pulsectl diff never does);
    the live API patches each tensor in place, so it used to write the changes made against
    'b' into 'a' without checking 'a', and report the target. Refused before any write."""
    from _faultkit import build_patch, json_text, parse_patch

    x = torch.arange(16, dtype=torch.float32)
    old, new = {"a": x.clone(), "b": x.clone()}, {"a": x + 1, "b": x.clone()}
    parsed = parse_patch(make_patch(old, new))
    header = json.loads(json.dumps(parsed.header))
    item = next(i for i in header["items"] if i["name"] == "a")
    item["base"]["name"] = "b"
    patch = build_patch(json_text(header), parsed.frames, parsed.trailer)
    state = {"a": torch.zeros(16), "b": x.clone()}
    with pytest.raises(UsageError, match="'a' is patched from base tensor 'b'"):
        apply_patch(state, patch)
    assert torch.equal(state["a"], torch.zeros(16)) and torch.equal(state["b"], x)


def test_apply_patch_refuses_a_write_through_tied_or_overlapping_tensors():
    """Entries sharing memory: a write into one changes the other. It used to write through the
    alias (embed.weight changed with lm_head.weight) and return a target fingerprint the live
    state did not have. Refused before any write, naming both tensors."""
    g = torch.Generator().manual_seed(2)
    t = torch.randn(5, 3, generator=g)
    base = {"bias": torch.zeros(4), "embed.weight": t.clone(), "lm_head.weight": t.clone()}
    only_head = {**base, "bias": torch.ones(4), "lm_head.weight": t + 1}
    different = {**only_head, "embed.weight": t + 2}
    for target, what in ((only_head, "changes 'lm_head.weight' only"), (different, "different")):
        live = {"bias": torch.zeros(4), "embed.weight": t, "lm_head.weight": t}
        before = {k: v.clone() for k, v in live.items()}
        with pytest.raises(UsageError, match=f"'embed.weight' and 'lm_head.weight' .*{what}"):
            apply_patch(live, make_patch(base, target))
        assert _same(live, before)

    # Partly overlapping views of one buffer: refused (by the byte ranges they span).
    x = torch.arange(10, dtype=torch.float32)
    old = {"a": x[0:6].clone(), "b": x[4:10].clone()}
    new = {"a": old["a"].clone(), "b": old["b"]}
    new["a"][0] = -1.0
    live = {"a": x[0:6], "b": x[4:10]}
    with pytest.raises(UsageError, match="'a' and 'b' span overlapping memory"):
        apply_patch(live, make_patch(old, new))
    assert torch.equal(x, torch.arange(10, dtype=torch.float32))


def test_apply_patch_writes_tied_tensors_that_change_together():
    """Tied entries (a module's tied embedding and output weight) that the patch changes in the
    same way are patched; so are disjoint views of one buffer."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(3)
    trainer, worker = Tied(), Tied()
    worker.load_state_dict(trainer.state_dict())
    publisher = Publisher()
    publisher.anchor(trainer.state_dict())
    with torch.no_grad():
        trainer.embed.weight.add_(0.5)
    patch = publisher.publish(trainer.state_dict())
    assert apply_patch(worker.state_dict(), patch) == publisher.fingerprint
    assert state_dict_fingerprint(worker.state_dict()) == publisher.fingerprint
    assert worker.head.weight is worker.embed.weight
    assert torch.equal(worker.embed.weight, trainer.embed.weight)

    x = torch.arange(10, dtype=torch.float32)
    old = {"a": x[:5].clone(), "b": x[5:].clone()}
    new = {"a": old["a"] + 1, "b": old["b"] - 1}
    live = {"a": x[:5], "b": x[5:]}
    assert apply_patch(live, make_patch(old, new)) == state_dict_fingerprint(new)
    assert _same(live, new)


def test_a_patch_between_deduplicated_files_applies_to_a_tied_module(tmp_path: Path):
    """save_model (and HF save_pretrained) write a tied output weight once: the files have
    embed.weight but no head.weight. A patch between two such files, applied to the live tied
    module's state_dict(), used to be refused as "removes tensor 'head.weight'" although the
    module is patched completely by writing embed.weight in place. The tied entry is kept, it
    follows the tensor it shares memory with; an entry that shares nothing is still refused."""
    from safetensors.torch import save_model

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight
            self.norm = torch.nn.LayerNorm(4)

    torch.manual_seed(4)
    trainer, worker = Tied(), Tied()
    worker.load_state_dict(trainer.state_dict())
    a, b, p = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "p.pulse"
    save_model(trainer, str(a))
    with torch.no_grad():
        trainer.embed.weight.add_(0.5)
        trainer.norm.bias.add_(1.0)
    save_model(trainer, str(b))
    assert "head.weight" not in load_file(b)
    with open(p, "wb") as f:
        diff_checkpoints(a, b, f)
    target = fingerprint_file(b)
    assert apply_patch(worker.state_dict(), p) == target
    assert worker.head.weight is worker.embed.weight
    assert torch.equal(worker.embed.weight, trainer.embed.weight)
    assert torch.equal(worker.norm.bias, trainer.norm.bias)
    # A plain dict loaded from the file and given the alias by hand: becomes the file.
    plain = load_file(a)
    plain["head.weight"] = plain["embed.weight"]
    assert apply_patch(plain, p) == target and "head.weight" not in plain
    # An untied module (head has memory of its own): the removal is still refused.
    untied = Tied()
    untied.head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())
    untied.load_state_dict(load_file(a), strict=False)
    with torch.no_grad():
        untied.head.weight.copy_(untied.embed.weight)
    with pytest.raises(UsageError, match="removes tensor 'head.weight'"):
        apply_patch(untied.state_dict(), p)


def test_a_non_contiguous_tensor_is_made_contiguous_once_per_diff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its blocks are read one after another: one row-major copy serves them all (a copy per
    block cost the tensor's size squared over the block size)."""
    import pulsectl.torch_api as api

    torch.manual_seed(0)
    old = {"w": torch.randn(32, 64, 64, 64).to(memory_format=torch.channels_last)}  # 32 MiB
    new = {"w": (old["w"] + 0.5).contiguous(memory_format=torch.channels_last)}
    copies: list[int] = []
    real = api._tensor_bytes

    def counted(t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            copies.append(t.numel())
        return real(t)

    monkeypatch.setattr(api, "_tensor_bytes", counted)
    patch = make_patch(old, new, workers=2)
    # 4 blocks of 8 MiB per side: a copy per block read would be 8 copies, plus the hashes.
    assert len(copies) <= 4, len(copies)
    state = {"w": old["w"].clone(memory_format=torch.channels_last)}
    apply_patch(state, patch)
    assert torch.equal(state["w"], new["w"])


def test_apply_patch_writes_in_slices(monkeypatch) -> None:
    """The changed words go to the device in slices of _SCATTER_WORDS (the index alone is four
    times a BF16 tensor whose every word changed); slice edges fall anywhere, also in a tensor
    patched through its strides."""
    import pulsectl.torch_api as api

    old = _state(3)
    old["t"] = (torch.randn(96, 40) * 0.02).to(torch.bfloat16).t()  # non-contiguous
    new = _step(old, 4, frac=0.3)
    new["t"] = old["t"].clone()
    new["t"].view(torch.int16)[::3, 1::2] += 1
    patch = make_patch(old, new)
    monkeypatch.setattr(api, "_SCATTER_WORDS", 7)
    state = {k: v.clone() if v.is_contiguous() else v.t().clone().t() for k, v in old.items()}
    apply_patch(state, patch)
    assert _same(state, new)
    assert state["t"].stride() == (1, 40)


def test_meta_tensors_are_refused_with_a_usage_error() -> None:
    """A tensor on the meta device (a model made without its weights, or offloaded ones) has no
    bytes: making or applying a patch says so instead of failing inside torch, and apply_patch
    never puts a new tensor on the meta device."""
    old, new = _state(5), _step(_state(5), 6)
    meta = {k: v.to("meta") for k, v in old.items()}
    with pytest.raises(UsageError, match="meta device"):
        make_patch(meta, new)
    with pytest.raises(UsageError, match="meta device"):
        state_dict_fingerprint(meta)
    with pytest.raises(UsageError, match="meta device"):
        Publisher().anchor(meta)
    patch = make_patch(old, new)
    with pytest.raises(UsageError, match="'model.embed.weight' is on the meta device"):
        apply_patch(dict(meta), patch)
    # An entry the patch removes may be on the meta device; it was first, yet the tensor the
    # patch adds goes on the CPU like the others, not on the meta device.
    state = {"gone": torch.zeros(2, device="meta"), **{k: v.clone() for k, v in old.items()}}
    added = dict(new, extra=torch.ones(3))
    assert apply_patch(state, make_patch(old, added)) == state_dict_fingerprint(added)
    assert "gone" not in state and state["extra"].device.type == "cpu"
    assert _same(state, added)


def test_a_block_patch_returns_what_the_state_now_is(tmp_path: Path) -> None:
    """A block patch binds only its tensors: apply_patch checks that the others are there as
    the patch's model has them, and returns the state's fingerprint as patched, which is the
    target's once every block is in (as apply_patches does for files)."""
    from pulsectl.blocks import diff_blocks

    old, new = _state(1), _step(_state(1), 2)
    save_file(old, tmp_path / "a.safetensors")
    save_file(new, tmp_path / "b.safetensors")
    written = diff_blocks(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "p.pulse", 1
    )
    assert len(written) == 2
    target = fingerprint_file(tmp_path / "b.safetensors")
    state = {k: v.clone() for k, v in old.items()}
    first = apply_patch(state, written[0][0])
    assert first == state_dict_fingerprint(state) != target
    assert apply_patch(state, written[1][0]) == target == state_dict_fingerprint(state)
    assert _same(state, new)
    # Another model's layout (a tensor missing, or of another dtype): refused, untouched.
    for bad in ({k: v for k, v in old.items() if k != "model.layers.0.bias"},
                {**old, "model.layers.0.bias": old["model.layers.0.bias"].double()}):  # fmt: skip
        before = {k: v.clone() for k, v in bad.items()}
        with pytest.raises(IntegrityError, match="wrong base"):
            apply_patch(bad, written[0][0])
        assert _same(bad, before)


def test_a_block_patch_leaves_entries_the_checkpoint_lacks(tmp_path: Path) -> None:
    """A block patch replaces its own tensors only: an entry the checkpoint lacks (a buffer
    saved apart) was deleted from a plain dict, and a module's mapping was refused with "the
    patch removes tensor ...", as for a full patch."""
    from pulsectl.blocks import diff_blocks

    old, new = _state(1), _step(_state(1), 2)
    save_file(old, tmp_path / "a.safetensors")
    save_file(new, tmp_path / "b.safetensors")
    written = diff_blocks(
        tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "p.pulse", 1
    )
    extra = torch.arange(4.0)
    plain = {**{k: v.clone() for k, v in old.items()}, "rotary.inv_freq": extra}
    module = {
        **{k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in old.items()},
        "rotary.inv_freq": extra,
    }
    for state in (plain, module):
        for path, _ in written:
            apply_patch(state, path)
        assert state["rotary.inv_freq"] is extra
        assert _same({k: v for k, v in state.items() if k != "rotary.inv_freq"}, new)


def test_trailing_empty_tensors_with_one_worker() -> None:
    """The frame heads of empty tensors at the end of the file are read too: with one worker
    (inline) or no block at all, apply_patch took a valid patch for a damaged trailer."""
    old = {"w": torch.randn(4, 4), "mask": torch.zeros(0, dtype=torch.bool)}
    new = {"w": old["w"] + 1, "mask": torch.zeros(0, dtype=torch.bool)}
    for workers in (1, 2):
        state = {k: v.clone() for k, v in old.items()}
        apply_patch(state, make_patch(old, new), workers=workers)
        assert _same(state, new)
    only = {"e": torch.zeros(0)}
    assert apply_patch(dict(only), make_patch(only, only), workers=2) == state_dict_fingerprint(
        only
    )


def test_dtypes_torch_lacks_are_refused_before_any_write(tmp_path: Path) -> None:
    """F8_E8M0 maps to torch.float8_e8m0fnu; F4 and F6 have no torch dtype: a patch that
    adds one is refused before the first write (it was half applied, then a KeyError)."""
    from pulsectl.checkpoint import save_safetensors

    w = np.arange(16, dtype=np.float32)
    save_safetensors(tmp_path / "a.safetensors", {"w": ("F32", (16,), w)})
    for dtype, ok in (("F8_E8M0", True), ("F6_E3M2", False)):
        b = tmp_path / f"{dtype}.safetensors"
        save_safetensors(
            b,
            {"w": ("F32", (16,), w + 1), "s": (dtype, (8,), np.full(8 if ok else 6, 3, np.uint8))},
        )
        patch = tmp_path / f"{dtype}.pulse"
        with open(patch, "wb") as f:
            from pulsectl.diff import diff_checkpoints as diff

            diff(tmp_path / "a.safetensors", b, f)
        state = {"w": torch.from_numpy(w.copy())}
        if ok:
            assert apply_patch(state, patch) == fingerprint_file(b)
            assert state["s"].dtype == torch.float8_e8m0fnu
        else:
            with pytest.raises(UsageError, match="torch has no dtype for"):
                apply_patch(state, patch)
            assert torch.equal(state["w"], torch.from_numpy(w)) and "s" not in state


def test_a_failed_anchor_keeps_the_previous_one(tmp_path: Path) -> None:
    s0 = _state(3)
    pub = Publisher()
    fp0 = pub.anchor(s0)
    with pytest.raises(OutputError):
        pub.anchor(_step(s0, 4), tmp_path / "no" / "such" / "anchor.safetensors")
    assert pub.fingerprint == fp0
    worker = {k: v.clone() for k, v in s0.items()}
    s2 = _step(s0, 5)
    apply_patch(worker, pub.publish(s2))
    assert _same(worker, s2)
    with pytest.raises(UsageError, match="level 99"):
        Publisher(level=99).anchor(s0)


class _WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def get_extra_state(self) -> dict[str, int]:
        return {"fp8_meta": 1}

    def set_extra_state(self, state: object) -> None:
        pass


@pytest.mark.parametrize(
    "call",
    [
        lambda w: make_patch({"w": w.to_sparse()}, {"w": w.to_sparse()}),
        lambda w: state_dict_fingerprint(_WithExtraState().state_dict()),
        lambda w: make_patch({"w": w}, {"w": w}, metadata={"step": 3}),  # type: ignore[dict-item]
        lambda w: make_patch({"w": w}, {"w": w}, level="min"),  # type: ignore[arg-type]
        lambda w: make_patch({"w": w}, {"w": w}, workers=0),
        lambda w: state_dict_fingerprint({0: w}),  # type: ignore[dict-item]
        lambda w: state_dict_fingerprint({"c": torch.tensor([1 + 2j]).conj()}),
        lambda w: apply_patch({"w": w.to_sparse()}, make_patch({"w": w}, {"w": w + 1})),
        lambda w: apply_patch(
            {"w": w.clone(), "_extra_state": {"a": 1}}, make_patch({"w": w}, {"w": w + 1})
        ),  # type: ignore[dict-item]  # noqa: E501
    ],
    ids=[
        "sparse",
        "extra-state",
        "metadata",
        "level",
        "workers",
        "key",
        "conj",
        "apply-sparse",
        "apply-extra",
    ],
)
def test_what_a_state_dict_cannot_hold_is_a_usage_error(call) -> None:
    """Docs: every failure raises a PulseError subclass (these were AttributeError,
    RuntimeError, ValueError, KeyError)."""
    with pytest.raises(UsageError):
        call(torch.randn(4, 4))


def test_a_broken_stream_is_an_output_error() -> None:
    class Broken(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b: object) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    w = torch.randn(4, 4)
    with pytest.raises(OutputError, match="cannot write the patch: Broken pipe"):
        write_patch({"w": w}, {"w": w + 1}, Broken())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a torch without CUDA")
def test_a_device_torch_does_not_have_is_refused_before_any_work(tmp_path: Path) -> None:
    """As `--device` is: a CUDA device where torch sees none, 'auto' (the command line's) or a
    name that is no torch device (found in review: each failed once work had started, with
    torch's own message, or one about freeing the device's memory)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    for device, message in (
        ("cuda", "device 'cuda': torch sees 0 CUDA devices here; use 'cpu' or None"),
        ("cuda:1", "device 'cuda:1': torch sees 0 CUDA devices here"),
        ("auto", "device 'auto' is the command line's: pass pulsectl.device.resolve('auto')"),
        ("tpu", "device 'tpu': not a torch device name ('cpu', 'cuda', 'cuda:N', ...)"),
        ("cuda:\u00b2", "not a torch device name"),  # '²'.isdigit() (found in review)
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            DiffOptions(device=device)
        with pytest.raises(UsageError, match=re.escape(message)):
            apply_patches(
                tmp_path / "base", [tmp_path / "p.pulse"], tmp_path / "out", device=device
            )
        with pytest.raises(UsageError, match=re.escape(message)):
            pair_stats(tmp_path / "a", tmp_path / "b", device=device)
    # What torch parses is taken: names of other backends, and torch.device objects.
    for device in ("cpu", torch.device("cpu"), "mps", "xpu"):
        assert DiffOptions(device=device).device == device  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool])
def test_a_one_element_view_with_a_stride(tmp_path: Path, dtype: torch.dtype) -> None:
    """scales[:, 0] of a (1, 4) tensor: one element, stride 4, which torch calls contiguous
    but would not view as bytes (found in review: a raw RuntimeError in make_patch,
    apply_patch and state_dict_fingerprint). Patched in place; the rest of scales untouched."""
    torch.manual_seed(0)
    scales = torch.randn(1, 4).to(dtype)
    view = scales[:, 0]
    assert view.stride() == (4,)
    new = {"s": (~view if dtype == torch.bool else view + 1).clone()}
    save_file({"s": view.clone()}, str(tmp_path / "old.safetensors"))
    assert state_dict_fingerprint({"s": view}) == fingerprint_file(tmp_path / "old.safetensors")
    rest = scales[:, 1:].clone()
    assert apply_patch({"s": view}, make_patch({"s": view}, new)) == state_dict_fingerprint(new)
    assert torch.equal(scales[:, 0], new["s"]) and torch.equal(scales[:, 1:], rest)


def test_a_dtensor_is_refused_with_what_to_do(tmp_path: Path) -> None:
    """An FSDP2 state dict holds DTensors (found in review: a raw RuntimeError, '.numpy() is not
    supported for tensor subclasses'). A wrapper subclass is a UsageError naming the tensor."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch without torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}"
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        state = {"w": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])}
        for call in (
            lambda: state_dict_fingerprint(state),
            lambda: make_patch(state, state),
            lambda: apply_patch(
                state, make_patch({"w": torch.zeros(8, 4)}, {"w": torch.ones(8, 4)})
            ),
        ):
            with pytest.raises(
                UsageError, match="tensor 'w' is a DTensor, a tensor subclass"
            ) as err:
                call()
            assert "full_tensor()" in str(err.value)
    finally:
        dist.destroy_process_group()


def test_a_patch_open_in_text_mode_is_a_usage_error(tmp_path: Path) -> None:
    """Found in review: a raw TypeError (or a UnicodeDecodeError) from a text-mode file."""
    from pulsectl.format import PatchReader

    path = tmp_path / "p.pulse"
    path.write_bytes(make_patch({"w": torch.zeros(4)}, {"w": torch.ones(4)}))
    for read in (
        lambda f: apply_patch({"w": torch.zeros(4)}, f),
        lambda f: PatchReader(f, str(path)),
    ):
        with (
            open(path, encoding="latin-1") as f,
            pytest.raises(UsageError, match="open it with 'rb'"),
        ):
            read(f)
