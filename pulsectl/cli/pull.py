"""`pulsectl pull STORE -o CKPT [--step N|latest]`."""

from __future__ import annotations

from typing import Annotated

import typer

from pulsectl._names import DEFAULT_PREFETCH
from pulsectl.cli._options import Fsync, Workers
from pulsectl.cli._output import Output
from pulsectl.cli._store_options import StoreUrl
from pulsectl.errors import UsageError, counted


def pull(
    ctx: typer.Context,
    store: StoreUrl,
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="CKPT",
            help="The checkpoint to write; when it already holds a step of STORE, the rebuild "
            "starts from it.",
        ),
    ],
    step: Annotated[
        str, typer.Option("--step", "-s", metavar="N", help="Step number, or 'latest'.")
    ] = "latest",
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            "-f",
            help="Replace CKPT even when it holds no step of STORE (one that does is replaced "
            "without -f).",
        ),
    ] = False,
    prefetch: Annotated[
        int,
        typer.Option(
            "--prefetch", metavar="N", min=1, help="Objects fetched ahead of the one applying."
        ),
    ] = DEFAULT_PREFETCH,
    workers: Workers = None,
    fsync: Fsync = False,
) -> None:
    """Rebuild a step of STORE at CKPT: from CKPT or an anchor, verified, atomically."""
    from pulsectl.store.pull import pull as pull_step

    out: Output = ctx.obj
    number = parse_step(step)
    summary = pull_step(
        store,
        output,
        step=number,
        force=force,
        workers=workers,
        prefetch=prefetch,
        log=out.info,
        durable=fsync,
    )
    if summary.patches or summary.fetched_bytes:
        out.info(
            f"wrote {summary.output} (step {summary.step}, fingerprint {summary.fingerprint}) "
            f"from the {summary.start} and {counted(summary.patches, 'patch', 'patches')}, "
            f"{summary.fetched_bytes:,} bytes fetched, verified"
        )
    out.report(f"{summary.step} {summary.fingerprint}", f"{summary.output} was written")


def parse_step(text: str) -> int | None:
    if text.strip().lower() == "latest":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"--step {text!r}: give a step number or 'latest'", option="--step")
    return value
