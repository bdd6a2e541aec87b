"""`pulsectl verify CKPT --patch P | --hash H`."""

from __future__ import annotations

from typing import Annotated

import typer

from pulsectl.cli._options import Checkpoint
from pulsectl.cli._output import Output


def verify(
    ctx: typer.Context,
    checkpoint: Checkpoint,
    patch: Annotated[
        str | None,
        typer.Option(
            "--patch", "-p", metavar="PATCH", help="Pass when CKPT is this patch's target."
        ),
    ] = None,
    fingerprint: Annotated[
        str | None,
        typer.Option("--hash", metavar="FINGERPRINT", help="Pass when CKPT has this fingerprint."),
    ] = None,
) -> None:
    """Exit 0 when CKPT is exactly what is expected, 3 when it is not."""
    from pulsectl.info import verify_checkpoint

    out: Output = ctx.obj
    actual = verify_checkpoint(checkpoint, patch=patch, fingerprint=fingerprint)
    out.info(f"ok: {checkpoint} has fingerprint {actual}")
