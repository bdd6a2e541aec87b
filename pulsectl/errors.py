"""One exception hierarchy for pulsectl, with the exit codes the CLI maps them to.

Exit codes (documented in docs/GUARANTEES.md and README.md):
  0 ok, 1 error (bad or unreadable input, output problems), 2 usage, 3 integrity, 141 the
  reader of text on stdout went away (the console script then dies of SIGPIPE, as git does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTEGRITY = 3
EXIT_PIPE = 141  # 128 + SIGPIPE


# Line breaks and other control characters in a message (from a file name, or from a
# damaged file's own text) are shown escaped, as repr() shows them.
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(32), 127)}


def escape_controls(text: str) -> str:
    """``text`` with line breaks, escape sequences and other control characters shown as
    repr() shows them (``\\n``, ``\\x1b``): for names read from files (tensor names, file
    names, a patch's writer string) before they reach a terminal or a line-based output.
    A lone surrogate (a file name byte that is not UTF-8, as Python decodes it) is shown as
    ``\udcff`` too: written as it is, it would fail on any UTF-8 stream."""
    escaped = text.translate(_ESCAPES)
    return escaped.encode("utf-8", "backslashreplace").decode("utf-8")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun for that many, for messages: ``1 patch``, ``3 patches``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


class PulseError(Exception):
    """Base of every error pulsectl raises on purpose.

    ``message`` is one line that names the object and the fix (control characters in it are
    escaped); the structured fields let callers (and tests) inspect what went wrong without
    parsing text.
    """

    exit_code = EXIT_ERROR

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        tensor: str | None = None,
        expected: str | None = None,
        actual: str | None = None,
    ) -> None:
        message = escape_controls(message)
        super().__init__(message)
        self.message = message
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.expected = expected
        self.actual = actual

    def __str__(self) -> str:
        return self.message


class UsageError(PulseError):
    """The command line asks for something that cannot be done (exit 2).

    ``option`` names the option (``"--level"``) when the error is about its value, or about
    options that do not go together: the CLI then ends the line with the parser's hint
    (``try 'pulsectl diff -h' for help``), as for a value the parser refuses. The message
    names the option itself. ``help_command`` is set by the CLI to the command's path.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, option: str | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.option = option
        self.help_command: str | None = None


class InputError(PulseError):
    """An input is missing, unreadable or not what it claims to be (exit 1)."""


class FormatError(InputError):
    """A safetensors file or a .pulse header is malformed (exit 1)."""


class OutputError(PulseError):
    """The output cannot be written: it exists, the disk is full, the folder is read-only."""


class ReaderGoneError(OutputError):
    """The reader of the text written to stdout went away (``| head``): it took what it
    wanted, so this is not reported; the CLI ends as by SIGPIPE (exit 141), as git and
    coreutils do. (A patch or checkpoint cut short on stdout stays an ``OutputError``.)"""

    exit_code = EXIT_PIPE


class DeviceError(PulseError):
    """The torch device asked for by name (``--device cuda``) failed: out of memory (a
    training job holds the GPU), or another CUDA error (exit 1). A device that ``auto`` chose
    falls back to the CPU path instead, which writes the same bytes."""


class IntegrityError(PulseError):
    """Bytes are not what a fingerprint or checksum says they must be (exit 3).

    Wrong base, out-of-order chain, damaged or truncated patch, target mismatch.
    """

    exit_code = EXIT_INTEGRITY


class CorruptPatchError(IntegrityError):
    """A .pulse file fails a checksum or ends early."""


def open_files_hint(exc: OSError) -> str:
    """For a file that could not be opened because too many are open (a folder checkpoint of
    many shards under a low `ulimit -n`): what to do, else nothing."""
    import errno

    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return "; too many files open at once: raise the limit (ulimit -n)"
    return ""
