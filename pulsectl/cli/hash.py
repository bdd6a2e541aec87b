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
        typer.Argument(metavar="CKPT", help="Safetensors files or checkpoint folders."),
    ],
) -> None:
    """Print '<fingerprint>  <path>' for each checkpoint (the fingerprint patches record)."""
    from pulsectl.checkpoint import Checkpoint
    from pulsectl.inventory import fingerprint_of

    out: Output = ctx.obj
    for path in checkpoints:
        out.data(f"{fingerprint_of(Checkpoint.open(path))}  {path}")
