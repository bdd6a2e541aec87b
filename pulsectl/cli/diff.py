"""`pulsectl diff OLD NEW [-o PATCH]`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pulsectl._names import DEFAULT_LEVEL, MAX_LEVEL, MAX_PRESET_LEVEL
from pulsectl.cli._options import Force, Fsync, NewCheckpoint, OldCheckpoint, Workers
from pulsectl.cli._output import Output, binary_stdout
from pulsectl.errors import UsageError

if TYPE_CHECKING:
    from pulsectl.diff import DiffOptions


def diff(
    ctx: typer.Context,
    old: OldCheckpoint,
    new: NewCheckpoint,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="PATCH",
            help="Patch file to write; '-' for stdout (the default when stdout is not a terminal).",
        ),
    ] = None,
    force: Force = False,
    fsync: Fsync = False,
    level: Annotated[
        str,
        typer.Option(
            "--level",
            "-l",
            metavar="LEVEL",
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
            metavar="DTYPE",
            help="Diff the casts (bf16, f16, f8_e4m3, f8_e5m2): apply to `pulsectl cast OLD`.",
        ),
    ] = None,
) -> None:
    """Write the patch that turns OLD into NEW (byte for byte)."""
    from pulsectl._io import default_workers
    from pulsectl.diff import diff_checkpoints, diff_to_path

    out: Output = ctx.obj
    options = parse_level(level, workers or default_workers())
    stdout = output is None or output == "-"
    if stdout:
        binary_stdout()  # refuse a terminal before any work
    if as_dtype is not None:
        from pulsectl.cast import cast_temporaries

        # Cast both to temporaries beside the output (or in $TMPDIR), diff those, remove them.
        near = None if output is None or output == "-" else output
        with cast_temporaries([old, new], to=as_dtype, near=near) as (old, new):
            return diff(ctx, old, new, output, force, fsync, level, workers, None)
    with out.progress("diff") as progress:
        if output is None or output == "-":
            summary = diff_checkpoints(
                old, new, binary_stdout(), options=options, progress=progress
            )
        else:
            summary = diff_to_path(
                old,
                new,
                Path(output),
                force=force,
                options=options,
                progress=progress,
                durable=fsync,
            )
    density = summary.changed_words / summary.total_words if summary.total_words else 0.0
    ratio = summary.target_bytes / summary.patch_bytes if summary.patch_bytes else 0.0
    out.info(
        f"{summary.changed_words:,} of {summary.total_words:,} words changed ({density:.3%}); "
        f"patch {summary.patch_bytes:,} bytes, {ratio:.1f}x smaller than the target"
    )


def parse_level(level: str, workers: int) -> DiffOptions:
    """`--level N` or `--level max` as diff options."""
    from pulsectl.diff import DiffOptions

    if level.strip().lower() == "max":
        return DiffOptions(level=MAX_PRESET_LEVEL, context=True, workers=workers)
    try:
        value = int(level)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_LEVEL:
        raise UsageError(f"--level {level!r}: give 1..{MAX_LEVEL} or 'max'")
    return DiffOptions(level=value, workers=workers)
