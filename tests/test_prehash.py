"""Fingerprints hashed ahead by a child process while the CLI loads (pulsectl._prehash): the
same fingerprints as pulsectl.sources.scan, used only for the same unchanged file, the same
patches and hash lines from the console script, and no child left behind."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from pulsectl import _prehash
from pulsectl.checkpoint import Checkpoint
from pulsectl.cli.app import app
from pulsectl.sources import FileSource, scan

_SCRIPT = Path(sys.executable).with_name("pulsectl")
PULSECTL = str(_SCRIPT) if _SCRIPT.exists() else shutil.which("pulsectl")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")


@pytest.mark.parametrize(
    ("argv", "files"),
    [
        (["diff", "a", "b"], ["a", "b"]),
        (["diff", "a", "b", "-o", "p.pulse"], ["a", "b"]),
        (["-q", "diff", "-o", "p", "-f", "a", "--level", "max", "b", "-v"], ["a", "b"]),
        (["diff", "--output=p", "-j", "2", "--fsync", "a", "b"], ["a", "b"]),
        (["diff", "-l", "5", "--", "-odd", "b"], ["-odd", "b"]),
        (["diff", "a"], ["a"]),
        (["diff", "a", "b", "--as", "bf16"], []),  # it diffs casts, not these files
        (["diff", "a", "b", "--help"], []),
        (["diff", "-qf", "a", "b"], []),  # short flags run together: not guessed
        (["diff", "a", "b", "--no-such-option"], []),
        (["hash", "a", "b", "c"], ["a", "b", "c"]),
        (["verify", "ckpt", "--patch", "p.pulse"], ["ckpt"]),
        (["verify", "-p", "p.pulse", "ckpt"], ["ckpt"]),
        (["apply", "base", "p.pulse", "-o", "out"], []),
        (["stats", "a", "b"], []),
        ([], []),
        (["--version"], []),
    ],
)
def test_the_files_a_command_will_hash_are_found_on_its_command_line(
    argv: list[str], files: list[str]
) -> None:
    assert _prehash.files_to_hash(argv) == files


def test_the_option_tables_match_the_cli() -> None:
    # files_to_hash skips option values by these tables: an option added to a command without
    # its row here would make it take a value for a file.
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for name, table in _prehash.COMMANDS.items():
        flags: set[str] = set()
        values: set[str] = set()
        for param in commands[name].params:
            if param.param_type_name == "option":
                names = {*param.opts, *param.secondary_opts}
                (flags if param.is_flag or param.count else values).update(names)
        assert table.flags == flags, name
        assert table.values == values, name


def _tensors(sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        f"t{i:03d}": torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
        for i, n in enumerate(sizes)
    }


def _scanned(path: Path) -> tuple[str, dict[str, str]]:
    """scan()'s fingerprints of the file, hashed by scan itself (any child set aside)."""
    child, _prehash._child = _prehash._child, None
    try:
        with FileSource(Checkpoint.open(path)) as source:
            ref, fps = scan(source, 0)
    finally:
        _prehash._child = child
    return ref.fingerprint, fps


def _hashed(path: Path) -> dict:
    line = _prehash._hash_file(str(path))
    assert line is not None and line.endswith(b"\n")
    return json.loads(line)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=12),
    piece=st.sampled_from([1, 2, 3]),
    maps=st.sampled_from([1, 2, 5]),
)
def test_the_child_hashes_as_scan_does(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], piece: int, maps: int
) -> None:
    # Small pieces and maps, so that tensors start and end inside them and span several.
    path = tmp_path_factory.mktemp("prehash") / "a.safetensors"
    save_file(_tensors(sizes, len(sizes)), str(path))
    granule = mmap.ALLOCATIONGRANULARITY
    old = (_prehash._PIECE, _prehash._MAP_BYTES)
    _prehash._PIECE, _prehash._MAP_BYTES = piece * 1000, maps * granule
    try:
        doc = _hashed(path)
    finally:
        _prehash._PIECE, _prehash._MAP_BYTES = old
    whole, fps = _scanned(path)
    assert doc["file"] == whole == xxhash.xxh3_128_hexdigest(path.read_bytes())
    header = Checkpoint.open(path).files[0].header
    assert header is not None
    assert doc["header"] == xxhash.xxh3_128_hexdigest(header.raw)
    by_range = {(s, n): fp for s, n, fp in doc["ranges"]}
    assert {t.name: by_range[(t.start, t.nbytes)] for t in header.tensors} == fps


def test_the_child_reports_nothing_for_a_file_it_cannot_tile(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_bytes(b"not a safetensors file at all\n" * 100)
    assert _prehash._hash_file(str(text)) is None
    gap = tmp_path / "gap.safetensors"
    header = json.dumps({"x": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}).encode()
    gap.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    assert _prehash._hash_file(str(gap)) is None


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch):
    """Run ``_prehash.start`` in this process for small files, and forget its child after."""
    monkeypatch.setattr(_prehash, "MIN_BYTES", 1)
    monkeypatch.delenv("PULSECTL_PREHASH", raising=False)
    yield _prehash.start
    _prehash.stop()
    _prehash._child = None


@needs_fork
def test_fingerprints_hashed_ahead_are_used_only_for_the_same_unchanged_file(
    tmp_path: Path, started
) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tensors([3000, 0, 70_000, 5], 1), str(a))
    save_file(_tensors([64, 64], 2), str(b))
    started(["diff", str(a), str(b), "-o", str(tmp_path / "p.pulse")])
    assert _prehash._child is not None
    for path in (a, b):
        whole, fps = _scanned(path)
        ckpt = Checkpoint.open(path)
        with open(path, "rb") as f:
            hashed = _prehash.lookup(f.fileno(), ckpt.files[0].header.raw)  # type: ignore[union-attr]
        assert hashed is not None
        assert hashed.file == whole
        assert sorted(hashed.ranges.values()) == sorted(fps.values())
    # Changed after the child hashed it (same size, new bytes): its fingerprints are not used.
    data = bytearray(a.read_bytes())
    data[-1] ^= 0xFF
    a.write_bytes(bytes(data))
    st_a = a.stat()
    os.utime(a, ns=(st_a.st_atime_ns, st_a.st_mtime_ns + 1_000_000))
    with open(a, "rb") as f:
        assert _prehash.lookup(f.fileno(), None) is None
    with FileSource(Checkpoint.open(a)) as source:  # the child still there: scan hashes a
        assert scan(source, 0)[0].fingerprint == xxhash.xxh3_128_hexdigest(a.read_bytes())
    # A file it was not asked to hash.
    c = tmp_path / "c.safetensors"
    shutil.copy(b, c)
    with open(c, "rb") as f:
        assert _prehash.lookup(f.fileno(), None) is None


@needs_fork
@pytest.mark.parametrize("change", ["none", "new", "old"])
def test_diff_with_a_child_writes_the_patch_it_writes_without(
    tmp_path: Path, started, change: str
) -> None:
    # diff takes OLD's and NEW's fingerprints from the child, or, for a file changed since the
    # child hashed it, hashes that file itself (NEW: a second pass once its blocks are done).
    from conftest import patch_bytes

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tensors([40_000, 0, 333, 90_000], 8), str(a))
    old = a.read_bytes()
    new = bytearray(old)
    data_start = 8 + int.from_bytes(old[:8], "little")
    new[data_start + 6 :: 98] = bytes(len(new[data_start + 6 :: 98]))  # header kept
    b.write_bytes(bytes(new))
    started(["diff", str(a), str(b)])
    with open(a, "rb") as f:
        assert _prehash.lookup(f.fileno(), None) is not None  # the child is done
    if change != "none":
        path = a if change == "old" else b
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
        st_p = path.stat()
        os.utime(path, ns=(st_p.st_atime_ns, st_p.st_mtime_ns + 1_000_000))
    with_child = patch_bytes(a, b, workers=2)
    child, _prehash._child = _prehash._child, None
    try:
        assert with_child == patch_bytes(a, b, workers=2)
    finally:
        _prehash._child = child


@needs_fork
def test_a_many_tensor_file_comes_back_whole_through_the_pipe(tmp_path: Path, started) -> None:
    # Its line (~60 bytes a tensor) is several times what a pipe holds at once.
    a = tmp_path / "many.safetensors"
    save_file(_tensors([7] * 6000, 9), str(a))
    started(["hash", str(a)])
    header = Checkpoint.open(a).files[0].header
    assert header is not None
    with open(a, "rb") as f:
        hashed = _prehash.lookup(f.fileno(), header.raw)
    assert hashed is not None
    assert len(hashed.ranges) == 6000
    assert _scanned(a) == (
        hashed.file,
        {t.name: hashed.ranges[(t.start, t.nbytes)] for t in header.tensors},
    )


@needs_fork
def test_a_different_header_gets_only_the_file_fingerprint(tmp_path: Path, started) -> None:
    a = tmp_path / "a.safetensors"
    save_file(_tensors([100, 200], 3), str(a))
    started(["hash", str(a)])
    with open(a, "rb") as f:
        assert _prehash.lookup(f.fileno(), b'{"other": "header"}') is None
        hashed = _prehash.lookup(f.fileno(), None)
    assert hashed is not None
    assert hashed.file == xxhash.xxh3_128_hexdigest(a.read_bytes())
    assert hashed.ranges == {}


@needs_fork
def test_new_is_hashed_ahead_only_while_the_childs_job_stays_short(
    tmp_path: Path, started, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past WAIT_BYTES diff hashes NEW alongside its encoding, as it does without a child.
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tensors([5000], 6), str(a))
    save_file(_tensors([5000], 7), str(b))
    monkeypatch.setattr(_prehash, "WAIT_BYTES", a.stat().st_size + b.stat().st_size - 1)
    started(["diff", str(a), str(b)])
    assert _prehash._child is not None
    assert _prehash._child.keys == {(a.stat().st_dev, a.stat().st_ino)}
    with open(b, "rb") as f:
        assert _prehash.lookup(f.fileno(), None) is None
    with open(a, "rb") as f:
        assert _prehash.lookup(f.fileno(), None) is not None


def test_lines_that_do_not_parse_are_ignored_and_a_line_may_come_in_pieces() -> None:
    proc = subprocess.Popen(["true"])  # a real child for the reaping
    rfd, wfd = os.pipe()
    child = _prehash._Child(proc.pid, rfd, {(1, 2), (3, 4), (5, 6)})
    good = {"identity": [1, 2, 10, 0, 0], "header": "h", "file": "f", "ranges": [[8, 2, "r"]]}
    line = json.dumps(good).encode() + b"\n"
    os.write(wfd, b"not json\n")
    os.write(wfd, json.dumps({**good, "identity": [3]}).encode() + b"\n")  # too short
    os.write(wfd, json.dumps({**good, "ranges": [[1, 2]]}).encode() + b"\n")  # no fingerprint
    os.write(wfd, line[:7])
    os.write(wfd, line[7:])
    os.close(wfd)
    hashed = child.wait_for((1, 2))
    assert hashed == _prehash.Hashed((1, 2, 10, 0, 0), "h", "f", {(8, 2): "r"})
    assert child.wait_for((3, 4)) is None and child.wait_for((5, 6)) is None
    assert child.ended  # the pipe's end was read and the child reaped
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)


def test_no_child_without_fork_or_when_turned_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = tmp_path / "a.safetensors"
    save_file(_tensors([100], 4), str(a))
    monkeypatch.setattr(_prehash, "MIN_BYTES", 1)
    monkeypatch.setenv("PULSECTL_PREHASH", "0")
    _prehash.start(["hash", str(a)])
    assert _prehash._child is None
    monkeypatch.delenv("PULSECTL_PREHASH")
    monkeypatch.delattr(os, "fork")
    _prehash.start(["hash", str(a)])
    assert _prehash._child is None


def test_a_bad_prehash_value_starts_no_child_and_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PULSECTL_PREHASH takes 1, 0 or nothing; the console script starts the child before the
    CLI can refuse another value (tests/test_cli.py), so here it only must not start one (any
    value but '0' used to) nor fail."""
    a = tmp_path / "a.safetensors"
    save_file(_tensors([100], 4), str(a))
    monkeypatch.setattr(_prehash, "MIN_BYTES", 1)
    for value, child in (("1", True), ("", True), ("yes", False), ("off", False), ("2", False)):
        monkeypatch.setenv("PULSECTL_PREHASH", value)
        try:
            _prehash.start(["hash", str(a)])
            assert (_prehash._child is not None) == child, value
        finally:
            _prehash.stop()
            _prehash._child = None


# The console script, on files big enough for a child (MIN_BYTES): mostly zeros, so they are
# quick to write and hash.
@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("big")
    n = _prehash.MIN_BYTES // 2 + 4096  # BF16 words: just over MIN_BYTES
    rng = np.random.default_rng(5)
    old = np.zeros(n, dtype=np.uint16)
    old[rng.integers(0, n, 50_000)] = rng.integers(1, 1 << 15, 50_000, dtype=np.uint16)
    new = old.copy()
    new[rng.integers(0, n, 20_000)] += 1
    paths = folder / "old.safetensors", folder / "new.safetensors"
    for path, words in zip(paths, (old, new), strict=True):
        norm = torch.from_numpy(rng.standard_normal(64).astype(np.float32))
        save_file({"w": torch.from_numpy(words.view(np.int16)), "norm": norm}, str(path))
    return paths


def _run(args: list[str], prehash: str, **kw) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PULSECTL_PREHASH": prehash}
    env.pop("PULSECTL_DEBUG", None)
    return subprocess.run(args, capture_output=True, env=env, timeout=120, **kw)


# Runs the console script's start-up and the CLI as entry.run does, counting the lookups that
# found fingerprints hashed ahead.
_COUNTING = """
import sys
from pulsectl import _prehash
_prehash.start(sys.argv[1:])
found = []
lookup = _prehash.lookup
def counting(*a, **k):
    hashed = lookup(*a, **k)
    found.append(hashed is not None)
    return hashed
_prehash.lookup = counting
from pulsectl.cli.app import main
code = main()
sys.stderr.write(f"prehash lookups found: {sum(found)} of {len(found)}\\n")
sys.exit(code)
"""


@needs_fork
@pytest.mark.skipif(PULSECTL is None, reason="pulsectl console script not installed")
def test_the_console_script_writes_the_same_patch_and_hashes_with_and_without_a_child(
    big: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = big
    assert PULSECTL is not None
    patches = {}
    for prehash in ("1", "0"):
        out = tmp_path / f"p{prehash}.pulse"
        assert _run([PULSECTL, "diff", str(old), str(new), "-o", str(out)], prehash).returncode == 0
        patches[prehash] = out.read_bytes()
        hashed = _run([PULSECTL, "hash", str(old), str(new)], prehash)
        assert hashed.returncode == 0
        assert hashed.stdout.decode().split() == [
            xxhash.xxh3_128_hexdigest(old.read_bytes()),
            str(old),
            xxhash.xxh3_128_hexdigest(new.read_bytes()),
            str(new),
        ]
    assert patches["1"] == patches["0"]
    rebuilt = tmp_path / "rebuilt.safetensors"
    patch = str(tmp_path / "p1.pulse")
    applied = _run([PULSECTL, "apply", str(old), patch, "-o", str(rebuilt)], "1")
    assert applied.returncode == 0, applied.stderr
    assert rebuilt.read_bytes() == new.read_bytes()
    # And the child's fingerprints were the ones used: base and target in diff, both in hash.
    for args, want in (
        (["diff", str(old), str(new), "-o", str(tmp_path / "c.pulse")], "2 of 2"),
        (["hash", str(old), str(new)], "2 of 2"),
    ):
        counted = _run([sys.executable, "-c", _COUNTING, *args], "1")
        assert counted.returncode == 0, counted.stderr
        assert f"prehash lookups found: {want}" in counted.stderr.decode()
    assert (tmp_path / "c.pulse").read_bytes() == patches["0"]


def _assert_session_ends(session: int) -> None:
    """Every process of the session (the command and any child of it) ends within 5 s."""
    deadline = time.monotonic() + 5
    while True:
        try:
            os.killpg(session, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "a process of the command is still running"
        time.sleep(0.05)


@needs_fork
@pytest.mark.skipif(PULSECTL is None, reason="pulsectl console script not installed")
def test_the_child_holds_no_pipe_open_and_is_gone_when_the_command_ends(
    big: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = big
    assert PULSECTL is not None
    # A patch on stdout, through a pipe: apply sees the end of it when diff is done.
    piped = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{PULSECTL}" diff {old} {new} | '
         f'"{PULSECTL}" apply {old} - -o {tmp_path / "out.safetensors"}'],
        capture_output=True,
        timeout=120,
    )  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    assert (tmp_path / "out.safetensors").read_bytes() == new.read_bytes()
    # A command that fails before it looks at the fingerprints: its child goes with it.
    for args in (
        [PULSECTL, "diff", str(old), str(tmp_path / "missing.safetensors"), "-o", "x.pulse"],
        [PULSECTL, "diff", str(old), str(new), "-o", str(tmp_path / "out.safetensors")],
    ):
        proc = subprocess.Popen(args, start_new_session=True, stderr=subprocess.PIPE)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert err.decode().count("pulsectl: error:") == 1
        _assert_session_ends(proc.pid)


@needs_fork
@pytest.mark.skipif(PULSECTL is None, reason="pulsectl console script not installed")
def test_an_interrupted_diff_ends_promptly_with_its_child(
    big: tuple[Path, Path], tmp_path: Path
) -> None:
    old, new = big
    assert PULSECTL is not None
    proc = subprocess.Popen(
        [PULSECTL, "diff", str(old), str(new), "-o", str(tmp_path / "p.pulse")],
        start_new_session=True,
        stderr=subprocess.PIPE,
    )
    time.sleep(0.15)  # loading the CLI while its child hashes
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130), err  # 0 if it finished first
    _assert_session_ends(proc.pid)
    assert not list(tmp_path.glob(".*.pulsectl-tmp-*"))


def _sparse_checkpoint(path: Path, nbytes: int) -> None:
    """A one-tensor U8 safetensors file of ``nbytes`` data bytes, sparse: made at once."""
    header = json.dumps({"a": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + nbytes)


def _children(pid: int) -> list[str]:
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[1] == str(pid):
            found.append(stat_file.parent.name)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_the_child_ends_with_its_parent_even_by_sigkill(tmp_path: Path) -> None:
    """A kill -9 (the OOM killer) runs no clean-up: the child used to go on reading the whole
    input for nobody, adopted by init (seen 4 s later on a 16 GiB file)."""
    path = tmp_path / "big.safetensors"
    _sparse_checkpoint(path, 16 << 30)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pulsectl.cli.entry import run; run()", "hash",
         str(path)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        kids: list[str] = []
        while not kids and time.monotonic() < deadline:
            kids = _children(parent.pid)
            time.sleep(0.02)
        assert kids, "no hashing child was started"
        time.sleep(0.2)  # well into the file
    finally:
        parent.kill()
        parent.wait()
    time.sleep(0.5)
    for kid in kids:
        try:
            state = Path(f"/proc/{kid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
        except FileNotFoundError:
            continue  # gone and reaped
        if state != "Z":  # a zombie is dead (init reaps it when it can)
            os.kill(int(kid), signal.SIGKILL)
            pytest.fail(f"the child {kid} outlived its parent (state {state})")


def test_paths_under_dev_and_proc_are_left_to_the_command(tmp_path: Path) -> None:
    """/dev/stdin or /proc/self/fd/N name the parent's descriptors; the child puts /dev/null
    on its own 0-2 first, so it hashed /dev/null, and the command then hashed NEW again."""
    path = tmp_path / "big.safetensors"
    _sparse_checkpoint(path, 128 << 20)
    code = (
        "import sys; from pulsectl import _prehash; _prehash.start(sys.argv[1:]); "
        "print(_prehash._child is None)"
    )
    with open(path, "rb") as stdin:
        out = subprocess.run(
            [sys.executable, "-c", code, "hash", "/dev/stdin"], stdin=stdin, capture_output=True
        )
    assert out.stdout.decode().strip() == "True", out.stderr
    out = subprocess.run([sys.executable, "-c", code, "hash", str(path)], capture_output=True)
    assert out.stdout.decode().strip() == "False", out.stderr
