"""`pulsectl squash P1 P2 ... -o P [--base CKPT]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl.cli._options import Force
from pulsectl.cli._output import Output
from pulsectl.errors import counted


def squash(
    ctx: typer.Context,
    patches: Annotated[
        list[Path],
        typer.Argument(metavar="PATCH...", help="Full patches (not block patches) in chain order."),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output", "-o", metavar="PATCH", help="The squashed patch; '-' writes it to stdout."
        ),
    ],
    base: Annotated[
        Path | None,
        typer.Option(
            "--base",
            metavar="CKPT",
            help="The first patch's base. Needed for chains made with --level max; with it the "
            "result is re-encoded from scratch (any --level).",
        ),
    ] = None,
    level: Annotated[
        str, typer.Option("--level", "-l", metavar="LEVEL", help="1..22, or 'max' (with --base).")
    ] = "3",
    force: Force = False,
) -> None:
    """Write one patch equivalent to the chain: the base of the first, the target of the last."""
    from pulsectl.cli._output import binary_stdout
    from pulsectl.cli.diff import parse_level
    from pulsectl.squash import squash_patches

    out: Output = ctx.obj
    from pulsectl._io import default_workers

    options = parse_level(level, default_workers())  # --base re-diffs: on every core
    stdout = str(output) == "-"
    stream = binary_stdout() if stdout else None  # a terminal is refused before any work
    if stdout:
        from pulsectl._atomic import refuse_stdout_as_input

        refuse_stdout_as_input([*patches, *([base] if base is not None else [])], "patch")
    sink = output if stream is None else stream
    summary = squash_patches(patches, sink, base=base, force=force, options=options)
    if stream is not None:
        stream.finish()
    out.info(
        f"squashed {counted(summary.patches, 'patch', 'patches')} "
        f"({summary.input_bytes:,} bytes) into "
        f"{'stdout' if stdout else output} "
        f"({summary.patch_bytes:,} bytes); base {summary.base_fingerprint}, target "
        f"{summary.target_fingerprint}"
    )
