"""Fingerprints hashed ahead: a child process hashes the command's input files while the
interpreter loads the CLI.

Loading numpy, typer and pulsectl takes ~0.15 s of one core, and hashing a 1 GB checkpoint
~0.08 s. ``start`` (called by the console script before it imports anything heavy) forks a
child that hashes the files a command is about to fingerprint, each whole and each tensor,
exactly as ``pulsectl.sources.scan`` does, and sends the fingerprints back through a pipe;
``lookup`` hands them to the command. A separate process, not a thread: the interpreter's
lock would make a hashing thread wait behind the imports.

A result is used only for the same file, unchanged: the child records the file's identity
(device, inode, size, modification and change times) before and after hashing and reports
nothing when they differ, and ``lookup`` compares them with the caller's open file and the
header bytes with the caller's. Anything unexpected (no ``fork``, an option this module does
not know, a file that is not safetensors, a child that fails) leaves the command to hash as it
would without this module. ``PULSECTL_PREHASH=0`` turns it off.

This module imports only the standard library, xxhash and pulsectl._env, so that starting the
child costs almost nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import mmap
import os
import signal
import stat
import struct
import threading
from dataclasses import dataclass

import xxhash

from pulsectl._env import switch

# Smaller files hash in a few milliseconds: not worth a process.
MIN_BYTES = 64 * 1024 * 1024
# At most ~0.3 s of hashing here (13 GB/s) for a child that takes a Command.waits file too.
WAIT_BYTES = 4 * 1024 * 1024 * 1024
# The child maps a file a piece at a time (so its memory stays small) and hashes each piece
# into the file's hasher and its tensor's in sub-pieces that stay in the CPU's cache.
_MAP_BYTES = 16 * 1024 * 1024
_PIECE = 1024 * 1024
_HEADER_LEN = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 * 1024 * 1024

_GLOBAL_FLAGS = frozenset({"-q", "--quiet", "-v", "--verbose"})
_STOP_FLAGS = frozenset({"-h", "--help", "--version"})


@dataclass(frozen=True)
class Command:
    """How to find a command's files on its command line: which positional arguments it
    fingerprints (None: all of them), and its options, as click parses them (a test checks
    these against the CLI)."""

    hashes: tuple[int, ...] | None
    flags: frozenset[str]
    values: frozenset[str]  # options followed by a value
    skip_with: frozenset[str] = frozenset()  # options under which it hashes other files
    # Positional arguments whose fingerprints the command would otherwise compute alongside
    # its work, not before it (diff's NEW): hashed ahead only while the child's whole job stays
    # within WAIT_BYTES, so that on bigger inputs the child does not hold a core against the
    # workers for long, and the command hashes them itself as it did (measured on 1 GB files).
    waits: tuple[int, ...] = ()


_FORCE = frozenset({"-f", "--force"})
COMMANDS: dict[str, Command] = {
    "diff": Command(
        (0, 1),
        flags=_FORCE | {"--fsync"},
        values=frozenset(
            {
                "-o",
                "--output",
                "-l",
                "--level",
                "-j",
                "--workers",
                "--device",
                "--tensors",
                "--exclude",
                "--blocks",
                "--as",
            }
        ),  # fmt: skip
        skip_with=frozenset({"--as"}),  # it diffs casts of OLD and NEW, not the files
        waits=(1,),  # NEW: hashed block by block as it is encoded
    ),
    "hash": Command(None, flags=frozenset(), values=frozenset()),
    "verify": Command((0,), flags=frozenset(), values=frozenset({"-p", "--patch", "--hash"})),
}


def files_to_hash(args: list[str]) -> list[str]:
    """The files the command in ``args`` (``sys.argv[1:]``) will fingerprint; [] when unsure."""
    return [path for path, _ in _selected(args)]


def _selected(args: list[str]) -> list[tuple[str, bool]]:
    """``files_to_hash``, each with whether it is one of ``Command.waits``."""
    rest = [a for a in args if a not in _GLOBAL_FLAGS]
    if not rest or rest[0] not in COMMANDS or _STOP_FLAGS & set(rest):
        return []
    command = COMMANDS[rest[0]]
    positional: list[str] = []
    tokens = iter(rest[1:])
    for token in tokens:
        if token == "--":
            positional.extend(tokens)
            break
        if token == "-" or not token.startswith("-"):
            positional.append(token)
            continue
        name = token.split("=", 1)[0] if token.startswith("--") else token[:2]
        if name in command.skip_with:
            return []
        if name in command.values:
            if token == name:
                next(tokens, None)  # its value
        elif token not in command.flags:
            return []  # unknown, or short flags run together: do not guess
    indices = range(len(positional)) if command.hashes is None else command.hashes
    return [(positional[i], i in command.waits) for i in indices if i < len(positional)]


@dataclass(frozen=True)
class Hashed:
    """A file's fingerprint, and each tensor's by its ``(start, nbytes)`` in the file."""

    identity: tuple[int, ...]
    header: str  # fingerprint of the JSON header's bytes
    file: str
    ranges: dict[tuple[int, int], str]


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Child:
    def __init__(self, pid: int, rfd: int, keys: set[tuple[int, int]]) -> None:
        self.pid = pid
        self.rfd = rfd
        self.keys = keys  # (device, inode) of the files it hashes
        self.results: dict[tuple[int, int], Hashed | None] = {}
        self.lock = threading.Lock()  # reading the pipe
        self.ended = False
        self._partial = bytearray()  # a line not yet whole (megabytes for many tensors)
        # Killing and reaping, apart from ``lock`` (held while a reader waits on the pipe):
        # once reaped, the pid may belong to another process and must not be signalled.
        self._pid_lock = threading.Lock()
        self._reaped = False

    def wait_for(self, key: tuple[int, int]) -> Hashed | None:
        with self.lock:
            while key not in self.results and not self.ended:
                try:
                    data = os.read(self.rfd, 1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._end()
                    break
                self._partial += data
                if b"\n" in data:
                    *lines, rest = self._partial.split(b"\n")
                    self._partial = bytearray(rest)
                    for line in lines:
                        self._take(bytes(line))
            if not self.ended and self.keys <= self.results.keys():
                # Every file is in: the child is exiting; reap it now, not at exit.
                with contextlib.suppress(OSError):
                    while os.read(self.rfd, 1 << 16):
                        pass
                self._end()
            return self.results.get(key)

    def _take(self, line: bytes) -> None:
        try:
            doc = json.loads(line)
            identity = tuple(int(v) for v in doc["identity"])
            ranges = {(int(s), int(n)): str(fp) for s, n, fp in doc["ranges"]}
            hashed = Hashed(identity, str(doc["header"]), str(doc["file"]), ranges)
            key = (identity[0], identity[1])
        except (ValueError, KeyError, TypeError, IndexError):
            return
        self.results[key] = hashed

    def _end(self) -> None:
        self.ended = True
        os.close(self.rfd)
        with self._pid_lock:
            if not self._reaped:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                self._reaped = True

    def stop(self) -> None:
        with self._pid_lock:
            if not self._reaped:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
        with self.lock:  # a reader waiting on the pipe sees its end now
            if not self.ended:
                self._end()


_child: _Child | None = None


def enabled() -> bool:
    # A value other than 0 or 1: off; the CLI refuses it before the command runs.
    return bool(switch("PULSECTL_PREHASH")) and hasattr(os, "fork")


def start(args: list[str]) -> None:
    """Fork the child for the files of ``args`` (``sys.argv[1:]``), if any are worth it."""
    global _child
    if _child is not None or not enabled():
        return
    paths: list[str] = []
    keys: set[tuple[int, int]] = set()
    total = 0
    for path, waits in _selected(args):
        if path.startswith(("/dev/", "/proc/")):  # /dev/stdin, /proc/self/fd/N: the child's
            continue  # descriptors are not the parent's (it puts /dev/null on 0-2)
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            continue
        key = (st.st_dev, st.st_ino)
        if st.st_size < MIN_BYTES or not stat.S_ISREG(st.st_mode) or key in keys:
            continue
        if waits and total + st.st_size > WAIT_BYTES:
            continue
        paths.append(path)
        keys.add(key)
        total += st.st_size
    if not paths:
        return
    try:
        rfd, wfd = os.pipe()
    except OSError:
        return
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        os.close(rfd)
        os.close(wfd)
        return
    if pid == 0:  # the child: never returns
        _run_child(paths, wfd, parent)
    os.close(wfd)
    os.set_inheritable(rfd, False)
    _child = _Child(pid, rfd, keys)
    atexit.register(stop)


def stop() -> None:
    """End the child (if it still runs) and reap it."""
    if _child is not None:
        _child.stop()


def expects(fd: int) -> bool:
    """Whether the child is hashing (or has hashed) the file open at ``fd``; never waits."""
    child = _child
    if child is None:
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in child.keys


def lookup(fd: int, header_raw: bytes | None) -> Hashed | None:
    """The child's fingerprints of the file open at ``fd``, if it hashed that file as it is
    now; with ``header_raw`` (the JSON header as the caller read it) only if the header is the
    same, else the file fingerprint only (``ranges`` empty). Waits for the child to finish that
    file."""
    child = _child
    if child is None:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    key = (st.st_dev, st.st_ino)
    if key not in child.keys:
        return None
    hashed = child.wait_for(key)
    if hashed is None or hashed.identity != _identity(st):
        return None
    if header_raw is None:
        return Hashed(hashed.identity, hashed.header, hashed.file, {})
    if xxhash.xxh3_128_hexdigest(header_raw) != hashed.header:
        return None
    return hashed


def _run_child(paths: list[str], wfd: int, parent: int) -> None:
    code = 0
    try:
        _die_with(parent)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
        # Hold none of the parent's files: a pipe on stdout must see its end when the parent
        # is done, whatever this child is doing.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, wfd)
        os.closerange(wfd + 1, 1 << 16)
        for path in paths:
            line = memoryview(_hash_file(path) or b"")
            while line:  # a line of a many-tensor file is megabytes: the pipe takes it in parts
                line = line[os.write(wfd, line) :]
    except BaseException:
        code = 1
    os._exit(code)


def _die_with(parent: int) -> None:
    """End this child when its parent ends, even by SIGKILL (the OOM killer), which runs no
    clean-up: an orphan would read a whole checkpoint for nobody. Linux's parent-death
    signal; elsewhere the child ends at its first write to the closed pipe."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)


def _hash_file(path: str) -> bytes | None:
    """One JSON line: the identity, header, file and tensor fingerprints of the file; None
    when it is not a safetensors file whose tensors tile its data, or changed while hashed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        before = _identity(os.fstat(fd))
        size = before[2]
        prefix = os.pread(fd, 8, 0)
        if len(prefix) != 8:
            return None
        (header_len,) = _HEADER_LEN.unpack(prefix)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            return None
        raw = os.pread(fd, header_len, 8)
        ranges = _tensor_ranges(raw, 8 + header_len, size)
        if ranges is None:
            return None
        whole = xxhash.xxh3_128()
        hashers = [xxhash.xxh3_128() for _ in ranges]
        at = 0  # the range being hashed
        for map_at in range(0, size, _MAP_BYTES):
            length = min(_MAP_BYTES, size - map_at)
            with mmap.mmap(fd, length, prot=mmap.PROT_READ, offset=map_at) as mapped:
                view = memoryview(mapped)
                for piece_at in range(0, length, _PIECE):
                    lo = map_at + piece_at
                    hi = min(lo + _PIECE, map_at + length)
                    whole.update(view[piece_at : piece_at + (hi - lo)])
                    while at < len(ranges) and lo < hi:
                        start, nbytes = ranges[at]
                        if start >= hi:
                            break
                        a, b = max(lo, start), min(hi, start + nbytes)
                        if a < b:
                            hashers[at].update(view[a - map_at : b - map_at])
                        if start + nbytes > hi:
                            break
                        at += 1
                view.release()
        if _identity(os.fstat(fd)) != before:
            return None
        doc = {
            "identity": list(before),
            "header": xxhash.xxh3_128_hexdigest(raw),
            "file": whole.hexdigest(),
            "ranges": [[s, n, h.hexdigest()] for (s, n), h in zip(ranges, hashers, strict=True)],
        }
        return json.dumps(doc, separators=(",", ":")).encode("ascii") + b"\n"
    finally:
        os.close(fd)


def _tensor_ranges(raw: bytes, data_start: int, size: int) -> list[tuple[int, int]] | None:
    """The tensors' ``(start, nbytes)`` in the file, in order, if they tile the data region
    exactly (as pulsectl.checkpoint requires of a file it reads); else None."""
    try:
        doc = json.loads(raw)
        offsets = [e["data_offsets"] for name, e in doc.items() if name != "__metadata__"]
        ranges = sorted((data_start + int(b), int(e) - int(b)) for b, e in offsets)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    at = data_start
    for start, nbytes in ranges:
        if start != at or nbytes < 0:
            return None
        at += nbytes
    return ranges if at == size else None
