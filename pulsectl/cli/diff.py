"""`pulsectl diff OLD NEW [-o PATCH]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl._io import default_workers
from pulsectl.cast import cast_temporaries
from pulsectl.cli._options import Checkpoint, Force, Workers
from pulsectl.cli._output import Output, binary_stdout
from pulsectl.diff import (
    DEFAULT_LEVEL,
    MAX_LEVEL,
    MAX_PRESET_LEVEL,
    DiffOptions,
    diff_checkpoints,
    diff_to_path,
)
from pulsectl.errors import UsageError


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
        str,
        typer.Option(
            "--level",
            "-l",
            help=(
                f"Size/speed trade-off: 1..{MAX_LEVEL} (zstd level of the codec planes, default "
                f"{DEFAULT_LEVEL}), or 'max' (base-context codec, smallest patches, slower)."
            ),
        ),
    ] = str(DEFAULT_LEVEL),
    workers: Workers = None,
    as_dtype: Annotated[
        str | None,
        typer.Option(
            "--as",
            help="Diff the casts (bf16, f16, f8_e4m3, f8_e5m2): apply to `pulsectl cast OLD`.",
        ),
    ] = None,
) -> None:
    """Write the patch that turns OLD into NEW (byte for byte)."""
    out: Output = ctx.obj
    options = parse_level(level, workers or default_workers())
    if as_dtype is not None:
        # Cast both to temporaries beside the output (or in $TMPDIR), diff those, remove them.
        near = None if output is None or output == "-" else output
        with cast_temporaries([old, new], to=as_dtype, near=near) as (old, new):
            return diff(ctx, old, new, output, force, level, workers, None)
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


def parse_level(level: str, workers: int) -> DiffOptions:
    """`--level N` or `--level max` as diff options."""
    if level.strip().lower() == "max":
        return DiffOptions(level=MAX_PRESET_LEVEL, context=True, workers=workers)
    try:
        value = int(level)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LEVEL:
        raise UsageError(f"--level {level!r}: give 1..{MAX_LEVEL} or 'max'")
    return DiffOptions(level=value, workers=workers)
