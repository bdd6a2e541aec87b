"""One output object: stdout carries data, stderr carries everything meant for people."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from pulsectl.errors import OutputError, UsageError


class Output:
    def __init__(self, quiet: bool = False, verbose: bool = False) -> None:
        self.quiet = quiet
        self.verbose = verbose

    def data(self, text: str) -> None:
        """A line of data for scripts (stdout)."""
        try:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        except BrokenPipeError as exc:
            raise _pipe_closed("the output") from exc

    def json(self, obj: Any) -> None:
        self.data(json.dumps(obj, indent=2, sort_keys=False))

    def info(self, text: str) -> None:
        """A message for a person (stderr); silenced by -q."""
        if not self.quiet:
            sys.stderr.write(text + "\n")

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


def binary_stdout() -> Any:
    """stdout for binary data; refuses a terminal like zstd does."""
    if sys.stdout.isatty():
        raise UsageError("refusing to write a binary patch to a terminal; use -o FILE or a pipe")
    return _PipeWriter(sys.stdout.buffer)


class _PipeWriter:
    """A binary stdout whose reader may go away (`pulsectl diff a b | head -c 100`)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: bytes | memoryview) -> int:
        try:
            return int(self._raw.write(data))
        except BrokenPipeError as exc:
            raise _pipe_closed("the patch") from exc

    def flush(self) -> None:
        try:
            self._raw.flush()
        except BrokenPipeError as exc:
            raise _pipe_closed("the patch") from exc


def _pipe_closed(what: str) -> OutputError:
    """A closed stdout pipe as a pulsectl error.

    typer (like click) catches an EPIPE OSError itself and exits 1 without a word, so it must
    not reach typer. stdout is pointed at /dev/null so the interpreter's final flush is quiet.
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return OutputError(f"output pipe closed before {what} was complete")
