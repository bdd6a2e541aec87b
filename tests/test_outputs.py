"""What an output may replace, and what replacing it keeps.

- A folder output (in place or with -f) keeps what a folder checkpoint leaves out: hidden
  entries such as `.git` move from the old folder into the new one.
- A folder is not replaced when it holds an input or the current folder, or holds files but no
  checkpoint; a device, pipe or socket is never replaced; `-o -` is stdout only where the
  command can stream (diff, squash), and refused elsewhere.
- An output typed with a trailing '/' (`-o runs/`) names a folder: refused where the output is
  one file (a patch, a single-file checkpoint, a plot, loco's files), the same as without the
  '/' where it is a folder checkpoint. An existing folder is never a single-file output.
- A replaced file keeps its permission bits (and owner, where the user may set it).
- Two `apply --in-place` runs on one BASE take turns: the second applies its patch to what the
  first wrote, instead of silently dropping the first's changes.
"""

from __future__ import annotations

import os
import select
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tree_bytes

from pulsectl import _atomic
from pulsectl.apply import apply_patches
from pulsectl.checkpoint import save_safetensors
from pulsectl.cli.app import main
from pulsectl.diff import DiffOptions, diff_to_path

fcntl = pytest.importorskip("fcntl")  # POSIX locks: --in-place runs take turns with flock


def _cli(*args: str, cwd: Path | None = None, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "pulsectl", *args],
        capture_output=True,
        cwd=cwd,
        check=False,
        timeout=120,
        **kw,
    )


def _bash(script: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """``script`` in bash in ``cwd`` (for its `ulimit`s), `pulsectl` as ``python -m``."""
    script = script.replace("pulsectl ", f"{sys.executable} -m pulsectl ")
    return subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, timeout=120)


def _error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("pulsectl: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture()
def folders(sharded_chain: list[Path], tmp_path: Path) -> tuple[Path, Path, Path]:
    """A writable copy of a folder checkpoint, its patch to the next step, and that step."""
    base = tmp_path / "model"
    shutil.copytree(sharded_chain[0], base)
    patch = tmp_path / "step.pulse"
    diff_to_path(sharded_chain[0], sharded_chain[1], patch, options=DiffOptions(workers=1))
    return base, patch, sharded_chain[1]


def _add_hidden(folder: Path) -> None:
    """A git checkout's and a download cache's hidden entries, top level and nested."""
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main\n")
    (folder / ".git" / "objects" / "ab").write_bytes(b"\x00lfs object")
    (folder / ".gitattributes").write_bytes(b"*.safetensors filter=lfs\n")
    (folder / "extra" / ".cache").mkdir(parents=True)
    (folder / "extra" / ".cache" / "meta").write_bytes(b"etag")


def _hidden(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(folder).items() if k.startswith(".") or "/." in k}


def _visible(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(folder).items() if not (k.startswith(".") or "/." in k)}


def test_in_place_on_a_folder_keeps_its_hidden_entries(folders: tuple[Path, Path, Path]) -> None:
    base, patch, target = folders
    _add_hidden(base)
    hidden = _hidden(base)
    assert set(hidden) == {".git/HEAD", ".git/objects/ab", ".gitattributes", "extra/.cache/meta"}
    assert main(["-q", "apply", str(base), str(patch), "--in-place"]) == 0
    assert _visible(base) == tree_bytes(target)
    assert _hidden(base) == hidden
    assert not [p for p in base.parent.iterdir() if ".pulsectl-" in p.name]


def test_in_place_reshard_gives_new_shards_the_old_shards_mode(tmp_path: Path) -> None:
    """Found in review: a folder of private 0600 shards, re-sharded by the patch (new file
    names), got 0644 new shards. A new file takes the permission bits every old file has: 0600
    beside a 0640 config.json too (no more open than any old file)."""
    import torch
    from safetensors.torch import save_file

    for mixed in (False, True):
        a, b = tmp_path / f"a{mixed}", tmp_path / f"b{mixed}"
        a.mkdir()
        b.mkdir()
        save_file(
            {"w": torch.zeros(4), "v": torch.zeros(4)}, str(a / "model-00001-of-00001.safetensors")
        )
        (a / "config.json").write_text("{}")
        save_file({"w": torch.ones(4)}, str(b / "model-00001-of-00002.safetensors"))
        save_file({"v": torch.ones(4)}, str(b / "model-00002-of-00002.safetensors"))
        (b / "config.json").write_text("{}")
        for f in a.iterdir():
            f.chmod(0o600)
        if mixed:
            (a / "config.json").chmod(0o640)
        patch = tmp_path / f"p{mixed}.pulse"
        assert main(["-q", "diff", str(a), str(b), "-o", str(patch)]) == 0
        assert main(["-q", "apply", str(a), str(patch), "--in-place"]) == 0
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in a.iterdir()}
        assert modes == {
            "config.json": 0o640 if mixed else 0o600,
            "model-00001-of-00002.safetensors": 0o600,
            "model-00002-of-00002.safetensors": 0o600,
        }, modes


def test_a_checkpoint_folder_replaced_with_force_keeps_hidden_entries(
    folders: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    base, patch, target = folders
    out = tmp_path / "out"
    shutil.copytree(base, out)  # an earlier output: a checkpoint folder
    _add_hidden(out)
    hidden = _hidden(out)
    mode = 0o750
    out.chmod(mode)
    assert main(["-q", "apply", str(base), str(patch), "-o", str(out), "-f"]) == 0
    assert _visible(out) == tree_bytes(target)
    assert _hidden(out) == hidden
    assert stat.S_IMODE(out.stat().st_mode) == mode


@pytest.mark.parametrize("where", ["base", "patch", "cwd"])
def test_a_folder_holding_an_input_or_the_current_folder_is_not_replaced(
    folders: tuple[Path, Path, Path], tmp_path: Path, where: str
) -> None:
    base, patch, _ = folders
    out = tmp_path / "outer"
    shutil.copytree(base, out)  # a checkpoint folder: -f alone would replace it
    (out / "ckpt").mkdir()
    argv = ["apply", str(base), str(patch), "-o", str(out), "-f"]
    cwd = None
    if where == "base":
        base = shutil.move(base, out / "model")
        argv[1] = str(base)
    elif where == "patch":
        patch = shutil.move(patch, out / "step.pulse")
        argv[2] = str(patch)
    else:
        cwd = out / "ckpt"
    before = tree_bytes(out)
    run = _cli(*argv, cwd=cwd)
    assert run.returncode == 1, run.stderr
    which = "the current folder" if where == "cwd" else "an input"
    line = _error(run.stderr.decode())
    assert line.startswith(f"pulsectl: error: {out}: holds ") and which in line, line
    assert tree_bytes(out) == before


def test_a_folder_of_other_files_is_not_replaced(
    folders: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    base, patch, _ = folders
    out = tmp_path / "work"
    (out / "data").mkdir(parents=True)
    (out / "data" / "thesis.txt").write_text("years of work")
    runs = tmp_path / "runs"  # checkpoints below it, none at its top: not a checkpoint
    shutil.copytree(base, runs / "run1")
    (runs / "notes.txt").write_text("which run was best")
    before = tree_bytes(runs)
    for folder in (out, runs):
        for args in (["apply", str(base), str(patch)], ["cast", str(base), "--to", "f16"]):
            run = _cli(*args, "-o", str(folder), "-f")
            assert run.returncode == 1
            assert "is a folder of other files" in _error(run.stderr.decode())
    assert tree_bytes(out) == {"data/thesis.txt": b"years of work"}
    assert tree_bytes(runs) == before


def test_a_pipe_is_never_replaced(chain: list[Path], tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    patch, later = tmp_path / "p.pulse", tmp_path / "q.pulse"
    diff_to_path(chain[0], chain[1], patch)
    diff_to_path(chain[1], chain[2], later)
    for argv in (
        ["diff", str(chain[0]), str(chain[1])],
        ["apply", str(chain[0]), str(patch)],
        ["cast", str(chain[0]), "--to", "f16"],
        ["squash", str(patch), str(later)],
    ):
        run = _cli(*argv, "-o", str(fifo), "-f")
        assert run.returncode == 1, (argv, run.stderr)
        assert "is a device, pipe or socket" in _error(run.stderr.decode())
        assert stat.S_ISFIFO(fifo.stat().st_mode)


def test_dash_is_stdout_only_where_a_command_streams(chain: list[Path], tmp_path: Path) -> None:
    p1, p2 = tmp_path / "1.pulse", tmp_path / "2.pulse"
    diff_to_path(chain[0], chain[1], p1)
    diff_to_path(chain[1], chain[2], p2)
    for argv in (["apply", str(chain[0]), str(p1)], ["cast", str(chain[0]), "--to", "f16"]):
        run = _cli(*argv, "-o", "-", cwd=tmp_path)
        assert run.returncode == 2, run.stderr
        assert "-o -: this command writes its output as a file" in _error(run.stderr.decode())
        assert run.stdout == b""
    assert not (tmp_path / "-").exists()
    # squash streams: the same bytes as written to a file.
    squashed = tmp_path / "s.pulse"
    assert _cli("-q", "squash", str(p1), str(p2), "-o", str(squashed)).returncode == 0
    run = _cli("-q", "squash", str(p1), str(p2), "-o", "-", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == squashed.read_bytes()
    assert not (tmp_path / "-").exists()


def test_squash_refuses_a_pipe_as_input(chain: list[Path], tmp_path: Path) -> None:
    p1 = tmp_path / "1.pulse"
    diff_to_path(chain[0], chain[1], p1)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = _cli("squash", str(p1), str(fifo), "-o", str(tmp_path / "s.pulse"))
    assert run.returncode == 2
    assert _error(run.stderr.decode()) == (
        f"pulsectl: error: squash reads patches by seeking; give files, not a pipe ({fifo})"
    )


def _single_file_outputs(chain: list[Path], tmp_path: Path) -> dict[str, list[str]]:
    """For each kind of single-file output: a command line that ends with the option naming it
    (the path goes last)."""
    a, b = (str(c) for c in chain[:2])
    patch, store = tmp_path / "p.pulse", tmp_path / "store"
    diff_to_path(chain[0], chain[1], patch)
    for step in chain[:2]:
        assert main(["-q", "publish", str(store), str(step)]) == 0
    f32 = {"w": np.arange(64, dtype=np.float32).reshape(8, 8) / 64}
    g, lo = tmp_path / "g.safetensors", tmp_path / "l.safetensors"
    save_safetensors(g, {"w": ("F32", (8, 8), f32["w"])})
    save_safetensors(lo, {"w": ("F32", (8, 8), f32["w"] + np.float32(0.01))})
    pg = tmp_path / "pg.pulse"
    assert main(["-q", "loco", "encode", "-g", str(g), "-l", str(lo), "-r", str(tmp_path / "r"),
                 "-o", str(pg)]) == 0  # fmt: skip
    encode = ["loco", "encode", "-g", str(g), "-l", str(lo)]
    step = ["loco", "step", "-g", str(g), "-u", str(pg)]
    return {
        "patch": ["diff", a, b, "-o"],
        "patch (--blocks)": ["diff", a, b, "--blocks", "2", "-o"],
        "patch (--as)": ["diff", a, b, "--as", "f16", "-o"],
        "squashed patch": ["squash", str(patch), "-o"],
        "patched checkpoint": ["apply", a, str(patch), "-o"],
        "cast checkpoint": ["cast", a, "--to", "f16", "-o"],
        "pulled checkpoint": ["pull", str(store), "-o"],
        "plot": ["stats", a, b, "--plot"],
        "loco patch": [*encode, "-r", str(tmp_path / "r2"), "-o"],
        "residual": [*encode, "-o", str(tmp_path / "pg2.pulse"), "-r"],
        "average": ["loco", "reduce", str(pg), "-o"],
        "new global": [*step, "--plain", "-o"],
        "momentum": [*step, "-o", str(tmp_path / "g2.safetensors"), "-m"],
    }


@pytest.mark.parametrize("exists", [False, True])
def test_a_trailing_slash_is_refused_for_a_single_file_output(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], exists: bool
) -> None:
    """`-o runs/` means a folder: a command whose output is one file used to write a file
    named `runs`; now it refuses, before any work, naming the path and the fix."""
    commands = _single_file_outputs(chain, tmp_path)
    out = tmp_path / "runs"
    if exists:
        out.mkdir()
    before = sorted(tmp_path.iterdir())
    capsys.readouterr()
    for what, argv in commands.items():
        for typed in (f"{out}/", f"{out}/."):
            assert main([*argv, typed]) == 2, what
            line = _error(capsys.readouterr().err)
            assert line.startswith(
                f"pulsectl: error: {typed}: ends with '{typed[len(str(out)) :]}', which names a "
                "folder, but the "
            ), (what, line)
            assert line.endswith(
                " is one file: give a file name (FOLDER/NAME to write it in a folder)"
            ), (what, line)
            assert sorted(tmp_path.iterdir()) == before, what
            assert not exists or not any(out.iterdir()), what


def test_an_existing_folder_is_refused_as_a_single_file_output(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With or without -f, before any work: loco's outputs used to fail only once computed,
    with "cannot write: Is a directory", and squash only once its patches were read."""
    commands = _single_file_outputs(chain, tmp_path)
    out = tmp_path / "runs"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    capsys.readouterr()
    del commands["patch (--blocks)"]  # -o names the patches, runs.block0.pulse ...: no folder
    for what, argv in commands.items():
        for force in ([], ["-f"]):
            assert main([*argv[:-1], *force, argv[-1], str(out)]) == 1, what
            line = _error(capsys.readouterr().err)
            assert line.startswith(f"pulsectl: error: {out}: is a folder"), (what, line)
            assert "give " in line and "file" in line, (what, line)
    assert tree_bytes(out) == {"mine.txt": b"kept"}


def test_a_trailing_slash_on_a_folder_output_is_that_folder(
    sharded_chain: list[Path], tmp_path: Path
) -> None:
    """Where the output is a folder checkpoint, `-o runs/` writes the folder `runs`, as
    `-o runs` does."""
    patch, store = tmp_path / "p.pulse", tmp_path / "store"
    diff_to_path(sharded_chain[0], sharded_chain[1], patch)
    for step in sharded_chain[:2]:
        assert main(["-q", "publish", str(store), str(step)]) == 0
    base = str(sharded_chain[0])
    for argv in (
        ["apply", base, str(patch)],
        ["cast", base, "--to", "f16"],
        ["pull", str(store)],
    ):
        plain, slashed = tmp_path / "plain", tmp_path / "slashed"
        assert main(["-q", *argv, "-o", str(plain)]) == 0
        assert main(["-q", *argv, "-o", f"{slashed}/"]) == 0
        assert slashed.is_dir()
        assert tree_bytes(slashed) == tree_bytes(plain)
        shutil.rmtree(plain)
        shutil.rmtree(slashed)


def test_a_replaced_file_keeps_its_mode_and_owner(chain: list[Path], tmp_path: Path) -> None:
    base = tmp_path / "model.safetensors"
    shutil.copyfile(chain[0], base)
    base.chmod(0o600)
    owner = (65534, 65534) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    if os.geteuid() == 0:
        os.chown(base, *owner)
    patch = tmp_path / "p.pulse"
    patch.write_bytes(b"")
    patch.chmod(0o640)
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch), "-f"]) == 0
    assert stat.S_IMODE(patch.stat().st_mode) == 0o640
    assert main(["-q", "apply", str(base), str(patch), "--in-place"]) == 0
    assert base.read_bytes() == chain[1].read_bytes()
    st = base.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert (st.st_uid, st.st_gid) == owner
    fresh = tmp_path / "fresh.pulse"  # a new file gets the usual bits
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(fresh)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644 & ~umask


def test_in_place_runs_on_one_base_take_turns(chain: list[Path], tmp_path: Path) -> None:
    """A run that finds BASE locked waits; once the other run has renamed its result into
    place, it applies its own block patch to that result."""
    base = tmp_path / "model.safetensors"
    shutil.copyfile(chain[0], base)
    run = _cli("diff", str(chain[0]), str(chain[1]), "--blocks", "2", "-o", str(tmp_path / "b"))
    assert run.returncode == 0, run.stderr
    blocks = sorted(tmp_path.glob("b.*.pulse"))
    assert len(blocks) >= 2
    first, rest = blocks[0], blocks[1:]
    held = os.open(base, os.O_RDONLY)  # as another run updating BASE would hold it
    fcntl.flock(held, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pulsectl", "apply", str(base), *map(str, rest), "--in-place"],
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        ready, _, _ = select.select([proc.stderr], [], [], 60)  # the line, or fail (no hang)
        assert ready, "no 'waiting' line within 60 s"
        line = proc.stderr.readline().decode()
        assert line == f"{base}: another pulsectl is updating it; waiting for it to finish\n"
        time.sleep(0.2)
        assert proc.poll() is None and base.read_bytes() == chain[0].read_bytes()
        # The other run finishes: its result is renamed over BASE, then its lock goes.
        done = tmp_path / "first.safetensors"
        apply_patches(chain[0], [first], done)
        os.replace(done, base)
    finally:
        os.close(held)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert base.read_bytes() == chain[1].read_bytes()


def test_a_failed_or_interrupted_carry_keeps_the_old_folder(
    folders: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the new folder is in place the old one is set aside under a name of its own
    (`.NAME.pulsectl-kept-*`), so that no clean-up of temps reaches the hidden entries it
    still holds: if moving them fails, it is kept and named; a signal waits for the carry."""
    import signal

    from pulsectl import _atomic
    from pulsectl.errors import OutputError

    base, patch, target = folders
    _add_hidden(base)
    hidden = _hidden(base)
    real = _atomic._carry_hidden

    def fails(old: Path, new: Path) -> list[str]:
        os.kill(os.getpid(), signal.SIGINT)  # held until the carry is done
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_atomic, "_carry_hidden", fails)
    with pytest.raises(KeyboardInterrupt):  # the held SIGINT, after the failure was handled
        apply_patches(base, [patch], in_place=True)
    assert _visible(base) == tree_bytes(target)  # the new checkpoint is in place
    kept = [p for p in base.parent.iterdir() if ".pulsectl-kept-" in p.name]
    assert len(kept) == 1 and _hidden(kept[0]) == hidden  # nothing of them was lost

    shutil.rmtree(kept[0])
    shutil.rmtree(base)
    shutil.copytree(folders[2], base)  # a fresh base: the target, patched back is not needed
    monkeypatch.setattr(_atomic, "_carry_hidden", real)
    _add_hidden(base)
    back = base.parent / "back.pulse"
    diff_to_path(target, target, back)

    def interrupted(old: Path, new: Path) -> list[str]:
        os.kill(os.getpid(), signal.SIGINT)
        return real(old, new)

    monkeypatch.setattr(_atomic, "_carry_hidden", interrupted)
    with pytest.raises(KeyboardInterrupt):
        apply_patches(base, [back], in_place=True)
    assert _hidden(base) == hidden  # carried before the signal was acted on
    assert not [p for p in base.parent.iterdir() if ".pulsectl-" in p.name]

    monkeypatch.setattr(_atomic, "_carry_hidden", lambda old, new: [".git"])
    with pytest.raises(OutputError, match=r"\.git could not move: the new checkpoint has"):
        apply_patches(base, [back], in_place=True)
    kept = [p for p in base.parent.iterdir() if ".pulsectl-kept-" in p.name]
    assert len(kept) == 1 and (kept[0] / ".git" / "HEAD").exists()


def test_a_closed_stdin_gives_an_empty_patch(chain: list[Path], tmp_path: Path) -> None:
    r = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m pulsectl apply {chain[0]} - -o x <&-"],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert r.returncode == 3, r.stderr
    assert "no patch bytes arrived" in _error(r.stderr.decode())
    assert not (tmp_path / "x").exists()


def test_apply_never_writes_its_checkpoint_over_one_of_its_patches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`apply BASE P -o P -f` (a typo for the output) used to replace the patch with the
    checkpoint; as `diff -o NEW` and `apply -o BASE` are, it is refused even with -f."""
    a, b, p = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "p.pulse"
    save_safetensors(a, {"w": ("F32", [64], np.arange(64, dtype=np.float32))})
    save_safetensors(b, {"w": ("F32", [64], np.arange(64, dtype=np.float32) + 1)})
    assert main(["-q", "diff", str(a), str(b), "-o", str(p)]) == 0
    patch = p.read_bytes()
    for extra in ([], ["-f"]):
        assert main(["apply", str(a), str(p), "-o", str(p), *extra]) == 2
        assert capsys.readouterr().err.strip() == (
            f"pulsectl: error: {p} is patch 1 of this apply; the checkpoint would replace it, "
            "even with -f: write the output elsewhere"
        )
    assert p.read_bytes() == patch


def test_a_new_file_gets_0644_less_the_umask_from_every_command(
    chain: list[Path], tmp_path: Path
) -> None:
    """GUARANTEES.md: under umask 000 too (the tests' usual 022 gives 0644 either way): apply
    created its output with open's 0666, so under 000 it was world-writable."""
    patch = tmp_path / "p.pulse"
    store = tmp_path / "store"
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch)]) == 0
    assert main(["-q", "publish", str(store), str(chain[0])]) == 0
    commands = {
        "diff": ["diff", str(chain[0]), str(chain[1])],
        "apply": ["apply", str(chain[0]), str(patch)],
        "squash": ["squash", str(patch)],
        "cast": ["cast", str(chain[0]), "--to", "f16"],
        "pull": ["pull", str(store)],
    }
    old = os.umask(0)
    try:
        for name, argv in commands.items():
            out = tmp_path / f"{name}.out"
            assert main(["-q", *argv, "-o", str(out)]) == 0, name
            assert stat.S_IMODE(out.stat().st_mode) == 0o644, name
    finally:
        os.umask(old)


@pytest.mark.parametrize("command", ["diff", "apply", "squash", "cast"])
def test_an_output_another_run_wrote_meanwhile_is_not_replaced_without_f(
    command: str,
    chain: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two runs with the same -o and no -f: both found OUT absent when they started, and the
    second to finish replaced the first one's output, both exit 0. Now the output is renamed
    into place only where nothing is there yet (renameat2 RENAME_NOREPLACE); with -f it is
    replaced as asked."""
    patch = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch)]) == 0
    argv = {
        "diff": ["diff", str(chain[0]), str(chain[1])],
        "apply": ["apply", str(chain[0]), str(patch)],
        "squash": ["squash", str(patch)],
        "cast": ["cast", str(chain[0]), "--to", "f16"],
    }[command]
    out = tmp_path / "out"
    real = _atomic.keep_mode

    def other_run_finishes_first(tmp: Path, path: Path) -> None:
        if path == out and not out.exists():
            out.write_bytes(b"the other run's output")
        real(tmp, path)

    monkeypatch.setattr(_atomic, "keep_mode", other_run_finishes_first)
    capsys.readouterr()
    assert main([*argv, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "output exists (another run wrote it meanwhile); pass -f" in err, err
    assert out.read_bytes() == b"the other run's output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "p.pulse"]
    out.unlink()
    assert main(["-q", *argv, "-o", str(out), "-f"]) == 0
    assert out.read_bytes() != b"the other run's output"


def test_output_names_up_to_name_max_are_written(
    chain: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A temp beside an output is `.NAME.pulsectl-tmp-XXXXXXXX`: for a legal NAME of 233-255
    bytes that was longer than the system takes, and the command said NAME could not be
    written. The temp's NAME is cut short instead. A name the system refuses (256 bytes) is
    one line, not a traceback from pathlib."""

    def name(n: int, ending: str) -> str:
        return "\u00e9" * ((n - len(ending)) // 2) + "y" * ((n - len(ending)) % 2) + ending

    old, new = chain[0], chain[1]
    monkeypatch.chdir(tmp_path)
    patch = name(255, ".pulse")
    assert len(os.fsencode(patch)) == 255
    assert main(["-q", "diff", str(old), str(new), "-o", patch]) == 0
    out = name(255, ".safetensors")
    assert main(["-q", "apply", str(old), patch, "-o", out]) == 0
    assert Path(out).read_bytes() == new.read_bytes()
    shutil.copy(old, out)
    assert main(["-q", "apply", out, patch, "--in-place"]) == 0
    assert Path(out).read_bytes() == new.read_bytes()
    squashed = name(255, ".s.pulse")
    assert main(["-q", "squash", patch, "--base", str(old), "-o", squashed]) == 0
    cast = name(255, ".f16")
    assert main(["-q", "cast", str(old), "--to", "f16", "-o", cast]) == 0
    assert not [p for p in tmp_path.iterdir() if ".pulsectl-" in p.name]
    capsys.readouterr()
    too_long = "y" * 256
    for argv in (["hash", too_long], ["diff", str(old), str(new), "-o", too_long]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err == f"pulsectl: error: {too_long}: File name too long; give a shorter path\n"


def test_a_named_pipe_for_a_checkpoint_is_refused_at_once(
    chain: list[Path], tmp_path: Path
) -> None:
    """A FIFO given as apply's BASE (or loco's -g/-l) waited for ever in open() for a writer:
    apply opened it to see whether it was a patch. A checkpoint is a file or a folder."""
    fifo = tmp_path / "base.fifo"
    os.mkfifo(fifo)
    patch = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch)]) == 0
    f32 = tmp_path / "g.safetensors"
    save_safetensors(f32, {"w": ("F32", (4,), np.zeros(4, dtype=np.float32))})
    for args in (
        ["apply", str(fifo), str(patch), "-o", str(tmp_path / "o")],
        ["apply", str(fifo), str(patch), "--in-place"],
        [
            "loco",
            "encode",
            "-g",
            str(f32),
            "-l",
            str(fifo),
            "-r",
            str(tmp_path / "r"),
            "-o",
            str(tmp_path / "pg"),
        ],  # fmt: skip
    ):
        r = _cli(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert _error(r.stderr.decode()).endswith("base.fifo: not a regular file or directory")


def test_a_thread_that_cannot_start_is_one_line(
    chain: list[Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under `ulimit -v`, starting a worker thread fails with RuntimeError: it was reported
    as an internal error with a traceback."""
    import pulsectl.inventory

    def no_thread(*a: object, **kw: object) -> str:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(pulsectl.inventory, "fingerprint_of", no_thread)
    assert main(["hash", str(chain[0])]) == 1
    assert capsys.readouterr().err == (
        "pulsectl: error: out of memory: cannot start a worker thread (a memory limit such as "
        "ulimit -v?); give fewer workers (-j) or more memory\n"
    )


def test_a_folder_of_more_shards_than_the_soft_open_files_limit(tmp_path: Path) -> None:
    """Every shard is held open while a command runs: 80 shards failed under a soft limit of
    40 ("Too many open files") though the hard limit was far higher. The soft limit is raised
    to the hard one; under a hard limit too low the line says what to do."""
    rng = np.random.default_rng(3)
    for side in ("old", "new"):
        (tmp_path / side).mkdir()
    for i in range(80):
        w = rng.integers(0, 2**16, 64, dtype=np.uint16)
        name = f"model-{i:05d}-of-00080.safetensors"
        save_safetensors(tmp_path / "old" / name, {f"t{i}": ("BF16", (64,), w)})
        save_safetensors(tmp_path / "new" / name, {f"t{i}": ("BF16", (64,), w ^ (w < 300))})
    r = _bash("ulimit -S -n 40; pulsectl -q diff old new -o p.pulse", tmp_path)
    assert r.returncode == 0, r.stderr
    r = _bash("ulimit -n 40; pulsectl -q diff old new -o q.pulse", tmp_path)
    assert r.returncode == 1
    assert _error(r.stderr.decode()).endswith(
        "cannot open: Too many open files; too many files open at once: raise the limit (ulimit -n)"
    )


def test_a_write_that_fails_midway_names_the_output(chain: list[Path], tmp_path: Path) -> None:
    """A write that fails midway (here a file size limit, as a disk that fills after the check
    of free space) named apply's temp file, removed by then; the line names OUT."""
    patch = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(chain[0]), str(chain[1]), "-o", str(patch)]) == 0
    size_kb = chain[1].stat().st_size // 1024 // 2
    for where in ("-o o.safetensors", "--in-place"):
        base = tmp_path / "base.safetensors"
        shutil.copy(chain[0], base)
        r = _bash(f"ulimit -f {size_kb}; pulsectl apply base.safetensors p.pulse {where}", tmp_path)
        assert r.returncode == 1, r.stderr
        out = "o.safetensors" if where.startswith("-o") else "base.safetensors"
        assert _error(r.stderr.decode()) == f"pulsectl: error: {out}: cannot write: File too large"
        assert base.read_bytes() == chain[0].read_bytes()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors", "p.pulse"]


def test_squash_and_publish_under_a_file_size_limit_name_what_failed(
    chain: list[Path], tmp_path: Path
) -> None:
    """squash --base named a temp of its work folder when its write failed midway; a first
    publish whose cache copy hit a file size limit blamed reading CKPT ("cannot read: File too
    large") and left an empty store folder behind."""
    for i in (0, 1, 2):
        shutil.copy(chain[i], tmp_path / f"s{i}.safetensors")
    for i in (1, 2):
        old, new = tmp_path / f"s{i - 1}.safetensors", tmp_path / f"s{i}.safetensors"
        assert main(["-q", "diff", str(old), str(new), "-o", str(tmp_path / f"p{i}.pulse")]) == 0
    limit = chain[0].stat().st_size // 1024 // 2
    squash = "pulsectl squash p1.pulse p2.pulse --base s0.safetensors -o s.pulse"
    r = _bash(f"ulimit -f {limit}; {squash}", tmp_path)
    assert r.returncode == 1, r.stderr
    assert _error(r.stderr.decode()).startswith("pulsectl: error: s.pulse: "), r.stderr
    r = _bash(f"ulimit -f {limit}; pulsectl publish store s0.safetensors --cache cache", tmp_path)
    assert r.returncode == 1, r.stderr
    line = _error(r.stderr.decode())
    assert "cannot write a copy of s0.safetensors there: File too large" in line, line
    assert line.endswith("nothing was published")
    assert not (tmp_path / "store").exists()
    assert not [p for p in tmp_path.iterdir() if ".pulsectl-" in p.name]
    # pull named the temp inside its work folder.
    for i in (0, 1):
        argv = ["-q", "publish", str(tmp_path / "store"), str(tmp_path / f"s{i}.safetensors")]
        assert main([*argv, "--cache", str(tmp_path / "cache")]) == 0
    pull = f"{sys.executable} -m pulsectl pull store -o pulled.safetensors"
    r = subprocess.run(
        ["bash", "-c", f"ulimit -f {limit}; {pull}"], cwd=tmp_path, capture_output=True, timeout=120
    )
    assert r.returncode == 1, r.stderr
    assert _error(r.stderr.decode()).startswith("pulsectl: error: pulled.safetensors: "), r.stderr
    assert not [p for p in tmp_path.iterdir() if ".pulsectl-" in p.name]


def test_an_error_about_a_temp_names_its_output(tmp_path: Path) -> None:
    """The work folders' marks cut a long NAME shorter than the plain temp's: a 230-byte
    output's squash folder was not known as its temp. And a name with a control character or a
    byte that is not UTF-8 is held escaped in the message: the temp's path was not taken off,
    and the line showed both paths."""
    out = tmp_path / ("y" * 230)
    for tag in ("", "pull-", "cast-", "squash-"):
        work = tmp_path / (_atomic.temp_prefix(out.name, _atomic.TEMP_MARK + tag) + "x1y2z3")
        assert _atomic.is_temp_of(work / "target", out)
        assert _atomic.is_temp_of(work, out)
    assert not _atomic.is_temp_of(tmp_path / "y" / "target", out)
    for name in ("tab\there.safetensors", os.fsdecode(b"caf\xe9.safetensors")):
        out = tmp_path / name
        tmp = tmp_path / (_atomic.temp_prefix(name) + "abcdefgh")
        exc = _atomic.OutputError(f"{tmp}: cannot write: File too large", path=tmp)
        mapped = _atomic.error_of_output(exc, out)
        assert mapped.message == _atomic.escape_controls(f"{out}: cannot write: File too large")
