"""One output object: stdout carries data, stderr carries everything meant for people."""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from pulsectl._env import switch
from pulsectl.errors import (
    OutputError,
    PulseError,
    ReaderGoneError,
    UsageError,
    escape_controls,
)


class Output:
    def __init__(self, quiet: bool = False, verbose: bool = False) -> None:
        self.quiet = quiet
        self.verbose = verbose

    def data(self, text: str) -> None:
        """A line of data for scripts (stdout)."""
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def json(self, obj: Any) -> None:
        self.data(json.dumps(obj, indent=2, sort_keys=False))

    def report(self, text: str, done: str) -> bool:
        """``data`` that reports a change already made (``done``: "step 7 was published to
        STORE"). Where stdout cannot take it (full, closed, failing), the change stands and the
        command still succeeds: a caller that retried on exit 1 would publish again, or feed a
        residual back twice. So the failure is a warning naming what was done, shown under -q
        too; exit 0. (A reader that went away, `| head`, still ends it as for any text.)
        Returns whether ``text`` went out."""
        try:
            self.data(text)
        except OutputError as exc:
            if isinstance(exc, ReaderGoneError):
                raise
            sys.stderr.write(f"pulsectl: warning: {exc.message}; {done} all the same\n")
            accepted = getattr(sys.stdout, "accept_failure", None)
            if accepted is not None:
                accepted()
            return False
        return True

    def report_json(self, obj: Any, done: str) -> None:
        self.report(json.dumps(obj, indent=2, sort_keys=False), done)

    def error(self, exc: PulseError) -> None:
        """An error that ends one part of a command, not the command (one of several inputs):
        the line ``main`` prints for an error that ends it, with the traceback under -v."""
        if self.verbose or switch("PULSECTL_DEBUG"):
            traceback.print_exception(exc)
        sys.stderr.write(f"pulsectl: error: {exc.message}\n")

    def info(self, text: str) -> None:
        """A message for a person (stderr); silenced by -q."""
        if not self.quiet:
            sys.stderr.write(text + "\n")

    def warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        """``warnings.showwarning`` while a command runs: one line on stderr, silenced by -q;
        where it was raised, under -v. The filters (``PYTHONWARNINGS``) still decide
        which warnings come here."""
        where = f" ({category.__name__} at {filename}:{lineno})" if self.verbose else ""
        self.warn(" ".join(str(message).split()) + where)

    def warn(self, text: str) -> None:
        """One ``pulsectl: warning: ...`` line on stderr (control characters escaped); silenced
        by -q."""
        if not self.quiet:
            sys.stderr.write(f"pulsectl: warning: {escape_controls(text)}\n")

    def rich(self, renderable: Any) -> None:
        """A rich table or text for a person, on stdout (it is the command's result)."""
        from rich.console import Console

        # Off a terminal rich assumes 80 columns; a pipe or file gets full tensor names instead.
        width = None if sys.stdout.isatty() else 240
        # Cells hold names read from files: no markup ('w[b].weight' would lose '[b]') and no
        # emoji codes (':fire:'), so that every name shows as it is.
        Console(soft_wrap=False, width=width, markup=False, emoji=False).print(renderable)

    @contextlib.contextmanager
    def progress(self, description: str) -> Iterator[Callable[[int, int], None] | None]:
        """A progress callback ``(done, total)`` drawing a bar on stderr when it is a terminal."""
        if self.quiet or not sys.stderr.isatty():
            yield None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            task = bar.add_task(description, total=None)

            def update(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            yield update


def smaller_than(patch_bytes: int, whole_bytes: int, whole: str = "the target") -> str:
    """``"113.9x smaller than the target"``, or, where the patch is not smaller (a tiny
    checkpoint, most of its words changed), ``"larger than the target (120 bytes)"``."""
    if patch_bytes >= whole_bytes:
        size = "as large as" if patch_bytes == whole_bytes else "larger than"
        return f"{size} {whole} ({whole_bytes:,} bytes)"
    if patch_bytes <= 0:
        return f"smaller than {whole}"
    ratio = whole_bytes / patch_bytes
    if ratio < 1.05:  # would show as "1.0x smaller"
        return f"a little smaller than {whole} ({whole_bytes:,} bytes)"
    return f"{ratio:.1f}x smaller than {whole}"


def binary_stdout() -> Any:
    """stdout for binary data; refuses a closed stdout, and a terminal like zstd does."""
    stream = sys.stdout
    guard = stream if isinstance(stream, GuardedStdout) else GuardedStdout(stream)
    if guard.stream is None:
        raise stdout_closed("give -o PATCH, or redirect stdout to a file or a pipe")
    if guard.stream.isatty():
        raise UsageError("refusing to write a binary patch to a terminal; use -o FILE or a pipe")
    return _GuardedBuffer(guard, "the patch")


_UNENCODABLE = "pulsectl-stdout"


def _escape_unencodable(exc: UnicodeError) -> tuple[bytes, int]:
    """The codec error handler ``_UNENCODABLE``: the characters stdout's encoding lacks go out
    as the bytes they stand for, as sha256sum writes a file name: a lone surrogate from a
    name's byte that is not UTF-8 (U+DC80-U+DCFF, Python's surrogateescape) as that byte,
    anything else in UTF-8 (no escape of our own: `hash` lines have their own)."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = bytearray()
    for char in exc.object[exc.start : exc.end]:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            out.append(code - 0xDC00)
        else:
            out += char.encode("utf-8", "surrogatepass")
    return bytes(out), exc.end


codecs.register_error(_UNENCODABLE, _escape_unencodable)


class GuardedStdout:
    """``sys.stdout`` while ``main`` runs: a write to stdout that fails (the reader went away,
    the disk is full, stdout was closed with ``>&-``) raises a one-line ``OutputError``, so
    that every such failure, whoever writes (a command, rich, click's --help, print), ends as
    one line, and an OSError that reaches ``main`` is a bug.

    A reader that goes away while text is written (``inspect P | head -3``) is the exception:
    that raises ``ReaderGoneError``, which ends the run without a message (exit 141), as git
    and coreutils end; once bytes (a patch) went out, a closed pipe is an error, as above.

    ``stream`` is the real stdout, or None where the process was started with stdout closed
    (Python then leaves ``sys.stdout`` None): a command that writes nothing there runs as
    usual.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed: OutputError | None = None
        # What binary bytes were written for ("the patch"), and whether all of it was: for the
        # line that an interrupt prints.
        self.sent: str | None = None
        self.sent_whole = False
        self.texted = False  # whether any text (a hash line, a table) was written

    def __getattr__(self, name: str) -> Any:
        if self.stream is None:
            raise AttributeError(name)
        return getattr(self.stream, name)

    @property
    def encoding(self) -> str:
        return str(getattr(self.stream, "encoding", None) or "utf-8")

    @property
    def closed(self) -> bool:
        return bool(getattr(self.stream, "closed", False))

    @property
    def buffer(self) -> _GuardedBuffer:
        return _GuardedBuffer(self)

    def write(self, text: str) -> int:
        if self.stream is None:
            raise stdout_closed()
        self._check()
        self.texted = self.texted or bool(text)
        try:
            try:
                return int(self.stream.write(text))
            except UnicodeEncodeError:  # nothing of ``text`` was written: it is encoded first
                return self._write_unencodable(text)
        except OSError as exc:
            raise self._failed(exc) from exc

    def _write_unencodable(self, text: str) -> int:
        """``text`` where stdout's encoding lacks some of its characters (a stdout forced to
        ASCII, a legacy locale): those go out as the bytes they stand for (``_UNENCODABLE``),
        as sha256sum writes a file name; backslash escapes only for an encoding that takes no
        bytes from an error handler (UTF-16)."""
        raw = getattr(self.stream, "buffer", None)
        if raw is None:
            return int(self.stream.write(text.encode("ascii", "backslashreplace").decode()))
        try:
            data = text.encode(self.encoding, _UNENCODABLE)
        except UnicodeError:  # an encoding that takes no bytes from a handler (UTF-16)
            data = text.encode(self.encoding, "backslashreplace")
        self.stream.flush()
        raw.write(data)
        if getattr(self.stream, "line_buffering", False) and "\n" in text:
            raw.flush()
        return len(text)

    def flush(self) -> None:
        if self.stream is None:
            return
        self._check()
        try:
            self.stream.flush()
        except OSError as exc:
            raise self._failed(exc) from exc

    def accept_failure(self) -> None:
        """The caller has reported the failed write itself (``Output.report``): later writes
        and the final flush go to /dev/null, where stdout now points, without raising it."""
        self.failed = None

    def _check(self) -> None:
        # Once a write failed, every later one fails the same way: stdout now points at
        # /dev/null, and a caller that swallowed the first error (click probes the stream with
        # a write) must not see success after it.
        if self.failed is not None:
            raise self.failed

    def _failed(self, exc: OSError, what: str = "the output") -> OutputError:
        text = self.sent is None  # nothing binary (a patch) went out
        if text and isinstance(exc, BrokenPipeError):
            _silence_stdout()
            self.failed = ReaderGoneError("the reader of standard output went away")
        else:
            self.failed = stdout_failed(exc, what)
        return self.failed

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.stream is not None and bool(self.stream.isatty())

    def fileno(self) -> int:
        if self.stream is None:
            raise io.UnsupportedOperation("standard output is closed")
        return int(self.stream.fileno())


class _GuardedBuffer:
    """``GuardedStdout.buffer``: the binary stdout, guarded the same way (``what`` is written
    there, for the error: a patch, or the output)."""

    def __init__(self, text: GuardedStdout, what: str = "the output") -> None:
        self._text = text
        self._what = what
        self._raw = getattr(text.stream, "buffer", None)

    def __getattr__(self, name: str) -> Any:
        if self._raw is None:
            raise AttributeError(name)
        return getattr(self._raw, name)

    def write(self, data: bytes | memoryview) -> int:
        if self._raw is None:
            raise stdout_closed()
        self._text._check()
        self._text.sent = self._what  # an interrupt from now on leaves it incomplete
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            # A large write that the reader leaves during returns short, without an error: the
            # rest goes in another write, which fails, so no part of a patch is lost unsaid.
            while view:
                view = view[int(self._raw.write(view)) :]
        except OSError as exc:
            raise self._text._failed(exc, self._what) from exc
        return size

    def flush(self) -> None:
        if self._raw is None:
            return
        self._text._check()
        try:
            self._raw.flush()
        except OSError as exc:
            raise self._text._failed(exc, self._what) from exc

    def finish(self) -> None:
        """Say that the whole of it was written (then flushed)."""
        self.flush()
        self._text.sent_whole = self._text.sent is not None


def stdout_failed(exc: OSError, what: str) -> OutputError:
    """A write to stdout that failed as a pulsectl error.

    typer (like click) catches an EPIPE OSError itself and exits 1 without a word, so it must
    not reach typer. stdout is pointed at /dev/null so that the interpreter's final flush of
    what is still buffered is quiet.
    """
    _silence_stdout()
    if isinstance(exc, BrokenPipeError):
        return OutputError(f"output pipe closed before {what} was complete")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(
            "standard output: no space left on device; free some space or redirect the output "
            "elsewhere"
        )
    return OutputError(
        f"standard output: cannot write ({exc.strerror or exc}); redirect the output elsewhere"
    )


def stdout_closed(fix: str = "redirect it to a file, a pipe or /dev/null") -> OutputError:
    return OutputError(f"standard output is closed; {fix}")


def _silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null (when it has one)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
