"""One output object: stdout carries data, stderr carries everything meant for people."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from pulsectl.errors import UsageError


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

    def info(self, text: str) -> None:
        """A message for a person (stderr); silenced by -q."""
        if not self.quiet:
            sys.stderr.write(text + "\n")

    def rich(self, renderable: Any) -> None:
        """A rich table or text for a person, on stdout (it is the command's result)."""
        from rich.console import Console

        # Off a terminal rich assumes 80 columns; a pipe or file gets full tensor names instead.
        width = None if sys.stdout.isatty() else 240
        Console(soft_wrap=False, width=width).print(renderable)

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
    return sys.stdout.buffer
