"""squash: one patch equal to a chain, smaller than the sum."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from _faultkit import parse_patch

from pulsectl.apply import apply_patches
from pulsectl.checkpoint import save_safetensors
from pulsectl.cli.app import main
from pulsectl.diff import DiffOptions, diff_to_path
from pulsectl.errors import CorruptPatchError, IntegrityError, UsageError
from pulsectl.info import read_patch_info
from pulsectl.squash import squash_patches
from pulsectl.synth import generate_chain

FAST = DiffOptions(level=3, workers=1)
MAX = DiffOptions(level=19, context=True, workers=1)


def _chain(tmp_path: Path, steps: int = 4, shards: int | None = None, **kw) -> list[Path]:
    return generate_chain(
        tmp_path / "chain", shape="tiny", steps=steps, lr=1e-5, seed=3, shards=shards, **kw
    )


def _patches(tmp_path: Path, chain: list[Path], options: DiffOptions) -> list[Path]:
    out = []
    for i, (a, b) in enumerate(zip(chain, chain[1:], strict=False)):
        p = tmp_path / f"p{i}.pulse"
        diff_to_path(a, b, p, options=options)
        out.append(p)
    return out


def _tree(path: Path) -> dict[str, bytes]:
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("shards", [None, 2])
def test_squash_equals_the_chain_and_is_smaller(tmp_path: Path, shards):
    chain = _chain(tmp_path, shards=shards)
    patches = _patches(tmp_path, chain, FAST)
    squashed = tmp_path / "all.pulse"
    summary = squash_patches(patches, squashed)
    # the links' codec 6 blocks (value plane 0 paired) are read, and squash writes them too
    assert all(6 in parse_patch(p.read_bytes()).codecs() for p in patches)
    assert 6 in parse_patch(squashed.read_bytes()).codecs()
    apply_patches(chain[0], [squashed], tmp_path / "out")
    assert _tree(tmp_path / "out") == _tree(chain[-1])
    assert summary.patch_bytes < summary.input_bytes
    info = read_patch_info(squashed, check=True)
    assert info.header.base_fingerprint == read_patch_info(patches[0]).header.base_fingerprint
    assert (
        info.trailer.target_fingerprint == read_patch_info(patches[-1]).trailer.target_fingerprint
    )
    # The squashed change counts are against the first base, exact except where a link stored
    # a block whole (then squash cannot know the base words and counts every word).
    direct = tmp_path / "direct.pulse"
    diff_to_path(chain[0], chain[-1], direct, options=FAST)
    exact = read_patch_info(direct).to_json()["tensors"]
    for got, want in zip(info.to_json()["tensors"], exact, strict=True):
        assert got["changed_words"] in (want["changed_words"], got["words"])
    assert (
        sum(
            t["changed_words"] == w["changed_words"]
            for t, w in zip(info.to_json()["tensors"], exact, strict=True)
        )
        > len(exact) // 2
    )


def test_moves_that_cancel_drop_out(tmp_path: Path):
    chain = _chain(tmp_path, steps=1)
    patches = _patches(tmp_path, [chain[0], chain[1], chain[0]], FAST)  # there and back
    squashed = tmp_path / "zero.pulse"
    squash_patches(patches, squashed)
    tensors = read_patch_info(squashed).to_json()["tensors"]
    # delta-coded tensors cancel to nothing; a tensor a link stored whole counts every word
    assert all(t["changed_words"] in (0, t["words"]) for t in tensors)
    assert sum(t["changed_words"] == 0 for t in tensors) > len(tensors) // 2
    apply_patches(chain[0], [squashed], tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == chain[0].read_bytes()


def test_max_level_chains_need_the_base(tmp_path: Path):
    chain = _chain(tmp_path, steps=3)
    patches = _patches(tmp_path, chain, MAX)
    with pytest.raises(UsageError, match="--base"):
        squash_patches(patches, tmp_path / "x.pulse")
    assert not (tmp_path / "x.pulse").exists()
    # Asked for --level max without the base: refused, not quietly written at another level.
    (tmp_path / "fast").mkdir()
    fast = _patches(tmp_path / "fast", chain, FAST)
    with pytest.raises(UsageError, match="--level max needs --base"):
        squash_patches(fast, tmp_path / "z.pulse", options=MAX)
    assert not (tmp_path / "z.pulse").exists()
    squash_patches(patches, tmp_path / "y.pulse", base=chain[0], options=MAX)
    apply_patches(chain[0], [tmp_path / "y.pulse"], tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == chain[-1].read_bytes()


def test_max_level_refusal_names_the_patch_with_context_blocks(tmp_path: Path, capsys):
    # Only the middle link is --level max: the refusal named the chain's last patch.
    chain = _chain(tmp_path, steps=3)
    patches = []
    for i, options in enumerate((FAST, MAX, FAST)):
        patches.append(tmp_path / f"link{i}.pulse")
        diff_to_path(chain[i], chain[i + 1], patches[-1], options=options)
    with pytest.raises(UsageError, match="--base") as exc:
        squash_patches(patches, tmp_path / "x.pulse")
    assert exc.value.path == str(patches[1])
    assert str(exc.value).startswith(f"{patches[1]}: has --level max blocks (tensor ")
    assert not (tmp_path / "x.pulse").exists()
    assert main(["squash", *map(str, patches), "-o", str(tmp_path / "x.pulse")]) == 2
    err = capsys.readouterr().err
    assert f"{patches[1]}: has --level max blocks" in err and str(patches[2]) not in err


def test_block_patches_are_refused_in_one_line(tmp_path: Path, capsys):
    from pulsectl.blocks import diff_blocks

    chain = _chain(tmp_path, steps=1)
    blocks = [p for p, _ in diff_blocks(chain[0], chain[1], tmp_path / "b.pulse", 2, options=FAST)]
    full = tmp_path / "full.pulse"
    diff_to_path(chain[0], chain[1], full, options=FAST)
    for given in (blocks, blocks[:1], [full, blocks[0]]):
        for base in (None, chain[0]):
            with pytest.raises(UsageError, match="squash takes full patches") as exc:
                squash_patches(given, tmp_path / "x.pulse", base=base)
            assert exc.value.path == str(blocks[0])
            assert not (tmp_path / "x.pulse").exists()
    assert main(["squash", *map(str, blocks), "-o", str(tmp_path / "x.pulse")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "block patches of one update apply together with `apply`" in err
    assert "out of order" not in err


def test_out_of_order_chain_is_refused(tmp_path: Path):
    chain = _chain(tmp_path, steps=2)
    p0, p1 = _patches(tmp_path, chain, FAST)
    with pytest.raises(IntegrityError, match="out of order") as exc:
        squash_patches([p1, p0], tmp_path / "x.pulse")
    assert "given twice" not in str(exc.value)
    with pytest.raises(IntegrityError, match=r"out of order.*\(one patch given twice\?\)"):
        squash_patches([p0, p0], tmp_path / "x.pulse")


def test_cli_squash(tmp_path: Path, capsys):
    chain = _chain(tmp_path, steps=3)
    patches = _patches(tmp_path, chain, FAST)
    out = tmp_path / "s.pulse"
    assert main(["squash", *map(str, patches), "-o", str(out)]) == 0
    assert "squashed 3 patches" in capsys.readouterr().err
    assert main(["squash", *map(str, patches), "-o", str(out)]) == 1  # exists, no -f
    assert main(["apply", str(chain[0]), str(out), "-o", str(tmp_path / "o.safetensors")]) == 0
    assert (tmp_path / "o.safetensors").read_bytes() == chain[-1].read_bytes()
    assert main(["squash", str(patches[0]), "-o", str(out), "-f"]) == 0
    assert "squashed 1 patch (" in capsys.readouterr().err


def test_a_copy_block_with_a_payload_is_refused_naming_its_patch(tmp_path: Path) -> None:
    """Found by tests/test_fuzz.py: squash skipped copy blocks without looking at them, so a
    copy block carrying a payload (which apply refuses) went into the squashed patch."""
    from _faultkit import build_patch

    chain = _chain(tmp_path, steps=2)
    patches = _patches(tmp_path, chain, DiffOptions(block_bytes=4096))
    parsed = parse_patch(patches[0].read_bytes())
    frames = [list(f) for f in parsed.frames]
    i = next(i for i, f in enumerate(frames) if f)
    frames[i][0] = (0, b"x")
    patches[0].write_bytes(build_patch(parsed.header, frames, parsed.trailer))
    out = tmp_path / "squashed.pulse"
    with pytest.raises(CorruptPatchError, match=rf"{patches[0]}: tensor .*: copy block carries"):
        squash_patches(patches, out)
    assert not out.exists()


def test_squash_never_writes_over_one_of_its_inputs(tmp_path: Path, capsys) -> None:
    """`squash P0 P1 -o P1 -f` (a typo for the output) replaced the patch P1 with the squash,
    and `--base B -o B -f` was refused only after the whole chain was applied, as "an input of
    the diff". Both are refused up front, even with -f, as `apply -o PATCH` is."""
    chain = _chain(tmp_path, steps=2)
    p0, p1 = _patches(tmp_path, chain, FAST)
    inputs = {p: p.read_bytes() for p in (p0, p1, chain[0])}
    for out, what, base in ((p1, "patch 2", []), (chain[0], "BASE", ["--base", str(chain[0])])):
        for force in ([], ["-f"]):
            argv = ["squash", str(p0), str(p1), *base, "-o", str(out), *force]
            assert main(argv) == 2, argv
            assert capsys.readouterr().err == (
                f"pulsectl: error: {out} is {what} of this squash; the squashed patch would "
                "replace it, even with -f: write the output elsewhere\n"
            )
    assert {p: p.read_bytes() for p in inputs} == inputs
    assert not list(tmp_path.glob(".*pulsectl-*"))


def test_level_max_without_the_base_ends_with_the_help_hint(tmp_path: Path, capsys) -> None:
    """Options that do not go together, found by the command: named, with the -h hint, as
    docs/GUARANTEES.md says (36618af tagged the others but not this one)."""
    chain = _chain(tmp_path, steps=2)
    patches = _patches(tmp_path, chain, FAST)
    out = tmp_path / "s.pulse"
    assert main(["squash", *map(str, patches), "-o", str(out), "--level", "max"]) == 2
    assert capsys.readouterr().err == (
        "pulsectl: error: --level max needs --base: its codec orders each block by the base "
        "words; without the base squash can only write the default codecs (give a level "
        "1..22); try 'pulsectl squash -h' for help\n"
    )
    assert not out.exists()


def test_squash_holds_one_block_of_each_patch_not_whole_frames(tmp_path: Path) -> None:
    """A 64 MiB tensor stored whole by each of 4 patches (its words random at every step):
    squash without --base read each patch's whole frame of the tensor before composing, 256 MiB
    at once here, a gigabyte per patch for a 1 GiB tensor. It now reads them block by block."""
    rng = np.random.default_rng(12)
    steps = []
    for n in range(5):
        path = tmp_path / f"s{n}.safetensors"
        words = rng.integers(0, 1 << 16, 32 * 2**20, dtype=np.uint16)
        save_safetensors(path, {"w": ("BF16", [words.size], words)})
        steps.append(path)
    patches = []
    for n in range(4):
        patches.append(tmp_path / f"p{n}.pulse")
        diff_to_path(steps[n], steps[n + 1], patches[-1], options=DiffOptions(workers=1))
    out = tmp_path / "all.pulse"
    tracemalloc.start()
    try:
        squash_patches(patches, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 128 * 2**20, f"peak allocation {peak / 2**20:.1f} MiB"
    apply_patches(steps[0], [out], tmp_path / "t.safetensors")
    assert (tmp_path / "t.safetensors").read_bytes() == steps[4].read_bytes()


def test_squash_with_base_to_a_stream_writes_whole_or_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: with --base, `-o -` got the diff's bytes as they came, so a failure
    midway left part of a patch in the pipe; README says a stream gets it once it is whole."""
    import io

    import pulsectl.diff
    from pulsectl.errors import InputError

    chain = _chain(tmp_path, steps=2)
    patches = _patches(tmp_path, chain, FAST)
    whole = io.BytesIO()
    squash_patches(patches, whole, base=chain[0])
    assert whole.getvalue().startswith(b"\x89PULSE")
    real = pulsectl.diff.diff_checkpoints

    def fails_midway(old, new, out, **kw):  # type: ignore[no-untyped-def]
        real(old, new, out, **kw)
        raise InputError("read failed (simulated)")

    monkeypatch.setattr(pulsectl.diff, "diff_checkpoints", fails_midway)
    stream = io.BytesIO()
    with pytest.raises(InputError, match="simulated"):
        squash_patches(patches, stream, base=chain[0])
    assert stream.getvalue() == b""


@pytest.mark.parametrize("to_stream", [False, True])
def test_a_base_that_changes_during_squash_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to_stream: bool
) -> None:
    """BASE is read twice (the chain applied to it, then the diff against it). Found in review:
    rewritten in between, it gave a patch (exit 0) that recorded its old fingerprint with moves
    against its new bytes, which apply refuses on either. Now an IntegrityError, no output."""
    import io

    import pulsectl.apply

    chain = _chain(tmp_path, steps=2)
    patches = _patches(tmp_path, chain, FAST)
    base = tmp_path / "base.safetensors"
    base.write_bytes(chain[0].read_bytes())
    real = pulsectl.apply.apply_patches

    def then_rewrite_base(*args, **kw):  # type: ignore[no-untyped-def]
        summary = real(*args, **kw)
        with open(base, "r+b") as f:
            f.seek(-8, 2)
            f.write(bytes(8))
        return summary

    monkeypatch.setattr(pulsectl.apply, "apply_patches", then_rewrite_base)
    out: Path | io.BytesIO = io.BytesIO() if to_stream else tmp_path / "s.pulse"
    with pytest.raises(IntegrityError, match="BASE changed while squash read it"):
        squash_patches(patches, out, base=base)
    if isinstance(out, Path):
        assert not out.exists()
    else:
        assert out.getvalue() == b""
