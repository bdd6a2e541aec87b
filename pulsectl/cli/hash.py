"""`pulsectl hash CKPT...`: plumbing, one stable line per checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl.cli._output import Output
from pulsectl.errors import EXIT_OK, PulseError


def hash_(
    ctx: typer.Context,
    checkpoints: Annotated[
        list[str],  # printed as given (./a, a/), as sha256sum does: scripts match them
        typer.Argument(metavar="CKPT...", help="Safetensors files or checkpoint folders."),
    ],
) -> None:
    """Print each checkpoint's fingerprint (the one patches record) and path, as sha256sum.

    One line '<fingerprint>  <path>' per checkpoint; a path with a line break or backslash is
    escaped as sha256sum does. Like sha256sum, a
    checkpoint that cannot be read (missing, malformed) gets an error line on stderr and the
    others are still hashed; the exit status is then the highest of those errors' codes (1 for
    a missing or malformed checkpoint), 0 when every checkpoint was hashed."""
    from pulsectl.checkpoint import Checkpoint
    from pulsectl.inventory import fingerprint_of

    out: Output = ctx.obj
    code = EXIT_OK
    for path in checkpoints:
        try:
            fingerprint = fingerprint_of(Checkpoint.open(Path(path)))
        except PulseError as exc:  # this checkpoint only; a failed write to stdout ends it all
            out.error(exc)
            code = max(code, exc.exit_code)
            continue
        out.data(_line(fingerprint, path))
    if code != EXIT_OK:
        raise typer.Exit(code)


def _line(fingerprint: str, path: str) -> str:
    """``<fingerprint>  <path>``; a path with a backslash or a line break in it is escaped as
    GNU sha256sum does (the line starts with a backslash), so it stays one line."""
    if not any(c in path for c in "\\\n\r"):
        return f"{fingerprint}  {path}"
    escaped = path.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return f"\\{fingerprint}  {escaped}"
