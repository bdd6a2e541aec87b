"""`pulsectl cast CKPT --to bf16 -o OUT`."""

from __future__ import annotations

from typing import Annotated

import typer

from pulsectl._names import CAST_TARGETS
from pulsectl.cli._options import Checkpoint, Force, check_cast_target
from pulsectl.cli._output import Output


def cast(
    ctx: typer.Context,
    checkpoint: Checkpoint,
    output: Annotated[
        str,
        typer.Option("--output", "-o", metavar="OUT", help="Where to write the cast checkpoint."),
    ],
    to: Annotated[
        str, typer.Option("--to", metavar="DTYPE", help=f"Target dtype: {', '.join(CAST_TARGETS)}.")
    ] = "bf16",
    force: Force = False,
) -> None:
    """Write CKPT with its float tensors rounded to --to exactly as torch's .to() does.

    The worker's anchor for `pulsectl diff --as`: F32, F64, F16 and BF16 tensors are cast
    (round to nearest even), everything else is copied unchanged.
    """
    from pulsectl.cast import cast_checkpoint

    out: Output = ctx.obj
    check_cast_target(to, "--to")
    with out.progress("cast") as progress:
        summary = cast_checkpoint(checkpoint, output, to=to, force=force, progress=progress)
    out.info(
        f"wrote {summary.output}: {summary.converted} of {summary.tensors} tensors cast to "
        f"{summary.target}; {summary.source_bytes:,} -> {summary.output_bytes:,} bytes"
    )
