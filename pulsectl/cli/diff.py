"""`pulsectl diff OLD NEW [-o PATCH]`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pulsectl._names import DEFAULT_LEVEL, MAX_LEVEL, MAX_PRESET_LEVEL
from pulsectl.cli._options import (
    FindDevice,
    Force,
    Fsync,
    NewCheckpoint,
    OldCheckpoint,
    Workers,
    check_cast_target,
)
from pulsectl.cli._output import Output, binary_stdout, smaller_than
from pulsectl.errors import UsageError, counted, escape_controls

if TYPE_CHECKING:
    from pulsectl.diff import DiffOptions, DiffSummary


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
                f"{DEFAULT_LEVEL}; 1-3 share fast value-plane settings, which higher levels "
                "also try: slower, their value planes never larger), or 'max' (base-context "
                "codec, smallest patches, slower)."
            ),
        ),
    ] = str(DEFAULT_LEVEL),
    workers: Workers = None,
    device: FindDevice = "auto",
    tensors: Annotated[
        list[str] | None,
        typer.Option(
            "--tensors",
            metavar="GLOB",
            help="A block patch of only the tensors matching GLOB (repeatable; fnmatch, "
            "case-sensitive, '[[]' for a '['). It binds only those tensors and applies on its "
            "own; OLD and NEW must have the same layout.",
        ),
    ] = None,
    exclude: Annotated[
        list[str] | None,
        typer.Option("--exclude", metavar="GLOB", help="Leave out tensors matching GLOB."),
    ] = None,
    blocks: Annotated[
        int | None,
        typer.Option(
            "--blocks",
            metavar="N",
            min=1,
            help="Split by layer into N block patches plus one for the other tensors: "
            "-o step.pulse writes step.block0.pulse ... step.rest.pulse.",
        ),
    ] = None,
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
    import dataclasses

    from pulsectl._io import default_workers
    from pulsectl.device import resolve

    out: Output = ctx.obj
    check_cast_target(as_dtype)
    options = dataclasses.replace(
        parse_level(level, workers or default_workers()),
        tensors=tuple(tensors or ()),
        exclude=tuple(exclude or ()),
        device=resolve(device),
    )
    stdout = output is None or output == "-"
    if output is not None and not stdout:
        from pulsectl._atomic import check_file_target, file_path

        # 'runs/', a folder, or a file without -f: refused before any work (--as casts first).
        if blocks is None:
            check_file_target(output, force)
        else:
            file_path(output, "patch")  # a prefix: PATCH.block0.pulse ...
    if blocks is not None:
        if stdout:
            raise UsageError(
                "--blocks writes several files: give -o PATCH (not stdout)", option="--blocks"
            )
        if options.selecting:
            raise UsageError(
                "--blocks chooses the tensors itself; drop --tensors/--exclude", option="--blocks"
            )
    elif stdout:
        from pulsectl._atomic import refuse_stdout_as_input

        binary_stdout()  # refuse a terminal before any work
        refuse_stdout_as_input([old, new], "patch")
    if as_dtype is None:
        _run(out, old, new, output, options, force, fsync, blocks)
        return
    from pulsectl.cast import cast_temporaries

    # Cast both to temporaries beside the output (or in $TMPDIR), diff those, remove them.
    with cast_temporaries([old, new], to=as_dtype, near=None if stdout else output) as (a, b):
        _run(out, a, b, output, options, force, fsync, blocks)


def _run(
    out: Output,
    old: Path,
    new: Path,
    output: str | None,
    options: DiffOptions,
    force: bool,
    fsync: bool,
    blocks: int | None,
) -> None:
    from pulsectl.diff import diff_checkpoints, diff_to_path

    warn_of_linked_folders(out, new, "the patch")
    if blocks is not None:
        from pulsectl.blocks import diff_blocks

        assert output is not None
        written = diff_blocks(
            old,
            new,
            Path(output),
            blocks,
            force=force,
            options=options,
            durable=fsync,
            say=out.info,
        )
        for path, summary in written:
            out.info(
                f"{path}: {summary.changed_words:,} words changed, {summary.patch_bytes:,} bytes"
            )
        return
    with out.progress("diff") as progress:
        if output is None or output == "-":
            sink = binary_stdout()
            summary = diff_checkpoints(old, new, sink, options=options, progress=progress)
            sink.finish()
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
    out.info(
        f"{summary.changed_words:,} of {summary.total_words:,} words changed ({density:.3%}); "
        f"patch {summary.patch_bytes:,} bytes, "
        + (
            smaller_than(summary.patch_bytes, summary.target_bytes)
            if summary.selected_bytes is None
            else smaller_than(summary.patch_bytes, summary.selected_bytes, "its tensors")
        )
    )
    for line in tensor_changes(summary):
        out.info(line)
    if summary.diffed_tensors == 0 and (summary.removed_tensors or summary.recast_tensors):
        out.warn(
            "OLD and NEW have no tensor in common (name, shape and dtype): the patch carries "
            "NEW whole; are they checkpoints of the same model?"
        )


def warn_of_linked_folders(out: Output, ckpt: Path, what: str) -> None:
    """Links to folders in a folder checkpoint are not followed (docs/FORMAT.md): what they
    hold is not in ``what``, and a worker would lack it, so say so (found in review: silently
    left out)."""
    from pulsectl.checkpoint import linked_folders

    linked = linked_folders(ckpt)
    if linked:
        out.warn(
            f"{ckpt}: not in {what}: {', '.join(f'{n}/' for n in linked)} (links to folders "
            "are not followed, docs/FORMAT.md); copy what they hold into the checkpoint to "
            "carry it"
        )


def tensor_changes(summary: DiffSummary, shown: int = 3) -> list[str]:
    """Lines on the tensors a patch carries whole, and those it drops, naming a few of each."""

    def names(found: tuple[str, ...]) -> str:
        listed = ", ".join(escape_controls(n) for n in found[:shown])
        more = f" and {len(found) - shown:,} more" if len(found) > shown else ""
        return f" ({listed}{more})"

    lines = []
    if summary.new_tensors:
        lines.append(
            f"carried whole: {counted(len(summary.new_tensors), 'tensor')} that OLD does not "
            f"have{names(summary.new_tensors)}"
        )
    if summary.recast_tensors:
        lines.append(
            f"carried whole: {counted(len(summary.recast_tensors), 'tensor')} with another "
            f"shape or dtype in OLD{names(summary.recast_tensors)}"
        )
    if summary.removed_tensors:
        lines.append(
            f"dropped: {counted(len(summary.removed_tensors), 'tensor')} of OLD that NEW does "
            f"not have{names(summary.removed_tensors)}"
        )
    return lines


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
        raise UsageError(f"--level {level!r}: give 1..{MAX_LEVEL} or 'max'", option="--level")
    return DiffOptions(level=value, workers=workers)
