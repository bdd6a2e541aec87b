"""`pulsectl hash CKPT...`: plumbing, one stable line per checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl.cli._output import Output


def hash_(
    ctx: typer.Context,
    checkpoints: Annotated[
        list[Path],
        typer.Argument(metavar="CKPT...", help="Safetensors files or checkpoint folders."),
    ],
) -> None:
    """Print '<fingerprint>  <path>' for each checkpoint (the fingerprint patches record).

    A path with a line break or backslash is escaped as sha256sum does."""
    from pulsectl.checkpoint import Checkpoint
    from pulsectl.inventory import fingerprint_of

    out: Output = ctx.obj
    for path in checkpoints:
        out.data(_line(fingerprint_of(Checkpoint.open(path)), str(path)))


def _line(fingerprint: str, path: str) -> str:
    """``<fingerprint>  <path>``; a path with a backslash or a line break in it is escaped as
    GNU sha256sum does (the line starts with a backslash), so it stays one line."""
    if not any(c in path for c in "\\\n\r"):
        return f"{fingerprint}  {path}"
    escaped = path.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return f"\\{fingerprint}  {escaped}"
