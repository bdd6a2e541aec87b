"""The console script: a tiny module, so that an interrupt while the CLI loads exits like one
that arrives later (one line, exit 130) instead of a traceback."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from collections.abc import Callable

EXIT_PIPE = 141  # pulsectl.errors.EXIT_PIPE, not imported here: this module loads first


# The signals that interrupted this run. Python can swallow the KeyboardInterrupt a handler
# raises (raised inside a weakref callback, as importlib's module locks have, it is only
# printed as "Exception ignored"), and the command would then go on as if never interrupted;
# this list still tells.
_signalled: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    _signalled.append(signum)
    raise KeyboardInterrupt


def _note_signal(signum: int, frame: object) -> None:
    """Once the command is over: a signal changes nothing left to do, so it is only noted (a
    KeyboardInterrupt then would end the exit itself with a traceback)."""
    _signalled.append(signum)


def _keep_freed_memory() -> None:
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the system.

    Decoding and encoding allocate numpy temporaries of a few to tens of MiB per block; by
    default glibc maps and unmaps each, so every block pays its page faults again. Measured on
    the 988 MB lr1e-5 k16 pair: system time of `apply` 2.1-2.3 s -> 1.0-1.35 s, wall 0.4-0.6 s
    less, peak RSS the same. Only the command-line tool does this (it owns its process); a
    no-op where there is no glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    mallopt(m_mmap_threshold, 32 * 1024 * 1024)  # glibc's largest; blocks are 8 MiB
    mallopt(m_trim_threshold, 1024 * 1024 * 1024)
    mallopt(m_top_pad, 64 * 1024 * 1024)


def _quiet_blas() -> None:
    """One OpenBLAS thread, unless the user chose otherwise.

    pulsectl does no linear algebra, but numpy's OpenBLAS starts a thread per core when numpy
    is imported, and those threads spin while they wait: measured with perf on a 2-core
    machine, 6-8% of the CPU time of `diff` and `apply` of a 1 GB checkpoint.
    """
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one (at most 2**20), as Go programs do.

    A checkpoint folder's shards are all held open while a command runs (a diff: both
    checkpoints'): a model of 1,000 shards passed the common soft limit of 1,024, while the
    hard limit is far higher. A no-op where there is no such limit.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def _hold_standard_fds() -> None:
    """Put /dev/null on stdin, stdout or stderr where the process was started without it
    (`2>&-`), before anything is opened.

    A closed descriptor 0-2 is the next one the system hands out: the hash child's pipe, or an
    output's temp file, would get it, and a write meant for stderr (a message, a traceback)
    would land in that file. Python has already made ``sys.stdout`` (or ``sys.stderr``) None
    for such a descriptor, so a command that must write to stdout still says it is closed;
    ``sys.stderr`` gets the null device, so messages go nowhere instead of failing, and
    ``sys.stdin`` too, so that a patch read from '-' is an empty one.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:  # the lowest free number: fd itself, unless one below it was free
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if sys.stdin is None:  # '-' then reads nothing: "empty: no patch bytes arrived"
        sys.stdin = open(os.devnull)  # noqa: SIM115


def run() -> None:
    try:
        _hold_standard_fds()
        signal.signal(signal.SIGTERM, _on_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored (`&`)
            signal.signal(signal.SIGINT, _on_signal)
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, _on_signal)  # a closed terminal: as SIGTERM (not nohup)
        _keep_freed_memory()
        _quiet_blas()
        _raise_open_files_limit()
        # Before the heavy imports: a child hashes the input files meanwhile (pulsectl._prehash).
        from pulsectl import _prehash

        _prehash.start(sys.argv[1:])
        from pulsectl.cli.app import main
    except KeyboardInterrupt:
        _signalled.append(0)
    if _signalled:  # also one that Python swallowed while the CLI loaded
        sys.stderr.write("pulsectl: error: interrupted; no output was written\n")
        sys.exit(130)
    # The modules just loaded live as long as the process: keep the cyclic garbage collector
    # from walking them again at each collection (perf: ~2% of a 1 GB diff).
    gc.freeze()
    try:
        code = main()
    except KeyboardInterrupt:
        # main() handles interrupts while its command runs: this one came as it returned, the
        # command's work done (its outputs in place, or its error reported).
        _signalled.append(0)
        code = 0
    for signum in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)):
        if signum is not None and signal.getsignal(signum) is _on_signal:
            signal.signal(signum, _note_signal)
    if code == 0 and _signalled:
        # The interrupt came, but whatever it hit swallowed it and the command ran to its end:
        # its output is complete, and the caller still learns that it asked for a stop.
        sys.stderr.write("pulsectl: error: interrupted after the command had finished\n")
        code = 130
    if code == EXIT_PIPE:
        _die_of_sigpipe(_prehash.stop)
    sys.exit(code)


def _die_of_sigpipe(before: Callable[[], None]) -> None:
    """End as git and coreutils do when the reader of their text output goes away (`| head`):
    killed by SIGPIPE, which Python ignores, so the shell reports 141 and a parent sees the
    signal. ``before`` runs first (what ``atexit`` would have run: the hashing child's end);
    everything else was cleaned up before ``main`` returned. Exit 141 where there is no
    SIGPIPE."""
    before()
    sigpipe = getattr(signal, "SIGPIPE", None)
    if sigpipe is not None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
            signal.signal(sigpipe, signal.SIG_DFL)
            os.kill(os.getpid(), sigpipe)
    sys.exit(EXIT_PIPE)
