"""Run commands as child processes and record wall time and the child's own peak RSS.

Each command runs in a fresh grandchild: the harness forks a small launcher (a bare Python,
about 10 MB resident), which forks and execs the command, times it and reads its rusage with
``os.wait4``. A command forked straight from the harness would report the harness's own
resident set as its peak when that is larger: Linux keeps in ``ru_maxrss`` the peak of the
memory the child had before ``exec`` too, a copy of the parent's.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_WARM_CHUNK = 1 << 24


@dataclass(frozen=True)
class Run:
    wall_s: float
    max_rss_bytes: int
    returncode: int
    cpu_s: float = 0.0  # user + system time of the child


# Forks and execs argv[2:], then writes "wall maxrss_kib cpu_s exit_code" to fd argv[1].
_LAUNCHER = """
import os, sys, time
out, cmd = int(sys.argv[1]), sys.argv[2:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
code = os.waitstatus_to_exitcode(status)
os.write(out, f"{wall!r} {ru.ru_maxrss} {ru.ru_utime + ru.ru_stime!r} {code}".encode())
"""


def timed(cmd: list[str], stdout: Path | None = None, timeout: float | None = None) -> Run:
    """Wall time, CPU time and peak RSS of ``cmd``, run by a launcher (see the module doc)."""
    out_fd = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stdout else None
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe()
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(res_w), *cmd]
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: the launcher, in a process group of its own (killed whole on timeout)
        try:
            os.setpgid(0, 0)
            os.close(err_r)
            os.close(res_r)
            os.set_inheritable(res_w, True)
            os.dup2(out_fd if out_fd is not None else os.open(os.devnull, os.O_WRONLY), 1)
            os.dup2(err_w, 2)
            os.execv(launcher[0], launcher)
        finally:
            os._exit(127)
    os.close(err_w)
    os.close(res_w)
    if out_fd is not None:
        os.close(out_fd)
    err = b""
    deadline = None if timeout is None else t0 + timeout
    os.set_blocking(err_r, False)
    while True:
        try:
            chunk = os.read(err_r, 1 << 16)
            if chunk:
                err = (err + chunk)[-8192:]
        except BlockingIOError:
            pass
        wpid, status, usage = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        if deadline is not None and time.perf_counter() > deadline:
            os.killpg(pid, 9)
            os.wait4(pid, 0)
            os.close(err_r)
            os.close(res_r)
            return Run(time.perf_counter() - t0, 0, -9, 0.0)
        time.sleep(0.002)
    os.close(err_r)
    with os.fdopen(res_r, "rb") as f:
        result = f.read().split()
    if len(result) != 4:  # the launcher itself failed
        sys.stderr.write(f"launcher failed: {' '.join(cmd)}\n{err.decode(errors='replace')}\n")
        return Run(time.perf_counter() - t0, 0, os.waitstatus_to_exitcode(status) or 1, 0.0)
    wall, max_rss_kib, cpu, code = (
        float(result[0]),
        int(result[1]),
        float(result[2]),
        int(result[3]),
    )
    if code != 0:
        sys.stderr.write(
            f"command failed ({code}): {' '.join(cmd)}\n{err.decode(errors='replace')}\n"
        )
    return Run(wall, max_rss_kib * 1024, code, cpu)


def best_of(
    n: int,
    cmd: list[str],
    stdout: Path | None = None,
    timeout: float | None = None,
    repeat_below_s: float = 60.0,
    before: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run up to ``n`` times (once more only while runs take < ``repeat_below_s``); report the
    fastest wall time, the least CPU time, the largest RSS and every wall time. ``before``
    runs ahead of each run, untimed (e.g. removing the previous run's output)."""

    def run() -> Any:
        if before is not None:
            before()
        return timed(cmd, stdout, timeout)

    runs = [run()]
    while len(runs) < n and runs[-1].returncode == 0 and runs[-1].wall_s < repeat_below_s:
        runs.append(run())
    return _summary(runs)


def _summary(runs: list[Run]) -> dict[str, Any]:
    """The fastest wall time, the least CPU time, the largest RSS and every wall time."""
    return {
        "wall_s": min(r.wall_s for r in runs),
        "walls_s": [round(r.wall_s, 4) for r in runs],
        "cpu_s": min(r.cpu_s for r in runs),
        "max_rss_bytes": max(r.max_rss_bytes for r in runs),
        "returncode": max((r.returncode for r in runs), key=abs),
        "timed_out": any(r.returncode == -9 for r in runs),
    }


def in_turn(
    n: int,
    commands: dict[str, tuple[list[str], Callable[[], None] | None]],
    timeout: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every command once per round, in turn, for ``n`` rounds; for each, the summary
    ``best_of`` gives. Commands whose ratio is reported (diff and the compare pass, apply and
    cp) are timed in the same rounds, so a machine that drifts moves them alike. ``before``
    (the second item) runs ahead of each run, untimed (warming inputs, removing outputs)."""
    runs: dict[str, list[Any]] = {name: [] for name in commands}
    for _ in range(n):
        for name, (cmd, before) in commands.items():
            if before is not None:
                before()
            runs[name].append(timed(cmd, None, timeout))
    return {name: _summary(got) for name, got in runs.items()}


def byte_compile_pulsectl() -> bool:
    """Write pulsectl's .pyc files, as ``pip install`` does for a regular install.

    Returns whether PYTHONDONTWRITEBYTECODE is set here: Python then reads existing .pyc files
    but writes none, so an editable checkout would compile every module again in every timed
    command (measured: ~0.07-0.1 s per command on this machine), a cost installed tools and
    the reference commands (numpy's modules are compiled at install) do not pay.
    """
    import compileall

    import pulsectl

    compileall.compile_dir(str(Path(pulsectl.__file__).parent), quiet=1)
    return bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))


def warm(*paths: Path) -> None:
    """Read files once so every measured command finds them in the page cache."""
    buf = bytearray(_WARM_CHUNK)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def which(name: str) -> str | None:
    return shutil.which(name)


COMPARE_SCRIPT = r"""
import sys
import numpy as np
old, new, start, end = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
a = np.memmap(old, dtype=np.uint8, mode="r")
b = np.memmap(new, dtype=np.uint8, mode="r")
step = 1 << 24  # bytes per chunk, a multiple of 2
n = 0
for i in range(start, end, step):
    j = min(end, i + step)
    n += int(np.count_nonzero(a[i:j].view(np.uint16) != b[i:j].view(np.uint16)))
print(n)
"""


def compare_cmd(old: Path, new: Path, start: int, end: int) -> list[str]:
    """A bare compare pass: count differing BF16 words over the data region."""
    return [sys.executable, "-c", COMPARE_SCRIPT, str(old), str(new), str(start), str(end)]


HASH_SCRIPT = """
import sys
import mmap
import xxhash
for path in sys.argv[1:]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        h = xxhash.xxh3_128()
        step = 1 << 24
        for i in range(0, len(view), step):
            h.update(view[i : i + step])
        view.release()
        print(h.hexdigest())
"""


def hash_cmd(*paths: Path) -> list[str]:
    """Each file's xxh3-128 (pulsectl's fingerprint), read where it lies in the page cache:
    the hashing that every patch's fingerprints require of `diff`, and of `apply` to check."""
    return [sys.executable, "-c", HASH_SCRIPT, *map(str, paths)]
