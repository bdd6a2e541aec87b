"""`pulsectl hash CKPT...`: plumbing, one stable line per checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl.checkpoint import Checkpoint
from pulsectl.cli._output import Output
from pulsectl.inventory import fingerprint_of


def hash_(
    ctx: typer.Context,
    checkpoints: Annotated[
        list[Path], typer.Argument(help="Safetensors files or checkpoint folders.")
    ],
) -> None:
    """Print '<fingerprint>  <path>' for each checkpoint (the fingerprint patches record)."""
    out: Output = ctx.obj
    for path in checkpoints:
        out.data(f"{fingerprint_of(Checkpoint.open(path))}  {path}")
