"""inspect --check, verify and hash where a review found them lacking: a block codec from a
newer pulsectl, a block's size, a block patch's layout, a truncated checkpoint, a file name
with a newline in a folder checkpoint, paths printed as given, and an interrupted demo."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from _faultkit import build_patch, parse_patch, write_small_pair

from pulsectl.checkpoint import save_safetensors
from pulsectl.cli.app import main
from pulsectl.codecs import CODEC_STORE
from pulsectl.diff import diff_to_path
from pulsectl.synth import generate_chain


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path, Path]:
    base, new = write_small_pair(tmp_path)
    patch = tmp_path / "p.pulse"
    diff_to_path(base, new, patch)
    return base, new, patch


def _edited(patch: Path, edit: object) -> bytes:
    parsed = parse_patch(patch.read_bytes())
    frames = [list(f) for f in parsed.frames]
    i = next(i for i, f in enumerate(frames) if f)
    frames[i][0] = edit(*frames[i][0])  # type: ignore[operator]
    return build_patch(parsed.header, frames, parsed.trailer)


def test_inspect_check_reads_each_blocks_codec_and_size(
    pair: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checksums hold in both edits below. A codec this build does not know is a newer
    pulsectl's (exit 1, as an unknown version: upgrade), for inspect --check and apply alike;
    a stored block of the wrong size is damage (exit 3). Both passed inspect --check."""
    base, _, patch = pair
    newer = tmp_path / "newer.pulse"
    newer.write_bytes(_edited(patch, lambda codec, payload: (9, payload)))
    short = tmp_path / "short.pulse"
    short.write_bytes(_edited(patch, lambda codec, payload: (CODEC_STORE, b"\x00" * 3)))
    assert main(["inspect", str(newer)]) == 0  # header and trailer only: fine
    capsys.readouterr()
    for args in (["inspect", "--check", str(newer)], ["apply", str(base), str(newer), "-o", "x"]):
        assert main(args) == 1
        err = capsys.readouterr().err
        assert "unknown block codec 9: made by a newer pulsectl?" in err, err
    assert main(["inspect", "--check", str(short)]) == 3
    assert "stored block has 3 bytes, expected" in capsys.readouterr().err
    assert main(["inspect", "--check", str(patch)]) == 0


def test_verify_refuses_a_block_patch_target_of_another_layout_and_a_truncated_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A block patch's tensors with the same bytes but another dtype or shape are not its
    target (apply refuses that base); a truncated checkpoint is not the expected one either:
    exit 3, not 1, as verify's help says."""
    chain = generate_chain(tmp_path / "c", "tiny", steps=1, lr=1e-3, seed=2)
    block = tmp_path / "b.pulse"
    args = ["diff", str(chain[0]), str(chain[1]), "--tensors", "model.layers.0.*", "-o", str(block)]
    assert main(args) == 0
    assert main(["verify", str(chain[1]), "--patch", str(block)]) == 0
    from pulsectl.checkpoint import Checkpoint

    ckpt = Checkpoint.open(chain[1])
    data = chain[1].read_bytes()
    tensors = {}
    for _, t in ckpt.tensors():
        raw = np.frombuffer(data[t.start : t.start + t.nbytes], np.uint8)
        dtype = "F16" if t.name == "model.layers.0.mlp.up_proj.weight" else t.dtype
        tensors[t.name] = (dtype, list(t.shape), raw)
    retyped = tmp_path / "retyped.safetensors"
    save_safetensors(retyped, tensors)
    capsys.readouterr()
    assert main(["verify", str(retyped), "--patch", str(block)]) == 3
    assert "its files or tensor layout differ from the block patch's" in capsys.readouterr().err
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    for how in (["--patch", str(block)], ["--hash", "0" * 32]):
        assert main(["verify", str(truncated), *how]) == 3
        assert "it is not a readable checkpoint" in capsys.readouterr().err


def test_a_newline_in_a_folder_checkpoints_file_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The folder fingerprint is a text of one line per file: a name holding a newline and
    the rest of another folder's lines gave two different folders the same fingerprint."""
    chain = generate_chain(tmp_path / "c", "tiny", steps=1, lr=1e-3, seed=2, shards=2)
    odd = tmp_path / "odd"
    shutil.copytree(chain[0], odd)
    (odd / "config.json\nx 1 y").write_text("{}")
    assert main(["hash", str(odd)]) == 1
    err = capsys.readouterr().err
    assert "file name holds a control character (a newline?)" in err
    from pulsectl._paths import paths_problem

    assert paths_problem(["a\nb.safetensors"], "dir") == "unsafe file path 'a\\nb.safetensors'"
    assert paths_problem(["a b.safetensors"], "dir") is None


def test_a_backslash_in_a_folder_checkpoints_file_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """FORMAT.md forbids `\\` in a patch's paths and every reader refuses one: diff used to
    write such a patch (exit 0) that apply then refused as damaged (exit 3)."""
    chain = generate_chain(tmp_path / "c", "tiny", steps=1, lr=1e-3, seed=2, shards=2)
    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(chain[0], old)
    shutil.copytree(chain[1], new)
    for folder in (old, new):
        (folder / "notes\\v1.txt").write_text("x")
    for argv in (["hash", str(new)], ["diff", str(old), str(new), "-o", str(tmp_path / "p")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "notes\\v1.txt: file name holds a backslash" in err, err
    assert not (tmp_path / "p").exists()
    (new / "notes\\v1.txt").unlink()
    (old / "notes\\v1.txt").unlink()
    assert main(["-q", "diff", str(old), str(new), "-o", str(tmp_path / "p")]) == 0


def test_hash_prints_each_path_as_given(
    pair: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """As sha256sum does: scripts match the lines to the arguments they passed."""
    base, _, _ = pair
    monkeypatch.chdir(base.parent)
    given = [f"./{base.name}", f".//{base.name}"]
    assert main(["hash", *given]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ", 1)[1] for line in lines] == given


@pytest.mark.parametrize("made", [True, False], ids=["new-folder", "empty-folder"])
def test_a_failed_or_interrupted_demo_takes_away_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], made: bool
) -> None:
    """A demo that failed (a full disk) left its partial chain in --keep DIR, and the same
    command then refused DIR as not empty. What the demo wrote goes, and the folder too where
    the demo made it; an interrupt then says nothing was written."""
    import pulsectl.demo as demo

    real = demo.generate_chain
    keep = tmp_path / "kd"
    if not made:
        keep.mkdir()

    def failing(root: Path, **kw: object) -> list[Path]:
        real(root, **kw)  # type: ignore[arg-type]
        raise OSError(28, "No space left on device")

    def interrupted(root: Path, **kw: object) -> list[Path]:
        real(root, **kw)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "generate_chain", failing)
    assert main(["demo", "--keep", str(keep), "--shape", "tiny", "--steps", "1"]) == 1
    assert keep.exists() is not made and (made or not any(keep.iterdir()))
    capsys.readouterr()
    monkeypatch.setattr(demo, "generate_chain", interrupted)
    assert main(["demo", "--keep", str(keep), "--shape", "tiny", "--steps", "1"]) == 130
    assert capsys.readouterr().err == (
        "pulsectl: error: interrupted; no file was written, and standard output may be incomplete\n"
    )
    assert keep.exists() is not made and (made or not any(keep.iterdir()))

    # A file another program wrote there meanwhile is not the demo's: it stays.
    def foreign_then_interrupted(root: Path, **kw: object) -> list[Path]:
        (root.parent / "notes.txt").write_text("mine")
        return interrupted(root, **kw)

    monkeypatch.setattr(demo, "generate_chain", foreign_then_interrupted)
    assert main(["demo", "--keep", str(keep), "--shape", "tiny", "--steps", "1"]) == 130
    assert sorted(p.name for p in keep.iterdir()) == ["notes.txt"]
    (keep / "notes.txt").unlink()
    capsys.readouterr()
    monkeypatch.setattr(demo, "generate_chain", real)
    assert main(["-q", "demo", "--keep", str(keep), "--shape", "tiny", "--steps", "1"]) == 0


def test_an_interrupted_demo_that_cannot_clean_up_names_the_folder_it_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pulsectl.demo as demo

    real = demo.generate_chain

    def interrupted(root: Path, **kw: object) -> list[Path]:
        real(root, **kw)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "generate_chain", interrupted)
    monkeypatch.setattr(demo, "_clear", lambda folder, remove: False)
    keep = tmp_path / "kd"
    assert main(["demo", "--keep", str(keep), "--shape", "tiny", "--steps", "1"]) == 130
    err = capsys.readouterr().err
    assert err.endswith(
        f"pulsectl: error: interrupted while the demo was writing into {keep} (remove what it "
        "holds to reuse it)\n"
    )
    assert any(keep.iterdir())


def test_squash_base_that_is_a_patch_says_squash(
    pair: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It gave apply's hint (`pulsectl apply BASE PATCH...`)."""
    _, _, patch = pair
    out = tmp_path / "s.pulse"
    assert main(["squash", str(patch), "--base", str(patch), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--base {patch}: is a .pulse patch; give the checkpoint the first patch" in err
    assert not out.exists()
