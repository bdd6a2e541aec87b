"""`pulsectl diff OLD NEW [-o PATCH]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl._io import default_workers
from pulsectl.cli._options import Checkpoint, Force, Workers
from pulsectl.cli._output import Output, binary_stdout
from pulsectl.diff import DEFAULT_LEVEL, MAX_LEVEL, DiffOptions, diff_checkpoints, diff_to_path


def diff(
    ctx: typer.Context,
    old: Checkpoint,
    new: Checkpoint,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Patch file to write; '-' for stdout (the default when stdout is not a terminal).",
        ),
    ] = None,
    force: Force = False,
    level: Annotated[
        int,
        typer.Option("--level", "-l", min=1, max=MAX_LEVEL, help="zstd level of the codec planes."),
    ] = DEFAULT_LEVEL,
    workers: Workers = None,
) -> None:
    """Write the patch that turns OLD into NEW (byte for byte)."""
    out: Output = ctx.obj
    options = DiffOptions(level=level, workers=workers or default_workers())
    with out.progress("diff") as progress:
        if output is None or output == "-":
            summary = diff_checkpoints(
                old, new, binary_stdout(), options=options, progress=progress
            )
        else:
            summary = diff_to_path(
                old, new, Path(output), force=force, options=options, progress=progress
            )
    density = summary.changed_words / summary.total_words if summary.total_words else 0.0
    ratio = summary.target_bytes / summary.patch_bytes if summary.patch_bytes else 0.0
    out.info(
        f"{summary.changed_words:,} of {summary.total_words:,} words changed ({density:.3%}); "
        f"patch {summary.patch_bytes:,} bytes, {ratio:.1f}x smaller than the target"
    )
