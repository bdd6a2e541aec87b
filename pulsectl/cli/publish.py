"""`pulsectl publish STORE CKPT [--step N] [--anchor-every K] [--as bf16]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl._names import (
    CACHE_ENV,
    DEFAULT_ANCHOR_EVERY,
    DEFAULT_LEVEL,
    DEFAULT_MAX_PATCH_FRACTION,
)
from pulsectl.cli._options import Checkpoint, Workers, check_cast_target
from pulsectl.cli._output import Output
from pulsectl.cli._store_options import StoreUrl
from pulsectl.cli.diff import parse_level, warn_of_linked_folders


def publish(
    ctx: typer.Context,
    store: StoreUrl,
    checkpoint: Checkpoint,
    step: Annotated[
        int | None,
        typer.Option(
            "--step",
            "-s",
            metavar="N",
            min=0,
            help="Step number (default: the last published + 1).",
        ),
    ] = None,
    anchor_every: Annotated[
        int,
        typer.Option(
            "--anchor-every",
            "-k",
            metavar="K",
            min=0,
            help="A full anchor at every multiple of K, and whenever the chain since the last "
            "anchor would pass K patches (0: only when needed).",
        ),
    ] = DEFAULT_ANCHOR_EVERY,
    max_patch_fraction: Annotated[
        float,
        typer.Option(
            "--max-patch-fraction",
            metavar="F",
            help="Publish an anchor instead of a patch over this fraction of the checkpoint.",
        ),
    ] = DEFAULT_MAX_PATCH_FRACTION,
    anchor: Annotated[
        bool, typer.Option("--anchor", help="Publish a full anchor at this step.")
    ] = False,
    as_dtype: Annotated[
        str | None,
        typer.Option(
            "--as", metavar="DTYPE", help="Publish the cast (bf16, f16, f8_e4m3, f8_e5m2) of CKPT."
        ),
    ] = None,
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache",
            metavar="DIR",
            help="Folder for the local copy of the last published step (default: "
            f"publish/<hash of the store> under ${CACHE_ENV}, else under "
            "$XDG_CACHE_HOME/pulsectl or ~/.cache/pulsectl).",
        ),
    ] = None,
    level: Annotated[
        str,
        typer.Option("--level", "-l", metavar="LEVEL", help="Patch level, as in `pulsectl diff`."),
    ] = str(DEFAULT_LEVEL),
    workers: Workers = None,
) -> None:
    """Add CKPT to STORE as the next step: a patch against the last step, or a full anchor."""
    from pulsectl._io import default_workers
    from pulsectl.store.publish import PublishOptions
    from pulsectl.store.publish import publish as publish_step

    out: Output = ctx.obj
    check_cast_target(as_dtype)
    warn_of_linked_folders(out, checkpoint, "the store")
    options = PublishOptions(
        anchor_every=anchor_every,
        max_patch_fraction=max_patch_fraction,
        cast=as_dtype,
        anchor=anchor,
        cache_dir=cache,
        diff=parse_level(level, workers or default_workers()),
    )
    summary = publish_step(store, checkpoint, step=step, options=options, log=out.info)
    m = summary.manifest
    out.report(
        f"{m.step} {m.kind} {m.target_fingerprint}", f"step {m.step} was published to {store}"
    )
    if summary.cache_problem:
        out.warn(summary.cache_problem)
