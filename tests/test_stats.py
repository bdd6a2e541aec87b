"""stats: exact counts against an independent computation, patch == pair, k-step table."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from pulsectl.checkpoint import save_safetensors
from pulsectl.cli.app import main
from pulsectl.diff import diff_to_path
from pulsectl.errors import UsageError
from pulsectl.stats import (
    BUCKETS,
    NO_DELTA,
    chain_stats,
    layer_index,
    pair_stats,
    patch_stats,
    tensor_kind,
)
from pulsectl.synth import ModelShape, generate_chain

SHAPE = ModelShape(2048, 128, 384, 3, 4, 2, tie_embeddings=False)
STEPS = 5


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    folder = tmp_path_factory.mktemp("chain")
    return generate_chain(folder, SHAPE, steps=STEPS, lr=5e-6, save_fp32=True)


def _words(path: Path) -> dict[str, np.ndarray]:
    """Raw 16-bit words per tensor, through the official safetensors reader and torch."""
    load_file = pytest.importorskip("safetensors.torch").load_file
    return {
        k: v.view(torch_int16()).numpy().view(np.uint16).reshape(-1)
        for k, v in load_file(path).items()
    }


def torch_int16() -> object:
    return pytest.importorskip("torch").int16


def _reference(old: Path, new: Path) -> dict[str, tuple[int, list[int]]]:
    """Changed words and delta histogram per tensor, computed independently (int64 math)."""
    a, b = _words(old), _words(new)
    out = {}
    for name in b:
        d = b[name].astype(np.int64) - a[name].astype(np.int64)
        d = (d + 2**15) % 2**16 - 2**15  # the difference as a signed 16-bit number
        m = np.abs(d[d != 0])
        hist = [
            int((m == 1).sum()),
            int((m == 2).sum()),
            int(((m >= 3) & (m <= 8)).sum()),
            int((m > 8).sum()),
            0,
        ]
        out[name] = (int(m.size), hist)
    return out


def _hist(h: dict[str, int]) -> list[int]:
    return [h[k] for k in (*BUCKETS, NO_DELTA)]


def test_pair_counts_are_exact(chain: list[Path]) -> None:
    doc = pair_stats(chain[0], chain[3]).to_json()
    ref = _reference(chain[0], chain[3])
    got = {t["name"]: (t["changed_words"], _hist(t["histogram"])) for t in doc["tensors"]}
    assert got == ref
    assert doc["total"]["changed_words"] == sum(c for c, _ in ref.values()) > 0
    total_hist = [sum(h[i] for _, h in ref.values()) for i in range(5)]
    assert _hist(doc["total"]["histogram"]) == total_hist
    assert doc["total"]["words"] == sum(v.size for v in _words(chain[3]).values())
    assert sum(t["encoded_bytes"] for t in doc["tensors"]) < doc["total"]["patch_bytes"]


def test_patch_alone_gives_the_same_figures(chain: list[Path], tmp_path: Path) -> None:
    diff_to_path(chain[1], chain[2], tmp_path / "p.pulse")
    pair = pair_stats(chain[1], chain[2]).to_json()
    patch = patch_stats(tmp_path / "p.pulse").to_json()
    assert patch["total"]["patch_bytes"] == (tmp_path / "p.pulse").stat().st_size
    assert pair["total"]["patch_bytes"] == (tmp_path / "p.pulse").stat().st_size
    for key in ("total", "by_layer", "by_kind", "tensors", "blobs"):
        assert patch[key] == pair[key], key
    assert (patch["source"], pair["source"]) == ("patch", "pair")


def test_dense_blocks_are_no_delta_in_a_patch(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, 4096, dtype=np.uint16)
    new = old.copy()
    new[::2] += 1  # half the words: the dense codecs win, so the patch has no deltas here
    small = np.arange(4096, dtype=np.uint16)
    small2 = small.copy()
    small2[7] += 3
    save_safetensors(tmp_path / "a", {"x": ("BF16", [4096], old), "y": ("BF16", [4096], small)})
    save_safetensors(tmp_path / "b", {"x": ("BF16", [4096], new), "y": ("BF16", [4096], small2)})
    diff_to_path(tmp_path / "a", tmp_path / "b", tmp_path / "p.pulse")
    pair = {t["name"]: t for t in pair_stats(tmp_path / "a", tmp_path / "b").to_json()["tensors"]}
    patch = {t["name"]: t for t in patch_stats(tmp_path / "p.pulse").to_json()["tensors"]}
    assert pair["x"]["changed_words"] == patch["x"]["changed_words"] == 2048
    assert pair["x"]["histogram"]["1"] == 2048
    assert patch["x"]["histogram"][NO_DELTA] in (0, 2048)
    assert sum(patch["x"]["histogram"].values()) == 2048
    assert pair["y"]["histogram"] == patch["y"]["histogram"] == {
        "1": 0, "2": 0, "3-8": 1, ">8": 0, NO_DELTA: 0,
    }  # fmt: skip


def test_new_tensor_counts_as_all_changed(tmp_path: Path) -> None:
    a = np.zeros(8, np.float32)
    save_safetensors(tmp_path / "a", {"w": ("F32", [8], a)})
    save_safetensors(tmp_path / "b", {"w": ("F32", [8], a), "v": ("F32", [2, 2], a[:4])})
    doc = pair_stats(tmp_path / "a", tmp_path / "b").to_json()
    v = next(t for t in doc["tensors"] if t["name"] == "v")
    assert (v["changed_words"], v["from_base"], v["histogram"][NO_DELTA]) == (4, False, 4)
    assert doc["total"]["changed_words"] == 4


def test_k_step_table_against_brute_force(chain: list[Path]) -> None:
    ks = (1, 2, 3, 8)
    doc = chain_stats(chain, ks).to_json()
    words = [_words(p) for p in chain]
    total = sum(v.size for v in words[0].values())
    for step in doc["steps"]:
        k = step["k"]
        brute = [
            sum(int(np.count_nonzero(words[i][n] != words[i + k][n])) for n in words[i])
            for i in range(len(chain) - k)
        ]
        assert step["changed_words"] == brute
        assert step["windows"] == len(brute)
        if brute:
            dens = [c / total for c in brute]
            assert step["densities"] == dens
            assert step["mean_density"] == pytest.approx(sum(dens) / len(dens))
            assert (step["min_density"], step["max_density"]) == (min(dens), max(dens))
        else:
            assert step["mean_density"] is None


def test_as_bf16_on_fp32_masters(chain: list[Path]) -> None:
    f32 = [p.with_name(p.name.replace(".safetensors", ".f32.safetensors")) for p in chain]
    cast = pair_stats(f32[0], f32[1], as_dtype="bf16").to_json()
    plain = pair_stats(chain[0], chain[1]).to_json()
    assert cast["inputs"]["as"] == "bf16"
    assert cast["total"] == plain["total"]
    assert chain_stats(f32[:3], (1, 2), as_dtype="bf16").changed == (
        chain_stats(chain[:3], (1, 2)).changed
    )
    # One spelling in the JSON, whatever the user typed (as store manifests have it).
    assert pair_stats(f32[0], f32[1], as_dtype="BF16").to_json()["inputs"]["as"] == "bf16"
    assert chain_stats(f32[:2], (1,), as_dtype="Bf16").to_json()["inputs"]["as"] == "bf16"


@pytest.mark.parametrize(
    ("name", "layer", "kind"),
    [
        ("model.embed_tokens.weight", None, "embedding"),
        ("lm_head.weight", None, "embedding"),
        ("model.layers.12.self_attn.q_proj.weight", 12, "attention"),
        ("model.layers.3.self_attn.k_proj.bias", 3, "bias"),
        ("model.layers.0.mlp.down_proj.weight", 0, "mlp"),
        ("model.layers.7.input_layernorm.weight", 7, "norm"),
        ("model.norm.weight", None, "norm"),
        ("transformer.h.4.attn.c_attn.weight", 4, "attention"),
        ("transformer.h.4.mlp.c_fc.weight", 4, "mlp"),
        ("transformer.h.4.ln_1.bias", 4, "norm"),
        ("transformer.wte.weight", None, "embedding"),
        ("blocks.2.ffn.w1.weight", 2, "mlp"),
        ("rotary.inv_freq", None, "other"),
    ],
)
def test_layer_and_kind(name: str, layer: int | None, kind: str) -> None:
    assert (layer_index(name), tensor_kind(name)) == (layer, kind)


SCHEMA_KEYS = {"schema", "source", "inputs", "total", "by_layer", "by_kind", "tensors", "blobs"}
TENSOR_KEYS = {
    "name", "file", "dtype", "shape", "layer", "kind", "words", "changed_words", "density",
    "from_base", "encoded_bytes", "histogram",
}  # fmt: skip


def test_cli_json_schema(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(chain[0]), str(chain[1])
    assert main(["stats", a, b, "--json"]) == 0
    pair = json.loads(capsys.readouterr().out)
    assert set(pair) == SCHEMA_KEYS and pair["schema"] == 1
    assert set(pair["tensors"][0]) == TENSOR_KEYS
    assert set(pair["total"]) == {
        "tensors", "words", "changed_words", "density", "target_bytes", "covered_bytes",
        "patch_bytes", "bytes_per_change", "histogram",
    }  # fmt: skip
    assert pair["total"]["covered_bytes"] == pair["total"]["target_bytes"]
    assert set(pair["total"]["histogram"]) == {*BUCKETS, NO_DELTA}
    assert set(pair["by_layer"][0]) == {
        "layer", "tensors", "words", "changed_words", "density", "encoded_bytes",
    }  # fmt: skip
    assert main(["diff", a, b, "-o", str(tmp_path / "p.pulse")]) == 0
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "p.pulse"), "--json"]) == 0
    patch = json.loads(capsys.readouterr().out)
    assert patch["total"] == pair["total"]
    assert main(["stats", *map(str, chain), "--k", "1,4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"schema", "source", "inputs", "words", "steps"}
    assert [s["k"] for s in doc["steps"]] == [1, 4]
    assert set(doc["steps"][0]) == {
        "k", "windows", "changed_words", "densities", "mean_density", "min_density",
        "max_density",
    }  # fmt: skip


def test_cli_tables(chain: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", str(chain[0]), str(chain[1]), "--top", "3"]) == 0
    text = capsys.readouterr().out
    for title in ("word deltas", "by layer", "by kind", "most changed tensors (top 3)"):
        assert title in text
    assert main(["stats", *map(str, chain[:4])]) == 0
    text = capsys.readouterr().out
    assert "k-step density" in text and "sparsity" in text


def test_cli_usage_errors(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch)]) == 0
    assert main(["stats", str(patch), "--as", "bf16"]) == 2
    assert "--as and --k need checkpoints, not a patch" in capsys.readouterr().err
    for one in (chain[0], chain[0].parent):  # a single file, a folder
        assert main(["stats", str(one)]) == 2
        assert (
            f"{one}: one checkpoint has no update to count; give OLD NEW, a PATCH, or a chain"
            in capsys.readouterr().err
        )
    assert main(["stats", str(chain[0]), str(chain[1]), "--k", "0,x"]) == 2
    assert "give positive integers" in capsys.readouterr().err


def test_plot_writes_a_png(chain: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for args, name in (([chain[0], chain[1]], "pair.png"), (chain, "chain.png")):
        out = tmp_path / name
        assert main(["stats", *map(str, args), "--plot", str(out), "--json"]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(
    chain: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["stats", str(chain[0]), str(chain[1]), "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert "pip install 'matplotlib>=3.7'" in capsys.readouterr().err
    # Found before any work: not after minutes of counting, with the figures thrown away.
    missing = tmp_path / "missing.safetensors"
    code = main(["stats", str(chain[0]), str(missing), "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "pulsectl: error: --plot needs matplotlib, which is not installed: "
        "pip install 'matplotlib>=3.7' (the plot extra)"
    )


def test_stats_patch_histogram_from_context_blocks(tmp_path):
    """--level max patches (codec 7, or 4 where pairing does not pay) give the same histogram
    as the checkpoints."""
    from pulsectl.diff import DiffOptions
    from pulsectl.stats import pair_stats, patch_stats
    from pulsectl.synth import generate_chain

    # the small shape: the tiny one's tensors are too small for the context codec to win
    chain = generate_chain(tmp_path / "c", shape="small", steps=1, lr=3e-6, seed=2)
    patch = tmp_path / "max.pulse"
    diff_to_path(chain[0], chain[1], patch, options=DiffOptions(level=19, context=True))
    from _faultkit import parse_patch

    assert 7 in parse_patch(patch.read_bytes()).codecs()  # context, value plane 0 paired
    from_patch = patch_stats(patch).to_json()
    from_pair = pair_stats(chain[0], chain[1]).to_json()
    got, want = from_patch["total"]["histogram"], from_pair["total"]["histogram"]
    # words of blocks stored whole (dense) have no delta in a patch: counted as no_delta
    assert sum(got.values()) == sum(want.values())
    assert all(got[k] <= want[k] for k in ("1", "2", "3-8", ">8"))
    assert sum(want[k] - got[k] for k in ("1", "2", "3-8", ">8")) == got["no_delta"]
    assert got["1"] > 0.8 * want["1"]  # the context blocks were read, not skipped


@pytest.mark.parametrize("codec", [3, 4, 5, 6, 7])
def test_a_delta_payload_claiming_more_changes_than_its_block_has_is_damaged(codec: int) -> None:
    # `stats PATCH` decodes moves without the base; the block's size must bound the count a
    # payload claims, or a hostile count (valid checksums: a buggy or hostile writer) sizes the
    # arrays decoding allocates (fuzz seed 15013: 16 GiB for a 76-byte payload).
    from pulsectl import codecs
    from pulsectl.codecs import context, delta, rice
    from pulsectl.codecs._bits import change_planes
    from pulsectl.errors import CorruptPatchError
    from pulsectl.stats import delta_payload_histogram

    rng = np.random.default_rng(codec)
    old = rng.integers(0x3C00, 0x3E00, 1 << 16, dtype=np.uint16)
    new = old.copy()
    at = np.sort(rng.choice(1 << 16, 20_000, replace=False))
    new[at] += rng.choice(np.array([1, 2, 3, 0xFFFF, 0xFFFE], dtype=np.uint16), at.size)
    o8, n8 = old.view(np.uint8), new.view(np.uint8)
    plain, paired = codecs.plain_codec(codec)
    if plain == codecs.CODEC_CONTEXT:
        payload, was_paired = context.encode(o8, n8, 2, at, (7, 8), 3, pair=paired)
        assert was_paired == paired
    else:
        values = change_planes(o8, n8, at, 2, 3, pair=paired)
        assert values.paired == paired
        if plain == codecs.CODEC_RICE:
            payload = rice.encode_moves(at, None, 2, 3, values=values)
        else:
            payload = delta.encode_moves(at, None, 2, 3, values=values.plain())
    assert sum(delta_payload_histogram(payload, 2, codec, 1 << 16)) == 20_000  # sound as made
    hostile = (0xFFFF_FFF0).to_bytes(4, "little") + payload[4:]  # the count comes first
    with pytest.raises(CorruptPatchError, match="claims 4294967280 changes in 65536 words"):
        delta_payload_histogram(hostile, 2, codec, 1 << 16)


def test_plot_never_replaces_an_input_and_needs_f_for_a_file(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--plot` is an output like any other: an existing file needs -f, and an input is never
    replaced (it used to be: `--plot NEW.safetensors` turned the checkpoint into a PNG)."""
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(chain[2].read_bytes())
    new = tmp_path / "new.safetensors"
    new.write_bytes(chain[1].read_bytes())
    for target, extra, want in (
        (victim, [], "plot exists; pass -f to overwrite"),
        (new, ["-f"], "is an input of this command"),
        # not "pass -f", which would then be refused too
        (new, [], f"{new}: is an input of this command; write the plot elsewhere"),
    ):
        argv = ["stats", str(chain[0]), str(new), "--plot", str(target), *extra]
        assert main(argv) in (1, 2)
        assert want in capsys.readouterr().err
    assert victim.read_bytes() == chain[2].read_bytes()
    assert new.read_bytes() == chain[1].read_bytes()


def test_a_chain_mixing_files_and_folders_is_refused(chain: list[Path], tmp_path: Path) -> None:
    """As for a pair and for diff: like with like (a file and a folder are never compared)."""
    folder = tmp_path / "f"
    folder.mkdir()
    shutil.copy(chain[1], folder / "model.safetensors")
    with pytest.raises(UsageError, match="not both files or both folders"):
        chain_stats([chain[0], folder, chain[2]], (1,))


def test_ascii_bars_round_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a stdout without block characters a bar of 0.55 cells showed no '#' (rounded to
    eighths, then to cells)."""
    import io

    from pulsectl.cli import stats as cli_stats

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))
    assert cli_stats._bar(0.55, 24.0) == "#"
    assert cli_stats._bar(24.0, 24.0) == "#" * 24
