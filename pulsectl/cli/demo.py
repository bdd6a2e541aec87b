"""`pulsectl demo`: a realistic chain in a temp folder, diffed, applied and verified."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl.cli._output import Output


def demo(
    ctx: typer.Context,
    keep: Annotated[
        Path | None,
        typer.Option(
            "--keep", metavar="DIR", help="Build the demo in this new or empty folder and keep it."
        ),
    ] = None,
    shape: Annotated[
        str,
        typer.Option(
            "--shape",
            metavar="PRESET",
            help="Model preset: tiny, small, qwen2.5-0.5b (~1 GB a step), qwen2.5-7b (~15 GB).",
        ),
    ] = "small",
    steps: Annotated[
        int, typer.Option("--steps", metavar="N", min=1, max=50, help="Training steps.")
    ] = 3,
) -> None:
    """Build a small realistic checkpoint chain and run diff, apply and verify on it."""
    from pulsectl.demo import run_demo

    out: Output = ctx.obj
    run_demo(keep=keep, shape=shape, steps=steps, say=out.data)
