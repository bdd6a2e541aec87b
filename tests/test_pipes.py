"""The installed console script in real pipes: stdin/stdout patches, exit codes, broken pipes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import TEMP_GLOB
from safetensors.torch import save_file

from pulsectl.synth import generate_chain

_SCRIPT = Path(sys.executable).with_name("pulsectl")
PULSECTL = str(_SCRIPT) if _SCRIPT.exists() else shutil.which("pulsectl")
pytestmark = pytest.mark.skipif(PULSECTL is None, reason="pulsectl console script not installed")


def sh(script: str, cwd: Path, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    """Run a bash pipeline with ``pulsectl`` resolving to the installed script."""
    env = {**os.environ, "PATH": f"{Path(PULSECTL).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PULSECTL_DEBUG", None)
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {script}"],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        env=env,
        timeout=60,
    )


def one_error_line(stderr: bytes) -> str:
    text = stderr.decode()
    assert "Traceback" not in text and "Exception ignored" not in text, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pulsectl: error: "), text
    return lines[0]


@pytest.fixture
def ab(chain: list[Path], tmp_path: Path) -> Path:
    """A folder with a.safetensors (step 0) and b.safetensors (step 2)."""
    shutil.copy(chain[0], tmp_path / "a.safetensors")
    shutil.copy(chain[2], tmp_path / "b.safetensors")
    return tmp_path


def test_diff_pipe_apply(ab: Path) -> None:
    r = sh(
        "pulsectl diff a.safetensors b.safetensors"
        " | pulsectl apply a.safetensors - -o c.safetensors && cmp c.safetensors b.safetensors",
        ab,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == b""
    assert b"verified" in r.stderr
    assert not list(ab.glob(TEMP_GLOB))


def test_a_failed_diff_upstream_leaves_apply_an_empty_pipe_and_apply_says_so(ab: Path) -> None:
    """diff fails (its NEW is missing) and writes nothing; apply at the other end of the pipe
    says that no patch arrived, not that a patch is damaged, and writes nothing."""
    r = sh("pulsectl diff a.safetensors gone.safetensors | pulsectl apply a.safetensors - -o c", ab)
    assert r.returncode == 3, r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert "gone.safetensors" in lines[0]
    assert lines[1] == (
        "pulsectl: error: <stdin>: empty: no patch bytes arrived (did the command that writes "
        "it fail?)"
    )
    assert not (ab / "c").exists()


def test_redirect_and_dash_o_give_the_same_patch(ab: Path) -> None:
    r = sh(
        "pulsectl diff a.safetensors b.safetensors > p1 && "
        "pulsectl diff -o - a.safetensors b.safetensors > p2 && "
        "pulsectl -q diff a.safetensors b.safetensors -o p3 && cmp p1 p2 && cmp p1 p3",
        ab,
    )
    assert r.returncode == 0, r.stderr
    r = sh(
        "pulsectl apply a.safetensors p1 -o c.safetensors && cmp c.safetensors b.safetensors", ab
    )
    assert r.returncode == 0, r.stderr


def test_chain_with_stdin_patch(chain: list[Path], tmp_path: Path) -> None:
    for i in range(3):
        shutil.copy(chain[i], tmp_path / f"s{i}.safetensors")
    r = sh(
        "pulsectl diff s0.safetensors s1.safetensors -o p1 && "
        "pulsectl diff s1.safetensors s2.safetensors -o p2 && "
        "cat p2 | pulsectl apply s0.safetensors p1 - -o out && cmp out s2.safetensors",
        tmp_path,
    )
    assert r.returncode == 0, r.stderr


def test_hash_single_file(ab: Path) -> None:
    r = sh("pulsectl hash a.safetensors", ab)
    assert r.returncode == 0
    digest = xxhash.xxh3_128_hexdigest((ab / "a.safetensors").read_bytes())
    assert r.stdout.decode() == f"{digest}  a.safetensors\n"
    assert r.stderr == b""


def test_verify_exit_codes(ab: Path) -> None:
    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    r = sh("pulsectl verify b.safetensors --patch p", ab)
    assert r.returncode == 0 and r.stdout == b""
    r = sh("pulsectl verify a.safetensors --patch p", ab)
    assert r.returncode == 3
    assert "a.safetensors" in one_error_line(r.stderr)
    digest = xxhash.xxh3_128_hexdigest((ab / "b.safetensors").read_bytes())
    assert sh(f"pulsectl verify b.safetensors --hash {digest}", ab).returncode == 0
    assert sh(f"pulsectl verify a.safetensors --hash {digest}", ab).returncode == 3


def test_inspect_json_from_stdin(ab: Path) -> None:
    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    from_file = sh("pulsectl inspect p --json", ab)
    from_pipe = sh("cat p | pulsectl inspect - --json", ab)
    assert from_file.returncode == 0 and from_pipe.returncode == 0, from_pipe.stderr
    a, b = json.loads(from_file.stdout), json.loads(from_pipe.stdout)
    assert b["checked"] is True and a["checked"] is False
    assert b["patch_bytes"] == a["patch_bytes"] == (ab / "p").stat().st_size
    assert b["patch"] == "<stdin>"
    for key in ("base", "target", "changed_words", "total_words", "tensors", "block_bytes"):
        assert a[key] == b[key], key


def test_damaged_patch_on_stdin(ab: Path) -> None:
    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    data = bytearray((ab / "p").read_bytes())
    data[len(data) // 2] ^= 0x40
    r = sh("pulsectl apply a.safetensors - -o c", ab, stdin=bytes(data))
    assert r.returncode == 3
    assert "<stdin>" in one_error_line(r.stderr)
    r = sh("pulsectl apply a.safetensors - -o c", ab, stdin=bytes(data[:1000]))
    assert r.returncode == 3
    assert "ends early" in one_error_line(r.stderr)
    assert sorted(p.name for p in ab.iterdir()) == ["a.safetensors", "b.safetensors", "p"]


def test_broken_pipe(tmp_path: Path) -> None:
    """A patch far larger than a pipe buffer, cut off by `head`: one line, non-zero exit."""
    gen = torch.Generator().manual_seed(1)
    save_file({"w": torch.zeros(16)}, tmp_path / "a.safetensors")
    noise = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int32)
    save_file({"w": torch.zeros(16), "noise": noise}, tmp_path / "b.safetensors")
    r = sh(
        "pulsectl diff a.safetensors b.safetensors | head -c 100 > /dev/null; "
        "echo ${PIPESTATUS[0]} >&2",
        tmp_path,
    )
    *messages, status = r.stderr.decode().strip().splitlines()
    assert int(status) != 0
    msg = one_error_line("\n".join(messages).encode())
    assert "pipe" in msg


def test_refuses_to_overwrite_without_force(ab: Path) -> None:
    (ab / "p").write_bytes(b"old")
    r = sh("pulsectl diff a.safetensors b.safetensors -o p", ab)
    assert r.returncode == 1
    assert "-f" in one_error_line(r.stderr)
    assert (ab / "p").read_bytes() == b"old"
    assert sh("pulsectl diff a.safetensors b.safetensors -o p -f", ab).returncode == 0
    assert (ab / "p").read_bytes() != b"old"
    (ab / "c").write_bytes(b"old")
    r = sh("pulsectl apply a.safetensors p -o c", ab)
    assert r.returncode == 1 and (ab / "c").read_bytes() == b"old"
    one_error_line(r.stderr)
    assert (
        sh("pulsectl apply a.safetensors p -o c --force && cmp c b.safetensors", ab).returncode == 0
    )
    assert not list(ab.glob(TEMP_GLOB))


def test_apply_in_place(ab: Path) -> None:
    r = sh(
        "pulsectl diff a.safetensors b.safetensors -o p"
        " && pulsectl apply --in-place a.safetensors p && cmp a.safetensors b.safetensors",
        ab,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in ab.iterdir()) == ["a.safetensors", "b.safetensors", "p"]


def test_usage_error_exit_2(ab: Path) -> None:
    r = sh("pulsectl apply a.safetensors", ab)
    assert r.returncode == 2
    assert b"Traceback" not in r.stderr and r.stdout == b""
    r = sh("pulsectl --help", ab)
    assert r.returncode == 0 and b"Exit codes" in r.stdout


@pytest.mark.parametrize("redirect", [">&-", ">/dev/full"], ids=["closed", "full"])
def test_stdout_closed_or_full_is_one_line(ab: Path, redirect: str) -> None:
    """stdout closed (`>&-`: Python leaves sys.stdout None) or on a full disk: one line, exit
    1, nothing left behind; these used to end in an AttributeError or OSError traceback and
    'internal error'. --help goes through click, which probes stdout with a write of its own."""
    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    before = sorted(p.name for p in ab.iterdir())
    commands = [
        "diff a.safetensors b.safetensors",
        "diff a.safetensors b.safetensors -o -",
        "hash a.safetensors",
        "inspect p",
        "stats p --json",
        "stats p",
        "--version",
        "--help",
        "diff --help",
    ]
    for command in commands:
        r = sh(f"pulsectl {command} {redirect}", ab)
        assert r.returncode == 1, (command, r.stderr)
        line = one_error_line(r.stderr)
        if redirect == ">&-":
            assert line.startswith("pulsectl: error: standard output is closed; "), line
        else:
            assert line.startswith("pulsectl: error: standard output: no space left"), line
        assert sorted(p.name for p in ab.iterdir()) == before, command
    # A command that writes nothing on stdout runs as usual with stdout closed.
    r = sh(
        "pulsectl diff a.safetensors b.safetensors -o q >&- && pulsectl verify b.safetensors"
        " --patch q >&-",
        ab,
    )
    assert r.returncode == 0, r.stderr
    assert (ab / "q").read_bytes() == (ab / "p").read_bytes()


@pytest.mark.parametrize("redirect", [">&-", ">/dev/full"], ids=["closed", "full"])
def test_stdout_that_fails_after_the_work_is_done_is_a_warning(ab: Path, redirect: str) -> None:
    """publish, pull and loco's --json report on stdout what they have already done. When
    stdout fails then, the step is published, the files are written: exit 1 would have a
    caller that retries publish the step again (or feed a LoCo residual back twice), so the
    failure is a warning that says what was done, shown under -q too, and the exit is 0."""

    def warned(r: subprocess.CompletedProcess[bytes], done: str) -> None:
        assert r.returncode == 0, r.stderr
        text = r.stderr.decode()
        assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
        assert text.startswith("pulsectl: warning: standard output"), text
        assert text.strip().endswith(f"{done} all the same"), text

    warned(
        sh(f"pulsectl -q publish store a.safetensors {redirect}", ab),
        "step 0 was published to store",
    )
    assert sh("pulsectl -q publish store b.safetensors", ab).returncode == 0
    steps = json.loads(sh("pulsectl log store --json", ab).stdout)["steps"]
    assert [s["step"] for s in steps] == [0, 1]  # published once each
    warned(
        sh(f"pulsectl -q pull store -o pulled.safetensors {redirect}", ab),
        "pulled.safetensors was written",
    )
    assert (ab / "pulled.safetensors").read_bytes() == (ab / "b.safetensors").read_bytes()
    r = sh(f"pulsectl log store --json {redirect}", ab)  # it reports, having done nothing
    assert r.returncode == 1
    # prune lists the keys it deleted: they are gone, so the same warning, once, and exit 0
    # (it was exit 1, "standard output is closed", with the steps deleted all the same); a dry
    # run deleted nothing: its list is its result, and failing to write it is an error.
    assert sh("pulsectl -q publish store a.safetensors --anchor", ab).returncode == 0
    r = sh(f"pulsectl -q prune store --keep-anchors 1 --keep-steps 1 -n {redirect}", ab)
    assert r.returncode == 1
    warned(
        sh(f"pulsectl -q prune store --keep-anchors 1 --keep-steps 1 {redirect}", ab),
        "store was pruned",
    )
    steps = json.loads(sh("pulsectl log store --json", ab).stdout)["steps"]
    assert [s["step"] for s in steps] == [2]


def test_closed_stderr_or_stdin_takes_no_output_with_it(ab: Path) -> None:
    """Started with stderr (or stdin) closed, a command runs as usual and its failures keep
    their exit codes. A closed descriptor 0-2 is the next one handed out: without care the
    hash child's pipe or an output's temp file would get it, and messages meant for stderr
    would be written into it (or fail with an AttributeError on the None sys.stderr)."""
    r = sh("pulsectl diff a.safetensors b.safetensors -o p 2>&- <&-", ab)
    assert r.returncode == 0 and r.stderr == b""
    assert sh("pulsectl diff a.safetensors b.safetensors -o q", ab).returncode == 0
    assert (ab / "p").read_bytes() == (ab / "q").read_bytes()
    r = sh("pulsectl apply a.safetensors p -o out.safetensors 2>&-", ab)
    assert r.returncode == 0
    assert (ab / "out.safetensors").read_bytes() == (ab / "b.safetensors").read_bytes()
    before = sorted(p.name for p in ab.iterdir())
    r = sh("pulsectl apply b.safetensors p -o wrong.safetensors 2>&-", ab)  # wrong base
    assert (r.returncode, r.stderr) == (3, b"")
    r = sh("pulsectl diff a.safetensors missing.safetensors -o r 2>&-", ab)
    assert (r.returncode, r.stderr) == (1, b"")
    assert sorted(p.name for p in ab.iterdir()) == before


def _closed_pipe(script: str, cwd: Path) -> tuple[int, bytes]:
    """Run ``script`` in bash with stdout a pipe whose reader has already gone, so that the
    first write there fails, whatever the timing; the status bash reports and stderr."""
    env = {**os.environ, "PATH": f"{Path(PULSECTL).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PULSECTL_DEBUG", None)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run(
            ["bash", "-c", f"{script}; echo status $? >&2"],
            cwd=cwd,
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env,
            timeout=60,
        )
    finally:
        os.close(write_end)
    *err, status = r.stderr.decode().strip().splitlines() or ["status ?"]
    return int(status.removeprefix("status ")), "\n".join(err).encode()


@pytest.fixture
def many(tmp_path: Path) -> Path:
    """a.safetensors, b.safetensors with 3000 small tensors each, and their patch p: enough
    that `inspect --json` and `stats --json` print far more than a pipe buffer holds."""
    gen = torch.Generator().manual_seed(3)
    a = {f"t{i}": torch.randn(8, generator=gen).to(torch.bfloat16) for i in range(3000)}
    save_file(a, tmp_path / "a.safetensors")
    save_file({k: v * 1.5 for k, v in a.items()}, tmp_path / "b.safetensors")
    assert sh("pulsectl diff a.safetensors b.safetensors -o p", tmp_path).returncode == 0
    return tmp_path


def test_text_output_into_a_closed_pipe_ends_quietly_by_sigpipe(many: Path) -> None:
    """`pulsectl inspect P | head -3`: the reader took what it wanted. As git and coreutils
    do, no message, and the process dies of SIGPIPE, so the shell (and `set -o pipefail`)
    sees 141. This used to print 'output pipe closed before the output was complete', exit 1."""
    store = many / "store"
    assert sh(f"pulsectl -q publish {store} a.safetensors", many).returncode == 0
    commands = [
        "inspect p",
        "inspect p --json",
        "stats p",
        "stats p --json",
        "stats a.safetensors b.safetensors",
        "hash a.safetensors b.safetensors",
        f"log {store}",
        f"log {store} --json",
        "--version",
        "--help",
        "diff --help",
    ]
    for command in commands:
        status, err = _closed_pipe(f"pulsectl {command}", many)
        assert (status, err) == (141, b""), (command, err)
    # A reader that goes away midway: `head` took 3 of 2000 lines (far more than a pipe holds).
    save_file({"w": torch.zeros(4)}, many / "t.safetensors")
    r = sh("pulsectl hash $(printf 't.safetensors %.0s' $(seq 2000)) | head -3", many)
    assert (r.returncode, r.stderr, len(r.stdout.splitlines())) == (141, b"", 3), r.stderr
    # Python's subprocess sees the signal itself, as with git.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([PULSECTL, "inspect", "p"], cwd=many, stdout=write_end, stderr=-1)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (-13, b"")


def test_binary_output_into_a_closed_pipe_is_still_an_error(many: Path) -> None:
    """A patch cut short is not what the reader wanted: one line, exit 1, as before."""
    assert sh("pulsectl diff b.safetensors a.safetensors -o q", many).returncode == 0
    for command in (
        "diff a.safetensors b.safetensors",
        "diff a.safetensors b.safetensors -o -",
        "squash p q -o -",
    ):
        status, err = _closed_pipe(f"pulsectl {command}", many)
        assert status == 1, (command, err)
        assert one_error_line(err) == (
            "pulsectl: error: output pipe closed before the patch was complete"
        )
    assert sorted(p.name for p in many.iterdir() if p.is_file()) == [
        "a.safetensors",
        "b.safetensors",
        "p",
        "q",
    ]


def test_an_interrupt_while_a_patch_is_arriving_on_stdin_is_exit_130(tmp_path: Path) -> None:
    """Part of a patch has come through the pipe, the rest is late (a slow link), and the user
    presses Ctrl-C: the reader thread is then inside a read of standard input. The interpreter
    must still end with 130 and one line (it aborted with a 'Fatal Python error' and 134 when
    that read held the lock of sys.stdin.buffer at exit, most times)."""
    ab = tmp_path
    chain = generate_chain(ab / "c", "small", steps=1, lr=1e-5, seed=4)
    shutil.copy(chain[0], ab / "a.safetensors")
    r = sh(f"pulsectl diff a.safetensors {chain[1]} -o p.pulse -q", ab)
    assert r.returncode == 0, r.stderr
    part = 50_000  # past the header: the rest is read on the reader thread
    assert (ab / "p.pulse").stat().st_size > 2 * part
    for _ in range(3):
        # stderr to a file: the abort showed then, not into a pipe (timing).
        r = sh(
            f"(head -c {part} p.pulse; sleep 2.5) | timeout --preserve-status -s INT 1.5 "
            "pulsectl apply a.safetensors - -o c.safetensors 2>err.txt",
            ab,
        )
        err = (ab / "err.txt").read_bytes()
        assert r.returncode == 130, err
        assert one_error_line(err) == "pulsectl: error: interrupted; no output was written"
        assert not (ab / "c.safetensors").exists() and not list(ab.glob(TEMP_GLOB))


def test_squash_to_a_pipe_writes_nothing_when_it_refuses(ab: Path) -> None:
    """A --level max patch needs the base to be squashed; the refusal comes while composing,
    and part of a patch went down the pipe before it (an `aws s3 cp -` would store it)."""
    r = sh(
        "pulsectl diff a.safetensors b.safetensors --level max -o m.pulse -q && "
        "pulsectl squash m.pulse -o - > out.pulse",
        ab,
    )
    assert r.returncode == 2, r.stderr
    assert "need the base to decode; squash with --base CKPT" in one_error_line(r.stderr)
    assert (ab / "out.pulse").read_bytes() == b""
    r = sh(
        "pulsectl squash m.pulse --base a.safetensors -o - | "
        "pulsectl apply a.safetensors - -o c.safetensors && cmp c.safetensors b.safetensors",
        ab,
    )
    assert r.returncode == 0, r.stderr


def test_standard_output_that_is_an_input_is_refused(ab: Path) -> None:
    """`diff A B > B` (or `1<>B`, `>> B`) wrote the patch over NEW while reading it and said
    it succeeded; as `cat f >> f`, it is refused (exit 2), and B is left whole."""
    before = (ab / "b.safetensors").read_bytes()
    for redirect in ("1<>b.safetensors", ">> b.safetensors"):
        r = sh(f"pulsectl diff a.safetensors b.safetensors {redirect}", ab)
        assert r.returncode == 2, r.stderr
        assert one_error_line(r.stderr) == (
            "pulsectl: error: standard output is b.safetensors, an input of this command; "
            "write the patch elsewhere"
        )
        assert (ab / "b.safetensors").read_bytes() == before
    r = sh("pulsectl diff a.safetensors b.safetensors > p.pulse && "
           "pulsectl squash p.pulse -o - >> p.pulse", ab)  # fmt: skip
    assert r.returncode == 2 and "standard output is p.pulse" in r.stderr.decode()
    # `> B`: the shell empties B before pulsectl starts; the error says so (found in review:
    # "nothing written" read as if B were safe).
    r = sh("pulsectl diff a.safetensors b.safetensors > b.safetensors", ab)
    assert r.returncode == 2, r.stderr
    assert one_error_line(r.stderr) == (
        "pulsectl: error: standard output is b.safetensors, an input of this command (it is "
        "empty now: the shell's '>' emptied it first); write the patch elsewhere"
    )
    # Into a folder checkpoint that NEW (or OLD) is: the shell has made the file there, which
    # the folder now holds (its fingerprint changed); the error says to remove it.
    folder = ab / "fb"
    folder.mkdir()
    shutil.copy(ab / "b.safetensors", folder / "model.safetensors")
    r = sh("pulsectl diff a.safetensors fb > fb/p.pulse", ab)
    assert r.returncode == 2, r.stderr
    assert one_error_line(r.stderr) == (
        f"pulsectl: error: standard output is {folder / 'p.pulse'}, inside fb, a folder "
        "checkpoint this command reads; the shell's '>' has already made that file there, empty "
        "(a new file the folder now holds, or one of its own, emptied); write the patch outside "
        "the folder"
    )


@pytest.mark.parametrize(
    "env",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "PYTHONUTF8": "0"}],
    ids=["ascii", "C-no-utf8-mode"],
)
def test_stdout_without_utf8_gets_tables_and_names_it_can_take(ab: Path, env: dict) -> None:
    """A stdout whose encoding is not UTF-8: stats printed part of its tables, then a
    traceback and 'internal error' (the bars' block characters); hash of a file whose name is
    not UTF-8 did the same. The bars are drawn with '#', and a name's bytes go out as they
    are, as sha256sum writes them."""
    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    shutil.copy(ab / "a.safetensors", os.fsdecode(bytes(ab) + b"/bad\xff.safetensors"))
    full = {**os.environ, **env, "PATH": f"{Path(PULSECTL).parent}{os.pathsep}{os.environ['PATH']}"}
    for args in (["stats", "a.safetensors", "b.safetensors"], ["stats", "p"]):
        r = subprocess.run(["pulsectl", *args], cwd=ab, capture_output=True, env=full, timeout=60)
        assert r.returncode == 0 and r.stderr == b"", r.stderr
        assert b"| ####" in r.stdout and r.stdout.isascii()
    r = subprocess.run(
        ["pulsectl", "hash", os.fsdecode(b"bad\xff.safetensors")],
        cwd=ab,
        capture_output=True,
        env=full,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    digest = xxhash.xxh3_128((ab / "a.safetensors").read_bytes()).hexdigest()
    assert r.stdout == digest.encode() + b"  bad\xff.safetensors\n"
    # A name that is UTF-8 but not ASCII: its bytes, not a '\xe9' that (without hash's
    # leading backslash) names another file by sha256sum's rules.
    shutil.copy(ab / "a.safetensors", ab / "\u00e9.safetensors")
    r = subprocess.run(
        ["pulsectl", "hash", "\u00e9.safetensors"],
        cwd=ab,
        capture_output=True,
        env=full,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    if env.get("PYTHONIOENCODING") == "ascii":  # under LC_ALL=C the name came in as bytes
        assert r.stdout == digest.encode() + b"  \xc3\xa9.safetensors\n"
    # An encoding that takes no bytes from an error handler (UTF-16): escapes, not a traceback.
    r = subprocess.run(
        ["pulsectl", "hash", os.fsdecode(b"bad\xff.safetensors")],
        cwd=ab,
        capture_output=True,
        env={**full, "PYTHONIOENCODING": "utf-16"},
        timeout=60,
    )
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr


def test_a_patch_is_not_read_from_a_terminal(ab: Path) -> None:
    """`inspect -` (or apply, stats with '-') with stdin a terminal waited, silent, for
    typed bytes; as zstd does, it is refused (exit 2)."""
    import pty

    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    for args in (
        ["inspect", "-"],
        ["stats", "-"],
        ["apply", "a.safetensors", "p", "-", "-o", "c.safetensors"],
    ):
        leader, follower = pty.openpty()
        try:
            r = subprocess.run(
                [PULSECTL, *args], cwd=ab, stdin=follower, capture_output=True, timeout=30
            )
        finally:
            os.close(follower)
            os.close(leader)
        assert r.returncode == 2, (args, r.stderr)
        assert one_error_line(r.stderr) == (
            "pulsectl: error: refusing to read a binary patch from a terminal; pipe one in "
            "(... | pulsectl ... -) or give its path"
        )
    assert not (ab / "c.safetensors").exists()


def test_dash_for_a_checkpoint_or_a_plot_says_what_dash_is_not(ab: Path) -> None:
    """'-' means stdin for patches only: given for a checkpoint it said "-: no such file or
    directory"; `stats --plot -` named an option not given ('-o -')."""
    for script in ("pulsectl hash -", "pulsectl diff - b.safetensors -o p"):
        r = sh(f"{script} < a.safetensors", ab)
        assert r.returncode == 1, r.stderr
        assert one_error_line(r.stderr) == (
            "pulsectl: error: -: no such file or directory; a checkpoint is read from its file "
            "or folder, not from standard input (only patches are)"
        )
    r = sh("pulsectl stats a.safetensors b.safetensors --plot -", ab)
    assert r.returncode == 2, r.stderr
    assert one_error_line(r.stderr).startswith(
        "pulsectl: error: --plot -: the plot is written as a PNG file, not to standard output"
    )


def test_a_terminal_for_a_later_patch_is_refused_before_any_work(
    ab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`apply BASE P1 -` from a terminal applied P1 in full, then refused '-'."""
    import io

    import pulsectl.apply as apply_module
    from pulsectl.errors import UsageError

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def no_work(*a: object, **kw: object) -> None:
        raise AssertionError("a patch was opened")

    assert sh("pulsectl diff a.safetensors b.safetensors -o p", ab).returncode == 0
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(apply_module, "open_patch", no_work)
    with pytest.raises(UsageError, match="refusing to read a binary patch from a terminal"):
        apply_module.apply_patches(ab / "a.safetensors", [ab / "p", "-"], ab / "c.safetensors")
    assert not (ab / "c.safetensors").exists()


def test_patches_on_named_pipes_fed_by_one_producer_in_turn(tmp_path: Path) -> None:
    """One producer writes the patches into named pipes one after the other (a single link):
    apply opened every patch before reading the first to its end, and both waited for ever
    once the first was larger than a pipe's buffer. A pipe is read when its turn comes."""
    import threading

    g = torch.Generator().manual_seed(5)
    steps = [torch.randn(256, 512, generator=g).bfloat16()]
    for _ in range(2):  # about half of the words move by up to 200 units in the last place
        w = steps[-1].view(torch.int16).clone()
        moved = torch.rand(w.shape, generator=g) < 0.5
        w[moved] += torch.randint(1, 200, (int(moved.sum()),), generator=g, dtype=torch.int16)
        steps.append(w.view(torch.bfloat16))
    for i, t in enumerate(steps):
        save_file({"w": t}, str(tmp_path / f"s{i}.safetensors"))
    for i in (1, 2):
        r = sh(f"pulsectl diff s{i - 1}.safetensors s{i}.safetensors -o p{i}.pulse", tmp_path)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "p1.pulse").stat().st_size > 1 << 16  # more than a pipe holds
    fifos = [tmp_path / "f1", tmp_path / "f2"]
    for f in fifos:
        os.mkfifo(f)

    def produce() -> None:
        for i, fifo in enumerate(fifos, 1):
            with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as out:
                out.write((tmp_path / f"p{i}.pulse").read_bytes())

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    r = sh("pulsectl -q apply s0.safetensors f1 f2 -o out.safetensors", tmp_path)
    producer.join(10)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "s2.safetensors").read_bytes()
