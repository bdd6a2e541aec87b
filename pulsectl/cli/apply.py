"""`pulsectl apply BASE PATCH [PATCH ...] -o OUT | --in-place`."""

from __future__ import annotations

from typing import Annotated

import typer

from pulsectl.cli._options import BaseCheckpoint, Force, Fsync, Workers, device_option
from pulsectl.cli._output import Output
from pulsectl.errors import counted


def apply(
    ctx: typer.Context,
    base: BaseCheckpoint,
    patches: Annotated[
        list[str],
        typer.Argument(
            metavar="PATCH...", help="Patches in chain order; '-' reads one from stdin."
        ),
    ],
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", metavar="OUT", help="Where to write the result."),
    ] = None,
    in_place: Annotated[
        bool, typer.Option("--in-place", help="Replace BASE with the result (atomically).")
    ] = False,
    force: Force = False,
    fsync: Fsync = False,
    workers: Workers = None,
    device: Annotated[str, device_option("decoded changes are scattered into the base")] = "cpu",
) -> None:
    """Apply a chain of patches to BASE; the result is verified before it appears at OUT."""
    from pulsectl.apply import apply_patches
    from pulsectl.device import resolve

    out: Output = ctx.obj
    with out.progress("apply") as progress:
        summary = apply_patches(
            base,
            patches,
            output,
            in_place=in_place,
            force=force,
            workers=workers,
            progress=progress,
            durable=fsync,
            device=resolve(device),
            on_wait=out.info,
        )
    out.info(
        f"wrote {summary.output} ({summary.target_bytes:,} bytes, fingerprint "
        f"{summary.target_fingerprint}) from {counted(summary.patches, 'patch', 'patches')}, "
        "verified"
    )
