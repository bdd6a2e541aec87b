"""The CLI through its error boundary ``pulsectl.cli.app.main``: exit codes, streams, messages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from conftest import TEMP_GLOB, tree_bytes
from safetensors import safe_open

from pulsectl import __version__
from pulsectl.cli.app import main


def _error_line(err: str) -> str:
    """The stderr of a failed command must be exactly one ``pulsectl: error:`` line."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pulsectl: error: "), err
    assert "Traceback (most recent call last)" not in err
    return lines[0]


def test_error_naming_a_file_with_a_line_break_stays_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file name (or a damaged file's text) with control characters in it is shown escaped,
    so that the error is still one line for the scripts that read it."""
    odd = tmp_path / "step\n1\x1b.safetensors"
    odd.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{} broken")
    assert main(["hash", str(odd)]) == 1
    line = _error_line(capsys.readouterr().err)
    assert "step\\n1\\x1b.safetensors" in line


def test_names_from_files_show_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect and stats print tensor names as they are: brackets and colons are not rich
    markup or emoji codes, and control characters (a line break, a terminal escape) are shown
    escaped instead of reaching the terminal."""
    import numpy as np

    from pulsectl.checkpoint import save_safetensors

    names = {
        "w[b].weight": "w[b].weight",
        "x[red]y:fire:.weight": "x[red]y:fire:.weight",
        "evil\x1b[31m.weight": "evil\\x1b[31m.weight",
        "two\nlines.weight": "two\\nlines.weight",
    }
    w = np.arange(4096, dtype=np.uint16)
    moved = w + (np.arange(4096) % 7 == 0).astype(np.uint16)
    a, b, p = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "p.pulse"
    save_safetensors(a, {n: ("BF16", (4096,), w) for n in names})
    save_safetensors(b, {n: ("BF16", (4096,), moved) for n in names})
    assert main(["-q", "diff", str(a), str(b), "-o", str(p)]) == 0
    for argv in (["inspect", str(p)], ["stats", str(a), str(b)], ["stats", str(p)]):
        capsys.readouterr()
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out, argv
        rows = [line for line in out.splitlines() if ".weight" in line]
        assert len(rows) == len(names), (argv, out)
        for shown in names.values():
            assert sum(f" {shown} " in row for row in rows) == 1, (argv, shown, out)


@pytest.fixture
def pair(chain: list[Path], tmp_path: Path) -> tuple[Path, Path, Path]:
    """Copies of steps 0 and 1 and the patch between them, in a fresh folder."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(chain[0].read_bytes())
    b.write_bytes(chain[1].read_bytes())
    p = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(a), str(b), "-o", str(p)]) == 0
    return a, b, p


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert (
        "Exit codes: 0 ok, 1 error, 2 usage, 3 integrity (wrong base, damaged patch, "
        "fingerprint mismatch), 130 interrupted, 141 the reader of text output went away "
        "(| head; no message, as git)." in " ".join(out.split())
    )
    for command in ("diff", "apply", "hash", "verify", "inspect"):
        assert command in out


def _leaf_commands() -> list[tuple[str, Any]]:
    import typer.main

    from pulsectl.cli.app import app

    found: list[tuple[str, Any]] = []

    def walk(command: Any, name: str) -> None:
        for sub_name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{name} {sub_name}".strip())
        if not hasattr(command, "commands"):
            found.append((name, command))

    walk(typer.main.get_command(app), "")
    return found


def test_help_names_every_value_in_capitals(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option that takes a value and every argument shows a name such as OUT or N (not
    typer's <path> or <int range>), and an argument that takes several ends in '...', in the
    usage line too."""
    leaves = _leaf_commands()
    assert len(leaves) >= 16
    for name, command in leaves:
        for param in command.params:
            if getattr(param, "is_flag", False):
                continue
            assert param.metavar, (name, param.opts)
            bare = param.metavar.removesuffix("...")
            assert bare == bare.upper(), (name, param.opts, param.metavar)
            assert param.metavar.endswith("...") == (param.nargs == -1), (name, param.opts)
        assert main([*name.split(), "--help"]) == 0
        out = capsys.readouterr().out
        typer_names = r"<(path|str|text|int|integer|float|int range|float range|choice)>"
        panels = out[min(out.find(h) for h in ("Arguments:", "Options:") if h in out) :]
        assert not re.search(typer_names, panels), (name, out)
        usage = next(line for line in out.splitlines() if line.startswith("Usage:"))
        for param in command.params:
            if getattr(param, "nargs", 1) == -1:
                assert f"{{{param.metavar}}}" in usage, (name, usage)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """The version, then which loops run: the compiled ones and their SIMD level, or numpy."""
    from pulsectl.codecs import _fast

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    if _fast.native is None:
        assert out.startswith(f"pulsectl {__version__} (codec loops: numpy (")
    else:
        level = _fast.native.simd(None)
        assert level in _fast.SIMD_LEVELS  # re-exported from pulsectl._env
        assert out == f"pulsectl {__version__} (codec loops: compiled, {level})\n"


@pytest.mark.parametrize(
    ("name", "default"),
    [
        ("PULSECTL_PREHASH", "on"),
        ("PULSECTL_PURE_PYTHON", "off"),
        ("PULSECTL_NO_AVX512", "off"),
        ("PULSECTL_DEBUG", "off"),
    ],
)
def test_a_switch_in_the_environment_takes_1_0_or_nothing(
    name: str,
    default: str,
    chain: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Any value but 0 used to mean on (PREHASH) or any value but 0 and '' to mean on
    (PURE_PYTHON), silently: `PULSECTL_PURE_PYTHON=no` turned the compiled loops off. Now
    another value is a usage error, before the command runs."""
    out = tmp_path / "p.pulse"
    argv = ["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(out)]
    for value in ("yes", "no", "true", "off", "2", " 1", "1 "):
        monkeypatch.setenv(name, value)
        assert main(argv) == 2, value
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: environment variable {name}={value!r}: give 1 (on) or 0 (off), "
            f"or unset it ({default} by default)"
        )
        assert not out.exists()
    for value in ("1", "0", ""):
        monkeypatch.setenv(name, value)
        assert main([*argv, "-f"]) == 0, value
        assert capsys.readouterr().err == ""


def test_pulsectl_simd_takes_a_level_or_nothing(
    chain: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A PULSECTL_SIMD the loops do not know used to be a warning, and the run went on with
    the best loops; in the CLI it is a usage error like the switches' (the library still warns:
    test_speedups)."""
    out = tmp_path / "p.pulse"
    argv = ["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(out)]
    for value in ("sse9", "AVX2", "avx2 "):
        monkeypatch.setenv("PULSECTL_SIMD", value)
        assert main(argv) == 2, value
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: environment variable PULSECTL_SIMD={value!r}: give avx512, avx2 "
            "or portable, or unset it (the most this CPU has)"
        )
        assert not out.exists()
    for value in ("avx512", "avx2", "portable", ""):
        monkeypatch.setenv("PULSECTL_SIMD", value)
        assert main([*argv, "-f"]) == 0, value
        assert capsys.readouterr().err == ""


def test_version_names_the_numpy_fallback() -> None:
    """With the extension turned off, --version says so (in a child: the choice is made at
    import)."""
    env = {**os.environ, "PULSECTL_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pulsectl", "--version"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    assert out == f"pulsectl {__version__} (codec loops: numpy (PULSECTL_PURE_PYTHON is set))\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], None),
        (["nonsense"], "no such command 'nonsense'; try 'pulsectl -h' for help"),
        (["diff"], "missing argument 'OLD'; try 'pulsectl diff -h' for help"),
        (["diff", "x.safetensors"], "missing argument 'NEW'; try 'pulsectl diff -h' for help"),
        (["diff", "--level", "0", "a", "b"], "give 1..22 or 'max'"),
        (["diff", "--level", "23", "a", "b"], "give 1..22 or 'max'"),
        (["diff", "--no-such-option", "a", "b"], "; try 'pulsectl diff -h' for help"),
        (["apply", "a.safetensors"], "; try 'pulsectl apply -h' for help"),
        (["apply", "-j", "0", "a", "p", "-o", "c"], "; try 'pulsectl apply -h' for help"),
        (["verify", "a"], "give exactly one of --patch and --hash"),
        (["inspect"], "missing argument 'PATCH'; try 'pulsectl inspect -h' for help"),
        (["hash"], "missing argument 'CKPT...'; try 'pulsectl hash -h' for help"),
        (
            ["diff", "a", "b", "-o", "x.pulse", "--blocks", "0"],
            "invalid value for '--blocks': 0 is not in the range x>=1; "
            "try 'pulsectl diff -h' for help",
        ),
        (["diff", "a", "b", "--blocks", "abc"], "; try 'pulsectl diff -h' for help"),
        (["diff", "a", "b", "--level"], "option '--level' requires an argument; try 'pulsectl"),
        (["loco", "nonsense"], "no such command 'nonsense'; try 'pulsectl loco -h' for help"),
        (["difff"], "no such command 'difff' (did you mean 'diff'?); try 'pulsectl -h' for help"),
        (["diff", "--levl", "3", "a", "b"], "no such option: --levl (possible options: --help, "),
        (["loco", "encode"], "; try 'pulsectl loco encode -h' for help"),
    ],
)
def test_parser_usage_errors_exit_2(
    argv: list[str], needle: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Errors the parser finds (a bad option value, a missing argument, an unknown option or
    command) are one line with the hint to run -h, like every other error; they used to be
    click's usage block. `pulsectl` alone prints the help."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    if needle is None:
        assert err.startswith("Usage: pulsectl") and "Commands:" in err, err
    else:
        assert needle in _error_line(err)


def test_library_usage_errors_exit_2(
    pair: tuple[Path, Path, Path],
    sharded_chain: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b, p = pair
    cases = [
        (["apply", str(a), str(p)], "give -o OUT"),
        (["apply", str(a), str(p), "-o", str(tmp_path / "c"), "--in-place"], "--in-place"),
        (["apply", str(a), str(p), "-o", str(a)], "is BASE"),
        (["apply", str(a), "-", "-", "-o", str(tmp_path / "c")], "only once"),
        (  # BASE and PATCH swapped: says which comes first, not 'bad magic'
            ["apply", str(p), str(a), "-o", str(tmp_path / "c")],
            f"{p}: BASE is a .pulse patch; give the checkpoint first",
        ),
        (["verify", str(b)], "exactly one of --patch and --hash"),
        (["verify", str(b), "--patch", str(p), "--hash", "0" * 32], "exactly one"),
        (["verify", str(b), "--hash", "xyz"], "not a 32-digit hex"),
        (
            ["diff", str(a), str(sharded_chain[1]), "-o", str(tmp_path / "q")],
            "a file against a file",
        ),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        assert needle in _error_line(capsys.readouterr().err)
    assert not (tmp_path / "c").exists()
    assert not (tmp_path / "q").exists()
    assert not list(tmp_path.glob(TEMP_GLOB))


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["diff", "--level", "30", "a", "b"], "--level '30': give 1..22 or 'max'"),
        (["squash", "p", "q", "-o", "r", "--level", "x"], "--level 'x': give 1..22 or 'max'"),
        (
            ["diff", "a", "b", "--as", "int8"],
            "--as 'int8': unknown cast target; choose one of bf16, f16, f8_e4m3, f8_e5m2",
        ),
        (
            ["stats", "a", "b", "--as", "int8"],
            "--as 'int8': unknown cast target; choose one of bf16, f16, f8_e4m3, f8_e5m2",
        ),
        (
            ["publish", "x", "y", "--as", "int8"],
            "--as 'int8': unknown cast target; choose one of bf16, f16, f8_e4m3, f8_e5m2",
        ),
        (
            ["cast", "a", "-o", "c", "--to", "int8"],
            "--to 'int8': unknown cast target; choose one of bf16, f16, f8_e4m3, f8_e5m2",
        ),
        (
            ["stats", "a", "b", "c", "--k", "x"],
            "--k 'x': give positive integers separated by commas",
        ),
        (
            ["publish", "x", "y", "--max-patch-fraction", "2"],
            "--max-patch-fraction 2.0: give a value in (0, 1]",
        ),
        (["pull", "x", "-o", "c", "--step", "abc"], "--step 'abc': give a step number or 'latest'"),
        (
            ["demo", "--shape", "huge"],
            "--shape 'huge': choose one of tiny, small, qwen2.5-0.5b, qwen2.5-7b",
        ),
        (["diff", "a", "b", "--device", "tpu"], "--device 'tpu': give auto, cpu or cuda[:N]"),
        (["verify", "a", "--hash", "xyz"], "--hash 'xyz' is not a 32-digit hex fingerprint"),
        (["verify", "a"], "give exactly one of --patch and --hash"),
        (["apply", "a", "p"], "give -o OUT, or --in-place to update BASE"),
        (
            ["diff", "a", "b", "--blocks", "2"],
            "--blocks writes several files: give -o PATCH (not stdout)",
        ),
        (
            ["loco", "encode", "-g", "g", "-l", "w", "-r", "r", "-o", "o", "--visible", "f32"],
            "--visible 'f32': choose one of bf16, f16, f8_e4m3",
        ),
        (
            ["loco", "step", "-g", "g", "-u", "u", "-o", "o", "--plain", "--lr", "0"],
            "--lr 0: the outer learning rate must be finite and > 0",
        ),
    ],
)
def test_option_values_checked_by_commands_are_usage_errors_with_the_hint(
    argv: list[str],
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A value the parser cannot judge (a level, a cast target, a list of k), or options that
    do not go together, checked by the command before anything is read or written: the line
    names the option and ends with the parser's hint, exit 2. These lacked the hint; `--as`
    was not named."""
    monkeypatch.chdir(tmp_path)  # no input exists; nothing may be made
    assert main(argv) == 2, argv
    assert list(tmp_path.iterdir()) == []
    command = f"loco {argv[1]}" if argv[0] == "loco" else argv[0]
    assert _error_line(capsys.readouterr().err) == (
        f"pulsectl: error: {line}; try 'pulsectl {command} -h' for help"
    )


def test_diff_refuses_a_terminal(
    pair: tuple[Path, Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b, _ = pair
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["diff", str(a), str(b)]) == 2
    assert "terminal" in _error_line(capsys.readouterr().err)


def test_diff_to_stdout_equals_diff_to_file(
    pair: tuple[Path, Path, Path], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    a, b, p = pair
    assert main(["diff", str(a), str(b)]) == 0
    first = capsysbinary.readouterr()
    assert first.out == p.read_bytes()
    assert b"words changed" in first.err  # the summary goes to stderr, not into the patch
    assert main(["-q", "diff", str(a), str(b), "-o", "-"]) == 0
    second = capsysbinary.readouterr()
    assert second.out == p.read_bytes()
    assert second.err == b""


def test_overwrite_needs_force(
    pair: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, p = pair
    c = tmp_path / "c.safetensors"
    c.write_bytes(b"keep me")
    assert main(["apply", str(a), str(p), "-o", str(c)]) == 1
    assert "exists; pass -f" in _error_line(capsys.readouterr().err)
    assert c.read_bytes() == b"keep me"
    assert main(["apply", str(a), str(p), "-o", str(c), "-f"]) == 0
    assert c.read_bytes() == b.read_bytes()
    capsys.readouterr()

    before = p.read_bytes()
    assert main(["diff", str(b), str(a), "-o", str(p)]) == 1
    assert str(p) in _error_line(capsys.readouterr().err)
    assert p.read_bytes() == before
    assert main(["diff", str(b), str(a), "-o", str(p), "--force"]) == 0
    assert p.read_bytes() != before
    assert not list(tmp_path.glob(TEMP_GLOB))


def test_apply_in_place(pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b, p = pair
    assert main(["apply", str(a), str(p), "--in-place"]) == 0
    assert a.read_bytes() == b.read_bytes()
    assert "verified" in capsys.readouterr().err
    assert not list(a.parent.glob(TEMP_GLOB))
    # A second time the base is the target: wrong base, nothing changes.
    assert main(["apply", str(a), str(p), "--in-place"]) == 3
    assert "wrong base" in _error_line(capsys.readouterr().err)
    assert a.read_bytes() == b.read_bytes()


def test_counts_in_messages_agree_with_their_nouns(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pulsectl.errors import counted

    assert [counted(n, "patch", "patches") for n in (0, 1, 2, 1234)] == [
        "0 patches",
        "1 patch",
        "2 patches",
        "1,234 patches",
    ]
    assert counted(1, "step") == "1 step" and counted(3, "step") == "3 steps"
    patches = [tmp_path / "p1.pulse", tmp_path / "p2.pulse"]
    for old, new, p in zip(chain[:2], chain[1:3], patches, strict=True):
        assert main(["-q", "diff", str(old), str(new), "-o", str(p)]) == 0
    out = tmp_path / "out.safetensors"
    assert main(["apply", str(chain[0]), str(patches[0]), "-o", str(out)]) == 0
    assert "from 1 patch, verified" in capsys.readouterr().err
    assert main(["apply", str(chain[0]), *map(str, patches), "-o", str(out), "-f"]) == 0
    assert "from 2 patches, verified" in capsys.readouterr().err
    assert main(["inspect", str(patches[0])]) == 0
    layout = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("layout"))
    assert re.fullmatch(r"layout +file, 1 file, [\d,]+ items", layout), layout


def test_diff_names_the_tensors_it_carries_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A vocabulary resize, a new tensor and a dropped one are named after the summary line (a
    few of each); checkpoints with no tensor in common get a warning; -q silences both."""
    import numpy as np

    from pulsectl.checkpoint import save_safetensors
    from pulsectl.diff import diff_checkpoints

    w = np.arange(64, dtype=np.uint16)
    old = {
        "embed.weight": ("BF16", (8, 8), w),
        "lm_head.weight": ("BF16", (8, 8), w),
        "norm.weight": ("BF16", (64,), w),
        "old_only.bias": ("BF16", (64,), w),
    }
    new = {
        "embed.weight": ("BF16", (9, 8), np.arange(72, dtype=np.uint16)),  # a row added
        "lm_head.weight": ("F32", (8, 4), w.view(np.uint8).view(np.uint32)),  # re-typed
        "norm.weight": ("BF16", (64,), w + 1),
        "new_only.bias": ("BF16", (64,), w),
    }
    a, b, p = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "p.pulse"
    save_safetensors(a, old)
    save_safetensors(b, new)
    with p.open("wb") as f:
        summary = diff_checkpoints(a, b, f)
    assert summary.new_tensors == ("new_only.bias",)
    assert set(summary.recast_tensors) == {"embed.weight", "lm_head.weight"}
    assert summary.removed_tensors == ("old_only.bias",)
    assert summary.diffed_tensors == 1
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "-o", str(p), "-f"]) == 0
    err = capsys.readouterr().err
    assert "carried whole: 1 tensor that OLD does not have (new_only.bias)" in err
    recast = next(ln for ln in err.splitlines() if "another shape or dtype" in ln)
    assert recast.startswith("carried whole: 2 tensors ") and "embed.weight" in recast
    assert "dropped: 1 tensor of OLD that NEW does not have (old_only.bias)" in err
    assert "no tensor in common" not in err
    # Nothing in common: a warning. Many names: three shown, then a count.
    many = {f"t{i}": ("BF16", (64,), w) for i in range(5)}
    c = tmp_path / "c.safetensors"
    save_safetensors(c, many)
    assert main(["diff", str(a), str(c), "-o", str(p), "-f"]) == 0
    err = capsys.readouterr().err
    assert "(t0, t1, t2 and 2 more)" in err
    assert "pulsectl: warning: OLD and NEW have no tensor in common" in err
    assert main(["-q", "diff", str(a), str(c), "-o", str(p), "-f"]) == 0
    assert capsys.readouterr().err == ""
    # inspect counts them too.
    assert main(["-q", "diff", str(a), str(b), "-o", str(p), "-f"]) == 0
    assert main(["inspect", str(p)]) == 0
    whole = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("carried whole")]
    assert len(whole) == 1 and " 3 tensors stored without a base reference" in whole[0], whole
    # A plain update names nothing.
    assert main(["diff", str(a), str(a), "-o", str(p), "-f"]) == 0
    assert "carried whole" not in capsys.readouterr().err
    assert main(["inspect", str(p)]) == 0
    assert "carried whole" not in capsys.readouterr().out


def test_apply_in_place_folder(sharded_chain: list[Path], tmp_path: Path) -> None:
    import shutil

    base = tmp_path / "ckpt"
    shutil.copytree(sharded_chain[0], base)
    p = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(base), str(sharded_chain[2]), "-o", str(p)]) == 0
    assert main(["-q", "apply", str(base), str(p), "--in-place"]) == 0
    assert tree_bytes(base) == tree_bytes(sharded_chain[2])
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt", "p.pulse"]


def test_an_existing_folder_as_output(
    pair: tuple[Path, Path, Path],
    sharded_chain: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A single-file output given as a folder is refused as such (-f would not help); a
    folder checkpoint's output folder that exists needs -f, and -f replaces it."""
    a, b, p = pair
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    for force in ([], ["-f"]):
        assert main(["apply", str(a), str(p), "-o", str(folder), *force]) == 1
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: {folder}: is a folder, and the patch makes a single file; give "
            "the file's path (-o FOLDER/model.safetensors)"
        )
        assert main(["diff", str(a), str(b), "-o", str(folder), *force]) == 1
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: {folder}: is a folder; give a file path for the output"
        )
    assert [x.name for x in folder.iterdir()] == ["keep.txt"]

    sp = tmp_path / "s.pulse"
    assert main(["-q", "diff", str(sharded_chain[0]), str(sharded_chain[1]), "-o", str(sp)]) == 0
    argv = ["apply", str(sharded_chain[0]), str(sp), "-o", str(folder)]
    assert main(argv) == 1
    assert "output exists; pass -f to overwrite" in _error_line(capsys.readouterr().err)
    # A folder of other files is not replaced, even with -f (tests/test_outputs.py).
    assert main(["-q", *argv, "-f"]) == 1
    assert "is a folder of other files" in _error_line(capsys.readouterr().err)
    assert [x.name for x in folder.iterdir()] == ["keep.txt"]
    (folder / "keep.txt").unlink()
    assert main(["-q", *argv]) == 0  # an empty folder is no output yet
    assert tree_bytes(folder) == tree_bytes(sharded_chain[1])
    assert main(["-q", *argv, "-f"]) == 0  # a checkpoint folder is replaced with -f
    assert tree_bytes(folder) == tree_bytes(sharded_chain[1])


def test_hash_format(
    pair: tuple[Path, Path, Path], sharded_chain: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, _ = pair
    assert main(["hash", str(a), str(b), str(sharded_chain[0])]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == f"{xxhash.xxh3_128_hexdigest(a.read_bytes())}  {a}"
    assert lines[1] == f"{xxhash.xxh3_128_hexdigest(b.read_bytes())}  {b}"
    digest, path = lines[2].split("  ")
    assert len(digest) == 32 and int(digest, 16) >= 0 and path == str(sharded_chain[0])
    assert captured.err == ""


def test_library_warnings_are_one_line_and_quiet_silences_them(
    pair: tuple[Path, Path, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A library's warning (torch's, numpy's) during a command: one ``pulsectl: warning:``
    line, where it came from under -v, nothing under -q; Python's own display afterwards."""
    import warnings

    import pulsectl.inventory

    real = pulsectl.inventory.fingerprint_of

    def warns(*args: Any, **kwargs: Any) -> Any:
        warnings.warn("a library says\nsomething", RuntimeWarning, stacklevel=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pulsectl.inventory, "fingerprint_of", warns)
    before = warnings.showwarning
    a = pair[0]
    assert main(["hash", str(a)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "pulsectl: warning: a library says something\n"
    assert captured.out.endswith(f"  {a}\n")
    assert main(["hash", str(a), "-v"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("pulsectl: warning: a library says something (RuntimeWarning at ")
    assert err.count("\n") == 1 and "test_cli.py:" in err
    assert main(["-q", "hash", str(a)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.endswith(f"  {a}\n")
    # The filters still decide: an error filter makes the warning an error, as Python's -W.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["hash", str(a)]) != 0
    assert "a library says" in capsys.readouterr().err
    assert warnings.showwarning is before


def test_summary_says_when_the_patch_is_not_smaller(
    pair: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny checkpoint whose every word changed gives a patch larger than the target: the
    summaries of diff and stats say so, instead of "0.2x smaller than the target"."""
    import numpy as np

    from pulsectl.checkpoint import save_safetensors

    a, b, p = tmp_path / "ta.safetensors", tmp_path / "tb.safetensors", tmp_path / "t.pulse"
    save_safetensors(a, {"w": ("F32", (8,), np.zeros(8, dtype=np.float32))})
    save_safetensors(b, {"w": ("F32", (8,), np.ones(8, dtype=np.float32))})
    target = b.stat().st_size
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "-o", str(p)]) == 0
    err = capsys.readouterr().err
    assert f", larger than the target ({target:,} bytes)" in err, err
    assert "smaller" not in err
    for argv in (["stats", str(p)], ["stats", str(a), str(b)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert f", larger than the target ({target:,} bytes)" in out and "smaller" not in out
    # A real pair still gets its ratio.
    pa, pb, pp = pair
    assert main(["stats", str(pp)]) == 0
    assert re.search(r", \d+\.\dx smaller than the target\n", capsys.readouterr().out)


def test_hash_goes_on_past_a_checkpoint_it_cannot_read(
    pair: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As sha256sum: one error line per unreadable checkpoint, the others still hashed, and
    the exit status of the errors at the end (it used to stop at the first one)."""
    a, b, _ = pair
    missing = tmp_path / "missing.safetensors"
    malformed = tmp_path / "malformed.safetensors"
    malformed.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{} broken")
    assert main(["hash", str(a), str(missing), str(malformed), str(b)]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"{xxhash.xxh3_128_hexdigest(a.read_bytes())}  {a}",
        f"{xxhash.xxh3_128_hexdigest(b.read_bytes())}  {b}",
    ]
    errors = captured.err.strip().splitlines()
    assert len(errors) == 2 and "Traceback" not in captured.err, captured.err
    assert errors[0].startswith(f"pulsectl: error: {missing}: ")
    assert errors[1].startswith(f"pulsectl: error: {malformed}: ")


def test_hash_escapes_odd_names_as_sha256sum_does(
    pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A name with a line break, carriage return or backslash: the line starts with a
    backslash and those characters are escaped (GNU sha256sum's convention)."""
    a = pair[0]
    digest = xxhash.xxh3_128_hexdigest(a.read_bytes())
    names = {"x\ny.safetensors": "x\\ny", "x\\y.safetensors": "x\\\\y", "x\ry.safetensors": "x\\ry"}
    for name in names:
        (a.parent / name).write_bytes(a.read_bytes())
    assert main(["hash", *(str(a.parent / n) for n in names)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"\\{digest}  {a.parent}/{e}.safetensors" for e in names.values()]


def test_verify(pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b, p = pair
    assert main(["verify", str(b), "--patch", str(p)]) == 0
    assert capsys.readouterr().out == ""
    assert main(["verify", str(a), "--patch", str(p)]) == 3
    line = _error_line(capsys.readouterr().err)
    assert str(a) in line and "it is the patch's base: apply the patch to it first" in line
    digest = xxhash.xxh3_128_hexdigest(b.read_bytes())
    assert main(["verify", str(b), "--hash", digest]) == 0
    assert main(["verify", str(b), "--hash", digest.upper()]) == 0
    capsys.readouterr()
    assert main(["verify", str(a), "--hash", digest]) == 3
    line = _error_line(capsys.readouterr().err)
    assert digest in line and "patch's base" not in line


def _words_changed(a: Path, b: Path) -> int:
    """An independent count: tensors loaded by safetensors, words compared by numpy."""
    total = 0
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        for name in fa.keys():  # noqa: SIM118
            x = fa.get_tensor(name).view(torch.int16).numpy()
            y = fb.get_tensor(name).view(torch.int16).numpy()
            total += int((x != y).sum())
    return total


def test_inspect_json(pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b, p = pair
    assert main(["inspect", str(p), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {
        "schema",
        "patch",
        "format_version",
        "patch_bytes",
        "checked",
        "writer",
        "layout",
        "block_bytes",
        "base",
        "target",
        "changed_words",
        "total_words",
        "density",
        "tensors",
    } <= doc.keys()
    assert doc["schema"] == 1 and doc["layout"] == "file"
    assert doc["patch_bytes"] == p.stat().st_size
    assert doc["base"]["fingerprint"] == xxhash.xxh3_128_hexdigest(a.read_bytes())
    assert doc["target"]["fingerprint"] == xxhash.xxh3_128_hexdigest(b.read_bytes())
    assert doc["target"]["bytes"] == b.stat().st_size
    with safe_open(str(b), framework="pt") as f:
        names = sorted(f.keys())
    assert sorted(t["name"] for t in doc["tensors"]) == names
    assert doc["total_words"] == sum(t["words"] for t in doc["tensors"])
    assert doc["changed_words"] == sum(t["changed_words"] for t in doc["tensors"])
    assert doc["changed_words"] == _words_changed(a, b)
    assert 0 < doc["density"] < 1
    for t in doc["tensors"]:
        assert t["dtype"] == "BF16" and t["from_base"] is True
        assert t["words"] * 2 == t["nbytes"]
        assert t["encoded_bytes"] > 0


def test_inspect_check_and_human(
    pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, p = pair
    assert main(["inspect", str(p), "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] is True
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert xxhash.xxh3_128_hexdigest(a.read_bytes()) in out
    assert "changed words" in out


def test_errors_on_bad_inputs(
    tmp_path: Path, pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, p = pair
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    cases = [
        (["diff", str(tmp_path / "missing"), str(b), "-o", str(tmp_path / "x")], "missing"),
        (["diff", str(junk), str(b), "-o", str(tmp_path / "x")], "junk.safetensors"),
        (["inspect", str(a)], "not a .pulse patch (bad magic); it looks like a safetensors file"),
        (["inspect", str(junk)], "not a .pulse patch (bad magic)"),
        (["inspect", str(tmp_path / "nope.pulse")], "nope.pulse"),
        (["apply", str(a), str(tmp_path / "nope.pulse"), "-o", str(tmp_path / "x")], "nope.pulse"),
        (["apply", str(a), str(p), "-o", str(tmp_path / "no" / "x")], "does not exist"),
        (["hash", str(tmp_path / "missing")], "missing"),
        (["hash", str(p)], f"{p}: a .pulse patch, not a safetensors file"),
        (["diff", str(a), str(p), "-o", str(tmp_path / "x")], "a .pulse patch, not a safetensors"),
    ]
    for argv, needle in cases:
        assert main(argv) == 1, argv
        assert needle in _error_line(capsys.readouterr().err)
    assert not (tmp_path / "x").exists()
    assert not list(tmp_path.glob(TEMP_GLOB))


def test_a_missing_output_folder_names_the_fix(
    tmp_path: Path, pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Outputs never create folders: the error says which one to create, and how."""
    a, b, p = pair
    out = tmp_path / "worker dir" / "model.safetensors"
    for argv in (
        ["apply", str(a), str(p), "-o", str(out)],
        ["diff", str(a), str(b), "-o", str(out)],
    ):
        assert main(argv) == 1, argv
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: {out}: folder {out.parent} does not exist; create it first "
            f"(mkdir -p '{out.parent}')"
        )
    assert not out.parent.exists()


def test_an_output_under_a_file_is_not_told_to_mkdir(
    tmp_path: Path, pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`-o p.pulse/x` (a file where a folder should be): `mkdir -p p.pulse` would fail, so the
    line says what is in the way instead of "does not exist; create it first"."""
    a, b, p = pair
    patch = p.read_bytes()
    for out in (p / "x.pulse", p / "sub" / "x.pulse"):
        assert main(["diff", str(a), str(b), "-o", str(out)]) == 1
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: {out}: {p} is not a folder; give a path in a folder for the output"
        )
    assert p.read_bytes() == patch


def test_an_empty_patch_file_is_called_empty(
    tmp_path: Path, pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _b, _p = pair
    empty = tmp_path / "empty.pulse"
    empty.write_bytes(b"")
    for argv in (["inspect", str(empty)], ["apply", str(a), str(empty), "-o", str(tmp_path / "x")]):
        assert main(argv) == 3, argv
        assert _error_line(capsys.readouterr().err) == (
            f"pulsectl: error: {empty}: empty: 0 bytes, no patch in it"
        )
    assert not (tmp_path / "x").exists()


def test_quiet_silences_stderr(
    pair: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, p = pair
    assert main(["-q", "apply", str(a), str(p), "-o", str(tmp_path / "c")]) == 0
    assert capsys.readouterr() == ("", "")


def test_verbose_shows_traceback(
    pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _, p = pair
    assert main(["-v", "verify", str(a), "--patch", str(p)]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("pulsectl: error: ")


def test_diff_and_apply_load_no_heavy_modules(pair: tuple[Path, Path, Path]) -> None:
    """Start-up is paid on every command of a training loop: diff and apply on the CPU must not
    import torch (~1 s) or pydantic (~0.1 s, pulled in by typer 0.29's argument parsing)."""
    import subprocess

    a, b, p = pair
    out = p.parent / "out.safetensors"
    probe = (
        "import sys\n"
        "from pulsectl.cli.app import main\n"
        "codes = [main(['-q', 'diff', sys.argv[1], sys.argv[2], '-o', sys.argv[3], '-f']),\n"
        "         main(['-q', 'apply', sys.argv[1], sys.argv[3], '-o', sys.argv[4]])]\n"
        "print(codes, sorted(m for m in ('torch', 'pydantic') if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, str(a), str(b), str(p), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == "[0, 0] []", run.stdout + run.stderr
    assert out.read_bytes() == b.read_bytes()


def test_demo_keeps_to_a_new_or_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--keep never replaces the user's files (the demo used to overwrite step_001.pulse and
    the chain in a folder that had them); a bad --shape is a usage error."""
    mine = tmp_path / "kd"
    mine.mkdir()
    (mine / "step_001.pulse").write_text("my notes")
    assert main(["demo", "--keep", str(mine), "--shape", "tiny", "--steps", "1"]) == 1
    assert "is a folder that is not empty" in capsys.readouterr().err
    assert (mine / "step_001.pulse").read_text() == "my notes"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["demo", "--keep", str(afile), "--shape", "tiny"]) == 1
    assert "is not a folder" in capsys.readouterr().err
    assert main(["demo", "--shape", "bogus"]) == 2
    assert "--shape 'bogus': choose one of tiny, small" in capsys.readouterr().err
    # Like any output's, DIR's folder is the user's to make (it used to make the parents).
    deep = tmp_path / "no" / "such" / "kd"
    assert main(["demo", "--keep", str(deep), "--shape", "tiny", "--steps", "1"]) == 1
    assert "does not exist; create it first" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_an_empty_argument_is_a_usage_error(
    pair: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Path("") is the current folder: `hash "$CKPT"` with CKPT unset read the whole working
    folder as a checkpoint; `apply "" P -o x` likewise."""
    a, _, p = pair
    for argv in (
        ["hash", ""],
        ["apply", "", str(p), "-o", str(tmp_path / "x")],
        ["diff", str(a), ""],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("pulsectl: error: argument ") and "is empty (an unset shell" in err
    assert not (tmp_path / "x").exists()


def test_an_interrupt_turned_into_another_error_is_still_an_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C that lands inside an import comes out as that module's ImportError (numpy:
    "... failed to import", seen once in CI for test_prehash's interrupted diff): it is an
    interrupt, exit 130, not an internal error."""
    import pulsectl.cli.app as app_module

    def interrupted_import(*args: object, **kwargs: object) -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("numpy._core.multiarray failed to import") from None

    monkeypatch.setattr(app_module, "app", interrupted_import)
    assert main(["hash", "x"]) == 130
    assert capsys.readouterr().err == "pulsectl: error: interrupted; no output was written\n"


def test_an_output_inside_a_folder_checkpoint_it_reads_is_refused(
    sharded_chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every file in a folder checkpoint is part of it: a patch, cast, plot or checkpoint
    written inside one would change it, and a later apply to it would fail as a wrong base."""
    base = tmp_path / "base"
    shutil.copytree(sharded_chain[0], base)
    new = sharded_chain[1]
    before = tree_bytes(base)
    patch = tmp_path / "p.pulse"
    assert main(["diff", str(base), str(new), "-o", str(patch), "-q"]) == 0
    runs = {
        "patch": [
            ["diff", str(base), str(new), "-o", str(base / "p.pulse")],
            ["diff", str(base), str(new), "--blocks", "2", "-o", str(base / "b.pulse")],
            ["squash", str(patch), "--base", str(base), "-o", str(base / "s.pulse")],
        ],
        "output": [["apply", str(base), str(patch), "-o", str(base / "new")]],
        "cast": [["cast", str(base), "--to", "f16", "-o", str(base / "f16")]],
        "plot": [["stats", str(base), str(new), "--plot", str(base / "a.png")]],
    }
    for what, commands in runs.items():
        for args in commands:
            out = args[-1].replace("b.pulse", "b.block0.pulse")
            assert main(args) == 2, args
            assert capsys.readouterr().err == (
                f"pulsectl: error: {out}: is inside {base}, a folder checkpoint this command "
                f"reads, which would then hold it; write the {what} outside it\n"
            )
    assert tree_bytes(base) == before


def test_diff_warns_of_a_linked_folder_it_leaves_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Links to folders are not followed (FORMAT.md): a worker rebuilding NEW from the patch
    would lack what they hold, so diff says so (found in review: silently left out). Hidden
    links and links to files are not named."""
    from safetensors.torch import save_file

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "tokenizer.json").write_text("{}")
    old, new = tmp_path / "old", tmp_path / "new"
    for k, folder in enumerate((old, new)):
        (folder / "sub").mkdir(parents=True)
        save_file({"w": torch.full((4,), float(k))}, str(folder / "model.safetensors"))
    (new / "tokenizer").symlink_to(shared)
    (new / "sub" / "more").symlink_to(shared)
    (new / ".cache").symlink_to(shared)
    (new / "tok.json").symlink_to(shared / "tokenizer.json")
    assert main(["diff", str(old), str(new), "-o", str(tmp_path / "p.pulse")]) == 0
    warnings = [w for w in capsys.readouterr().err.splitlines() if "warning" in w]
    assert warnings == [
        f"pulsectl: warning: {new}: not in the patch: sub/more/, tokenizer/ (links to folders "
        "are not followed, docs/FORMAT.md); copy what they hold into the checkpoint to carry it"
    ]
    # publish too: a worker that pulls the step would lack them.
    store = tmp_path / "store"
    assert main(["publish", str(store), str(new)]) == 0
    warnings = [w for w in capsys.readouterr().err.splitlines() if "warning" in w]
    assert warnings == [
        f"pulsectl: warning: {new}: not in the store: sub/more/, tokenizer/ (links to folders "
        "are not followed, docs/FORMAT.md); copy what they hold into the checkpoint to carry it"
    ]
