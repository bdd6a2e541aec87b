"""Bad input and faults: one clear line, the documented exit code, nothing half-written.

Hostile length fields and size claims, disk full (a 2 MiB tmpfs), read-only folders (a
read-only tmpfs: tests run as root, where chmod does not stop writes), interrupts, broken
pipes, truncated streams, and one regression test per bug the fault suites found.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _faultkit import (
    build_patch,
    make_patch,
    parse_patch,
    read_only,
    temps_in,
    tmpfs,
    write_small_folders,
    write_small_pair,
)
from conftest import tree_bytes

from pulsectl import _atomic, _placed
from pulsectl.apply import apply_patches
from pulsectl.checkpoint import Checkpoint, parse_header, save_safetensors
from pulsectl.cli.app import main
from pulsectl.codecs import CODEC_CONTEXT, decode_block
from pulsectl.diff import diff_to_path
from pulsectl.errors import (
    CorruptPatchError,
    FormatError,
    InputError,
    OutputError,
    PulseError,
)
from pulsectl.format import FORMAT_VERSION, MAGIC, PREAMBLE, PatchWriter
from pulsectl.inventory import file_refs, fingerprint_of

Capsys = pytest.CaptureFixture[str]


@pytest.fixture
def small(tmp_path: Path) -> dict[str, Path]:
    base, new = write_small_pair(tmp_path)
    patch = tmp_path / "p.pulse"
    patch.write_bytes(make_patch(base, new))
    out = tmp_path / "out"
    out.mkdir()
    return {"base": base, "new": new, "patch": patch, "out": out}


def one_line(cap: Capsys) -> str:
    err = cap.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pulsectl: error: "), err
    return lines[0]


@contextlib.contextmanager
def peak_memory(limit_mib: float) -> Iterator[None]:
    """Fail if Python and numpy allocate more than ``limit_mib`` at once inside the block."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit_mib * 2**20, f"peak allocation {peak / 2**20:.1f} MiB"


def raises_cleanly(
    error: type[PulseError], fn: Callable[[], Any], match: str | None = None
) -> PulseError:
    with pytest.raises(error, match=match) as info:
        fn()
    assert "\n" not in str(info.value)
    return info.value


# --- size claims: rejected, never attempted ---------------------------------------------------


def crafted_patch(base: Path, target_header: dict[str, Any], items: list[dict[str, Any]]) -> bytes:
    """A patch for ``base`` (right fingerprints) whose target is a hand-made safetensors header."""
    ckpt = Checkpoint.open(base)
    refs = file_refs(ckpt)
    text = json.dumps(target_header, separators=(",", ":"))
    text += " " * (-len(text) % 8)
    header = {
        "layout": "file",
        "block_bytes": 8 * 2**20,
        "writer": "hand-made",
        "base": {"fingerprint": fingerprint_of(ckpt, refs), "files": [r.to_json() for r in refs]},
        "files": [{"path": "", "kind": "safetensors", "header": text}],
        "items": items,
    }
    buf = io.BytesIO()
    PatchWriter(buf, header).finish({"target": {}, "items": []})
    return buf.getvalue()


def huge_patch(base: Path) -> bytes:
    """A target of one BF16 tensor of 10^12 elements (2 TB), with no data at all."""
    return crafted_patch(
        base,
        {"huge": {"dtype": "BF16", "shape": [10**6, 10**6], "data_offsets": [0, 2 * 10**12]}},
        [
            {
                "file": 0,
                "name": "huge",
                "nbytes": 2 * 10**12,
                "word": 2,
                "base": None,
                "base_fingerprint": None,
            }
        ],
    )


def test_a_patch_claiming_1e12_elements_is_refused_up_front(
    small: dict[str, Path], capsys: Capsys
) -> None:
    patch = small["out"].parent / "huge.pulse"
    patch.write_bytes(huge_patch(small["base"]))
    with peak_memory(64):
        err = raises_cleanly(
            OutputError,
            lambda: apply_patches(small["base"], [patch], small["out"] / "c", workers=1),
            match="needs 2,000,000,000,",
        )
    assert "free some space or write the output elsewhere" in str(err)
    assert list(small["out"].iterdir()) == []
    assert main(["apply", str(small["base"]), str(patch), "-o", str(small["out"] / "c")]) == 1
    assert "target needs" in one_line(capsys)


def test_a_huge_claim_later_in_a_chain_is_refused_before_it_is_written(
    small: dict[str, Path],
) -> None:
    """Regression: only the first patch's target was checked against the free space."""
    second = small["out"].parent / "huge.pulse"
    second.write_bytes(huge_patch(small["new"]))  # its base is the first patch's target
    err = raises_cleanly(
        OutputError,
        lambda: apply_patches(
            small["base"], [small["patch"], second], small["out"] / "c", workers=1
        ),
    )
    assert "target needs" in str(err)
    assert list(small["out"].iterdir()) == []


def test_a_claim_that_fits_but_has_no_data_ends_early(small: dict[str, Path]) -> None:
    patch = crafted_patch(
        small["base"],
        {"t": {"dtype": "U8", "shape": [10**6], "data_offsets": [0, 10**6]}},
        [
            {
                "file": 0,
                "name": "t",
                "nbytes": 10**6,
                "word": 1,
                "base": None,
                "base_fingerprint": None,
            }
        ],
    )
    out = small["out"] / "c"
    raises_cleanly(
        CorruptPatchError, lambda: apply_patches(small["base"], [io.BytesIO(patch)], out, workers=1)
    )
    assert list(small["out"].iterdir()) == []


# --- hostile length fields --------------------------------------------------------------------


def _with(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_hostile_patch_lengths(small: dict[str, Path]) -> None:
    data = small["patch"].read_bytes()
    parsed = parse_patch(data)
    first_block = parsed.boundaries[3]  # preamble, header, frame head, then the first block
    cases = {
        "header length": (_with(data, 12, "<I", 0xFFFFFFFF), "header length"),
        "block length": (_with(data, first_block + 4, "<I", 0xFFFFFFFF), "block head"),
    }
    trailer_at = struct.unpack_from("<Q", data, len(data) - 24)[0]
    cases["trailer length"] = (_with(data, trailer_at + 4, "<I", 0xFFFFFFFF), "trailer")
    cases["header length, short stream"] = (
        PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, 64 * 2**20, 0),
        "ends early",
    )
    for name, (bad, match) in cases.items():
        with peak_memory(80):
            err = raises_cleanly(
                CorruptPatchError,
                partial(apply_patches, small["base"], [io.BytesIO(bad)], small["out"] / "c"),
                match=match,
            )
        assert err.path == "<stream>", name
        assert list(small["out"].iterdir()) == [], name


@pytest.mark.parametrize("length", [0, 2**64 - 1, 100 * 2**20 + 1, 2**63])
def test_hostile_safetensors_length_prefix(tmp_path: Path, length: int) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", length) + b"{}      ")
    with peak_memory(16):
        err = raises_cleanly(FormatError, lambda: Checkpoint.open(path))
    assert err.path == str(path)


def test_safetensors_shape_with_too_many_elements(tmp_path: Path) -> None:
    """A shape whose product overflows u64 is refused before any arithmetic on it grows."""
    header = {"t": {"dtype": "U8", "shape": [2**40] * 4000, "data_offsets": [0, 1]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raises_cleanly(FormatError, lambda: parse_header(raw, 8 + len(raw) + 1, "x"), match="elements")


# --- regressions: inputs that raised something other than a PulseError ---------------------


def test_json_number_with_5000_digits(tmp_path: Path, small: dict[str, Path]) -> None:
    """int() of a long digit string raises ValueError; the readers only caught JSONDecodeError."""
    raw = b'{"t":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}'
    raises_cleanly(FormatError, lambda: parse_header(raw, 8 + len(raw) + 1, "x"), match="JSON")
    parsed = parse_patch(small["patch"].read_bytes())
    text = json.dumps(parsed.header).replace('"block_bytes": 4096', '"block_bytes": ' + "9" * 5000)
    bad = build_patch(text.encode(), parsed.frames, parsed.trailer)
    raises_cleanly(
        CorruptPatchError,
        lambda: apply_patches(small["base"], [io.BytesIO(bad)], small["out"] / "c"),
        match="not valid JSON",
    )


def test_deeply_nested_json_in_the_patch(small: dict[str, Path]) -> None:
    parsed = parse_patch(small["patch"].read_bytes())
    deep = b"[" * 100_000 + b"]" * 100_000
    bad = build_patch(deep, parsed.frames, parsed.trailer)
    raises_cleanly(
        CorruptPatchError,
        lambda: apply_patches(small["base"], [io.BytesIO(bad)], small["out"] / "c"),
    )
    header = json.loads(json.dumps(parsed.header))
    header["files"][0]["header"] = deep.decode()
    bad = build_patch(header, parsed.frames, parsed.trailer)
    raises_cleanly(
        CorruptPatchError,
        lambda: apply_patches(small["base"], [io.BytesIO(bad)], small["out"] / "c"),
    )


def test_stored_header_with_an_infinite_offset(small: dict[str, Path]) -> None:
    """json.loads reads 1e999 as inf; int(inf) raised OverflowError."""
    parsed = parse_patch(small["patch"].read_bytes())
    header = json.loads(json.dumps(parsed.header))
    header["files"][0]["header"] = '{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1e999]}}'
    bad = build_patch(header, parsed.frames, parsed.trailer)
    raises_cleanly(
        CorruptPatchError,
        lambda: apply_patches(small["base"], [io.BytesIO(bad)], small["out"] / "c"),
    )


def test_blob_item_with_a_wide_word(tmp_path: Path) -> None:
    """A blob's word must be 1: word 2 on a 27-byte blob crashed the delta decoder (numpy)."""
    base, new = write_small_folders(tmp_path)
    parsed = parse_patch(make_patch(base, new))
    header = json.loads(json.dumps(parsed.header))
    assert header["items"][0]["name"] is None and header["items"][0]["nbytes"] % 2
    header["items"][0]["word"] = 2
    frames = [list(f) for f in parsed.frames]
    frames[0] = [(3, struct.pack("<IBBH3I", 1, 1, 2, 0, 0, 0, 0))]
    bad = build_patch(header, frames, parsed.trailer)
    out = tmp_path / "out"
    raises_cleanly(
        CorruptPatchError, lambda: apply_patches(base, [io.BytesIO(bad)], out), match="blob item"
    )
    assert not out.exists() and not temps_in(tmp_path)


def test_a_path_that_is_both_file_and_folder(tmp_path: Path) -> None:
    """Target files "a" and "a/b.safetensors": mkdir on a file raised FileExistsError."""
    base, new = write_small_folders(tmp_path)
    parsed = parse_patch(make_patch(base, new))
    header = json.loads(json.dumps(parsed.header))
    header["files"][0]["path"] = "a"
    header["files"][1]["path"] = "a/b.safetensors"
    bad = build_patch(header, parsed.frames, parsed.trailer)
    out = tmp_path / "out"
    raises_cleanly(
        CorruptPatchError,
        lambda: apply_patches(base, [io.BytesIO(bad)], out),
        match="both a file and a folder",
    )
    assert not out.exists() and not temps_in(tmp_path)


def context_payload(count: int, unary: bytes, remainder: bytes) -> bytes:
    """A codec-4 payload for a 2048-word BF16 block, one context (key 0), rice k 0."""
    import zstandard

    table = zstandard.ZstdCompressor().compress(struct.pack("<HBI", 0, 0, count))
    return b"".join(
        [
            struct.pack("<IBBBBHH", count, 2, 7, 8, 0, 1, 0),
            struct.pack("<I", len(table)),
            table,
            struct.pack("<I", len(unary)),
            unary,
            struct.pack("<I", len(remainder)),
            remainder,
            struct.pack("<2I", 0, 0),
        ]
    )


def test_context_codec_streams_do_not_blow_up_memory() -> None:
    """A 4 MiB unary or remainder stream was unpacked to 8 bits a byte before it was checked."""
    old = np.zeros(4096, dtype=np.uint8)
    for payload in (
        context_payload(1, b"\xff" * (4 << 20), b""),
        context_payload(1, b"\x00", b"\x00" * (4 << 20)),
    ):
        with peak_memory(24):
            raises_cleanly(
                CorruptPatchError, partial(decode_block, CODEC_CONTEXT, payload, old, 4096, 2)
            )


def test_interrupt_prints_one_line_and_exits_130(
    small: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    """typer turns KeyboardInterrupt into a silent exit 130; the boundary must still say so."""

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("pulsectl.apply.apply_patches", interrupted)
    argv = ["apply", str(small["base"]), str(small["patch"]), "-o", str(small["out"] / "c")]
    assert main(argv) == 130
    assert one_line(capsys) == "pulsectl: error: interrupted; no output was written"


@pytest.fixture
def sigint_after_rename(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """While the CLI runs, a SIGINT that arrives right after an output is renamed into place
    (some of the kills in tests/test_kill.py land there): raised as the rename is recorded,
    held until the rename's step is done, then acted on as Python does (KeyboardInterrupt).
    Returns the paths renamed."""
    renamed: list[Path] = []
    record = _placed.record

    def record_then_interrupt(path: Path) -> None:
        record(path)
        if _placed._paths is not None:
            renamed.append(path)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(_placed, "record", record_then_interrupt)
    return renamed


def test_an_interrupt_after_the_output_is_in_place_says_so(
    tmp_path: Path, sigint_after_rename: list[Path], capsys: Capsys
) -> None:
    """It used to say "interrupted; no output was written" with the complete output at OUT."""
    base, new = write_small_pair(tmp_path)
    fbase, fnew = write_small_folders(tmp_path)
    patch, fpatch = tmp_path / "p.pulse", tmp_path / "f.pulse"
    patch.write_bytes(make_patch(base, new))
    fpatch.write_bytes(make_patch(fbase, fnew))
    out = tmp_path / "out"
    for argv, want in (
        (["diff", str(base), str(new)], None),
        (["apply", str(base), str(patch)], {"": new.read_bytes()}),
        (["apply", str(fbase), str(fpatch)], tree_bytes(fnew)),
        (["cast", str(fbase), "--to", "bf16"], None),
        (["squash", str(patch)], None),
    ):
        for force in ([], ["-f"]):  # a new output, then one that replaces it
            sigint_after_rename.clear()
            assert main(["-q", *argv, "-o", str(out), *force]) == 130, argv
            assert one_line(capsys) == f"pulsectl: error: interrupted after {out} was written"
            assert sigint_after_rename == [out], argv
            assert want is None or tree_bytes(out) == want, argv
            assert temps_in(tmp_path) == [], argv
        _atomic.remove(out)


def test_an_interrupt_between_two_outputs_puts_both_in_place(
    tmp_path: Path, sigint_after_rename: list[Path], capsys: Capsys
) -> None:
    """loco encode's patch and residual: a signal right after the first rename used to leave
    the new patch beside the old residual (error feedback lost); both go in place now, and the
    line names both."""
    g = np.linspace(-1, 1, 64, dtype=np.float32)
    gp, lp = tmp_path / "g.safetensors", tmp_path / "l.safetensors"
    save_safetensors(gp, {"w": ("F32", [64], g)})
    save_safetensors(lp, {"w": ("F32", [64], g + np.float32(0.01))})
    pg, r = tmp_path / "pg.pulse", tmp_path / "r.safetensors"
    argv = ["loco", "encode", "-g", str(gp), "-l", str(lp), "-r", str(r), "-o", str(pg)]
    assert main(argv) == 130
    assert one_line(capsys) == f"pulsectl: error: interrupted after {pg}, {r} were written"
    assert sigint_after_rename == [pg, r]
    assert pg.exists() and r.exists()


def test_an_interrupt_names_what_went_to_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A patch streamed to stdout (`diff A B > p.pulse`) is written as it goes: "no output
    was written" was untrue once its first bytes had gone."""
    from pulsectl.cli import _output

    base, new = write_small_pair(tmp_path)
    whole = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(base), str(new), "-o", str(whole)]) == 0
    finish = _output._GuardedBuffer.finish

    def finish_then_interrupt(self: Any) -> None:
        finish(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(_output._GuardedBuffer, "finish", finish_then_interrupt)
    assert main(["-q", "diff", str(base), str(new)]) == 130
    cap = capsysbinary.readouterr()
    assert cap.out == whole.read_bytes()
    line = b"pulsectl: error: interrupted after the patch was written to standard output\n"
    assert cap.err == line

    def half_then_interrupt(old: Any, new: Any, out: Any, **kw: Any) -> None:
        out.write(b"PULSE")
        raise KeyboardInterrupt

    monkeypatch.setattr("pulsectl.diff.diff_checkpoints", half_then_interrupt)
    assert main(["-q", "diff", str(base), str(new)]) == 130
    cap = capsysbinary.readouterr()
    assert cap.out == b"PULSE"
    assert cap.err == b"pulsectl: error: interrupted; the patch on standard output is incomplete\n"


def test_an_interrupt_after_text_went_to_stdout_says_it_may_be_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    """`hash A B C` interrupted after A's line used to say "no output was written", with a line
    on stdout and the others missing."""
    import pulsectl.inventory

    base, new = write_small_pair(tmp_path)
    fingerprint_of = pulsectl.inventory.fingerprint_of
    calls: list[int] = []

    def second_is_interrupted(*args: Any, **kwargs: Any) -> str:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return fingerprint_of(*args, **kwargs)

    monkeypatch.setattr(pulsectl.inventory, "fingerprint_of", second_is_interrupted)
    assert main(["hash", str(base), str(new), str(base)]) == 130
    cap = capsys.readouterr()
    assert cap.out.count("\n") == 1 and cap.out.endswith(f"  {base}\n")
    assert cap.err == (
        "pulsectl: error: interrupted; no file was written, and standard output may be incomplete\n"
    )
    calls.clear()
    calls.append(1)  # the first call is now the interrupted one: nothing printed
    assert main(["hash", str(base)]) == 130
    assert capsys.readouterr().err == "pulsectl: error: interrupted; no output was written\n"


def test_folder_install_swaps_in_one_step(tmp_path: Path) -> None:
    old, new = tmp_path / "ckpt", tmp_path / ".ckpt.pulsectl-tmp-x"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    _atomic.install(new, old)
    assert (old / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_folder_install_fallback_puts_the_old_folder_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an atomic swap, an interrupt between the two renames must not lose BASE."""
    old, new = tmp_path / "ckpt", tmp_path / ".ckpt.pulsectl-tmp-x"
    for folder, text in ((old, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    real_replace = os.replace
    calls = []

    def replace(src: Any, dst: Any) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(_atomic.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _atomic.install(new, old)
    monkeypatch.setattr(_atomic.os, "replace", real_replace)
    assert (old / "f").read_text() == "old"


# --- the disk: full, read-only ------------------------------------------------------------------


@pytest.fixture
def noisy(tmp_path: Path) -> dict[str, Path]:
    """A pair whose target and patch (3 MiB of noise, new tensor) exceed a 2 MiB disk."""
    rng = np.random.default_rng(5)
    base, new = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_safetensors(base, {"w": ("U8", [16], np.zeros(16, dtype=np.uint8))})
    noise = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    save_safetensors(
        new, {"w": ("U8", [16], np.ones(16, dtype=np.uint8)), "noise": ("U8", [3 << 20], noise)}
    )
    patch = tmp_path / "p.pulse"
    diff_to_path(base, new, patch)
    return {"base": base, "new": new, "patch": patch}


def test_disk_full(
    noisy: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    with tmpfs(tmp_path / "full", "2m") as disk:
        # diff: no size is known up front; the write fails, the temp goes.
        assert main(["diff", str(noisy["base"]), str(noisy["new"]), "-o", str(disk / "p")]) == 1
        assert "no space left on device" in one_line(capsys)
        assert list(disk.iterdir()) == []
        # apply: refused before writing (free space < target).
        assert main(["apply", str(noisy["base"]), str(noisy["patch"]), "-o", str(disk / "c")]) == 1
        assert "target needs" in one_line(capsys)
        assert list(disk.iterdir()) == []
        # apply when the space goes while writing: the same clean error, the temp removed.
        monkeypatch.setattr("pulsectl.apply._check_space", lambda out, need: None)
        assert main(["apply", str(noisy["base"]), str(noisy["patch"]), "-o", str(disk / "c")]) == 1
        assert "no space left on device" in one_line(capsys)
        assert list(disk.iterdir()) == []


def test_disk_full_in_place_leaves_base(
    noisy: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    with tmpfs(tmp_path / "full", "5m") as disk:
        base = disk / "ckpt.safetensors"
        shutil.copyfile(noisy["new"], base)  # 3 MiB: the 3 MiB result cannot fit beside it
        patch = tmp_path / "back.pulse"
        diff_to_path(noisy["new"], noisy["new"], patch)
        before = base.read_bytes()
        monkeypatch.setattr("pulsectl.apply._check_space", lambda out, need: None)
        assert main(["apply", str(base), str(patch), "--in-place"]) == 1
        assert "no space left on device" in one_line(capsys)
        assert base.read_bytes() == before
        assert sorted(p.name for p in disk.iterdir()) == ["ckpt.safetensors"]


def test_read_only_folder(small: dict[str, Path], tmp_path: Path, capsys: Capsys) -> None:
    with tmpfs(tmp_path / "ro", "4m") as disk:
        base = disk / "base.safetensors"
        shutil.copyfile(small["base"], base)
        read_only(disk)
        before = base.read_bytes()
        argvs = [
            ["apply", str(small["base"]), str(small["patch"]), "-o", str(disk / "c")],
            ["apply", str(base), str(small["patch"]), "--in-place"],
            ["diff", str(small["base"]), str(small["new"]), "-o", str(disk / "p")],
            # its work folder beside the output could not be made: "internal error" before
            ["squash", str(small["patch"]), "--base", str(small["base"]), "-o", str(disk / "s")],
            ["cast", str(small["base"]), "--to", "f16", "-o", str(disk / "f16")],
        ]
        for argv in argvs:
            assert main(argv) == 1, argv
            line = one_line(capsys)
            assert "Read-only file system" in line and "write the output elsewhere" in line, line
        assert base.read_bytes() == before
        assert [p.name for p in disk.iterdir()] == ["base.safetensors"]


# --- inputs that are not what they claim; exit codes; tracebacks on request ---------------


def test_bad_inputs_exit_1_damage_exits_3(
    small: dict[str, Path], tmp_path: Path, capsys: Capsys
) -> None:
    out = str(small["out"] / "c")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    damaged = tmp_path / "damaged.pulse"
    data = bytearray(small["patch"].read_bytes())
    data[len(data) // 2] ^= 4
    damaged.write_bytes(bytes(data))
    cases = [
        (["apply", str(garbage), str(small["patch"]), "-o", out], 1, str(garbage)),
        (
            ["apply", str(small["base"]), str(tmp_path / "missing.pulse"), "-o", out],
            1,
            "missing.pulse",
        ),
        (["apply", str(small["base"]), str(small["base"]), "-o", out], 1, "not a .pulse patch"),
        (["apply", str(small["base"]), str(damaged), "-o", out], 3, str(damaged)),
        (["apply", str(small["base"]), str(small["patch"])], 2, "-o"),
        (["diff", str(garbage), str(small["new"]), "-o", out], 1, str(garbage)),
    ]
    for argv, code, named in cases:
        assert main(argv) == code, argv
        line = one_line(capsys)
        assert named in line, (argv, line)
        assert list(small["out"].iterdir()) == []


def test_traceback_only_on_request(
    small: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    damaged = tmp_path / "d.pulse"
    damaged.write_bytes(small["patch"].read_bytes()[:-1])
    argv = ["apply", str(small["base"]), str(damaged), "-o", str(small["out"] / "c")]
    monkeypatch.delenv("PULSECTL_DEBUG", raising=False)
    assert main(argv) == 3
    one_line(capsys)
    monkeypatch.setenv("PULSECTL_DEBUG", "1")
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("pulsectl: error: ")


# --- pipes: a reader that goes away, a stream that ends early -------------------------------


def cli(
    args: list[str], stdin: bytes | None = None, cwd: Path | None = None, shell: bool = False
) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PULSECTL_DEBUG"}
    cmd = args if not shell else ["bash", "-c", args[0]]
    return subprocess.run(cmd, input=stdin, capture_output=True, cwd=cwd, env=env, timeout=60)


def test_broken_pipe_and_short_stream(noisy: dict[str, Path], tmp_path: Path) -> None:
    py = f"{sys.executable} -m pulsectl"
    r = cli(
        [
            f"{py} diff a.safetensors b.safetensors | head -c 100 >/dev/null; "
            "exit ${PIPESTATUS[0]}"
        ],
        cwd=tmp_path,
        shell=True,
    )
    assert r.returncode == 1
    err = r.stderr.decode()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.strip().splitlines() == [
        "pulsectl: error: output pipe closed before the patch was complete"
    ]
    assert not temps_in(tmp_path)
    data = noisy["patch"].read_bytes()
    r = cli(
        [sys.executable, "-m", "pulsectl", "apply", str(noisy["base"]), "-", "-o", "c"],
        stdin=data[: len(data) // 2],
        cwd=tmp_path,
    )
    assert r.returncode == 3
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "<stdin>" in lines[0] and "ends early" in lines[0], lines
    assert not (tmp_path / "c").exists() and not temps_in(tmp_path)


def test_a_patch_write_cut_short_by_the_reader_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write into a pipe whose reader leaves during it returns short, without an error (seen
    with a 10 MB write to `head -c 10`); the rest of a patch must not be dropped unsaid."""
    from pulsectl.cli import _output

    class ShortPipe(io.RawIOBase):
        def __init__(self) -> None:
            self.got = b""

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            if self.got:
                raise BrokenPipeError(32, "Broken pipe")
            self.got = bytes(data[:3])
            return 3

    class Stdout:
        buffer = ShortPipe()

    monkeypatch.setattr(_output, "_silence_stdout", lambda: None)
    sink = _output._GuardedBuffer(_output.GuardedStdout(Stdout()), "the patch")
    with pytest.raises(OutputError, match="^output pipe closed before the patch was complete$"):
        sink.write(b"patch bytes")
    assert Stdout.buffer.got == b"pat"


def test_errors_are_pulse_errors() -> None:
    """The classes the CLI maps: damage is an integrity error (3), the rest input errors (1)."""
    assert CorruptPatchError("x").exit_code == 3
    assert (
        FormatError("x").exit_code == InputError("x").exit_code == OutputError("x").exit_code == 1
    )


def test_a_store_s_own_objects_are_not_outputs_the_user_named(
    tmp_path: Path,
    sigint_after_rename: list[Path],
    capsys: Capsys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """publish renames store objects and cache files into place; an interrupt there used to
    print "interrupted after STORE/pulse-store.json was written" (or a cache file), though the
    step was not published. They are not recorded as outputs: no rename during publish is one
    (the fixture interrupts at each recorded rename), while pull's checkpoint still is."""
    monkeypatch.setenv("PULSECTL_CACHE_DIR", str(tmp_path / "cache"))
    base, new = write_small_pair(tmp_path)
    store = tmp_path / "store"
    assert main(["-q", "publish", str(store), str(base), "--anchor"]) == 0
    assert main(["-q", "publish", str(store), str(new)]) == 0
    assert sigint_after_rename == []
    capsys.readouterr()
    out = tmp_path / "pulled.safetensors"
    assert main(["-q", "pull", str(store), "-o", str(out)]) == 130
    assert one_line(capsys) == f"pulsectl: error: interrupted after {out} was written"
    assert sigint_after_rename == [out] and out.read_bytes() == new.read_bytes()


def test_interrupt_inside_deferred_block_is_raised_after_it(tmp_path: Path) -> None:
    """SIGINT/SIGTERM between creating a temp file and recording it wait for the block's end,
    where they raise as they would have, and the handlers are back as they were."""
    import signal

    from pulsectl._atomic import interrupts_deferred

    class Term(Exception):
        pass

    def on_term(signum: int, frame: object) -> None:
        raise Term

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        for sig, raised in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Term)):
            steps = []
            with pytest.raises(raised), interrupts_deferred():
                os.kill(os.getpid(), sig)
                for _ in range(1000):  # the handler runs between these lines, and holds
                    steps.append(1)
                steps.append(2)
            assert steps[-1] == 2 and len(steps) == 1001
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert signal.getsignal(signal.SIGTERM) is on_term
    finally:
        signal.signal(signal.SIGTERM, before)


def test_interrupt_right_after_temp_created_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt that lands the moment a temp file exists (here: sent from inside mkstemp)
    still leaves no temp file, from temp_path or from atomic_file."""
    import signal
    import tempfile

    from pulsectl._atomic import atomic_file, temp_path

    real = tempfile.mkstemp

    def mkstemp_then_sigint(*args: Any, **kwargs: Any) -> tuple[int, str]:
        made = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return made

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_sigint)
    with pytest.raises(KeyboardInterrupt):
        temp_path(tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt), atomic_file(tmp_path / "y.pulse", force=False) as f:
        f.write(b"never")
    assert list(tmp_path.iterdir()) == []


def test_a_source_that_cannot_be_read_is_not_called_a_write_failure(tmp_path: Path) -> None:
    """atomic_file reported any OSError of its body as 'OUT: cannot write', a source that
    could not be read too (a folder store's upload reads one)."""
    from pulsectl.errors import InputError

    out = tmp_path / "out"
    with (
        pytest.raises(InputError, match=r"missing: cannot read: No such file"),
        _atomic.atomic_file(out, force=False),
    ):
        open(tmp_path / "missing", "rb")  # noqa: SIM115
    assert list(tmp_path.iterdir()) == []
