"""`pulsectl loco encode|reduce|step`: PULSELoCo pseudo-gradient exchange (docs/LOCO.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pulsectl.cli._command import Command
from pulsectl.cli._options import Force, JsonFlag
from pulsectl.cli._output import Output, smaller_than
from pulsectl.errors import counted

app = typer.Typer(
    name="loco",
    help=(
        "PULSELoCo: sparse FP32 pseudo-gradients with error feedback, for DiLoCo-style "
        "trainer-to-trainer sync (docs/LOCO.md)."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_VISIBLE_HELP = "Receiver precision of the gate: bf16, f16 or f8_e4m3."


@app.command("encode", cls=Command)
def encode(
    ctx: typer.Context,
    global_: Annotated[
        Path,
        typer.Option("--global", "-g", metavar="GLOBAL", help="Global FP32 weights (safetensors)."),
    ],
    local: Annotated[
        Path,
        typer.Option(
            "--local", "-l", metavar="LOCAL", help="This trainer's FP32 weights after H steps."
        ),
    ],
    residual: Annotated[
        str,
        typer.Option(
            "--residual",
            "-r",
            metavar="R",
            help="Error-feedback residual (safetensors); created if missing.",
        ),
    ],
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="PG", help="Sparse pseudo-gradient patch.")
    ],
    visible: Annotated[
        str, typer.Option("--visible", metavar="DTYPE", help=_VISIBLE_HELP)
    ] = "bf16",
    force: Force = False,
    as_json: JsonFlag = False,
) -> None:
    """Write the visible part of R + (GLOBAL - LOCAL) as a sparse patch; keep the rest in R."""
    from pulsectl.loco import encode_files

    out: Output = ctx.obj
    summary = encode_files(global_, local, residual, output, visible=visible, force=force)
    doc = summary.to_json()
    if as_json:
        out.report_json(doc, f"{output} and {residual} were written")
        return
    dense = smaller_than(summary.patch_bytes, doc["dense_bytes"], "dense FP32")
    out.info(
        f"sent {summary.sent:,} of {summary.total:,} values ({doc['density']:.3%}); "
        f"{output}: {summary.patch_bytes:,} bytes, {dense}; "
        f"residual {'created' if summary.residual_created else 'updated'}: {residual}"
    )


@app.command("reduce", cls=Command)
def reduce(
    ctx: typer.Context,
    patches: Annotated[
        list[Path],
        typer.Argument(metavar="PG...", help="The trainers' patches from `loco encode`."),
    ],
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="AVG", help="Averaged update to write.")
    ],
    dense: Annotated[
        bool, typer.Option("--dense", help="Write a safetensors file of F32 tensors instead.")
    ] = False,
    force: Force = False,
    as_json: JsonFlag = False,
) -> None:
    """Average the trainers' sparse pseudo-gradients (scatter-add, divide by their count)."""
    from pulsectl.loco import reduce_files

    out: Output = ctx.obj
    summary = reduce_files(patches, output, dense=dense, force=force)
    if as_json:
        out.report_json(summary.to_json(), f"{output} was written")
        return
    out.info(
        f"averaged {counted(summary.trainers, 'pseudo-gradient')}: {summary.sent:,} of "
        f"{summary.total:,} values nonzero; {output}: {summary.output_bytes:,} bytes"
    )


@app.command("step", cls=Command)
def step(
    ctx: typer.Context,
    global_: Annotated[
        Path,
        typer.Option("--global", "-g", metavar="GLOBAL", help="Global FP32 weights (safetensors)."),
    ],
    update: Annotated[
        Path,
        typer.Option(
            "--update",
            "-u",
            metavar="UPDATE",
            help="Averaged pseudo-gradient: a loco patch or safetensors.",
        ),
    ],
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="G2", help="New global weights.")
    ],
    momentum: Annotated[
        str | None,
        typer.Option(
            "--momentum",
            "-m",
            metavar="M",
            help="Nesterov momentum buffer (safetensors); created if missing.",
        ),
    ] = None,
    lr: Annotated[
        float, typer.Option("--lr", metavar="LR", help="Outer learning rate, > 0.")
    ] = 0.7,
    beta: Annotated[
        float, typer.Option("--beta", metavar="BETA", help="Outer Nesterov momentum, in [0, 1).")
    ] = 0.9,
    plain: Annotated[
        bool, typer.Option("--plain", help="Plain averaging: G2 = GLOBAL - UPDATE, no momentum.")
    ] = False,
    force: Force = False,
) -> None:
    """The outer step: Nesterov SGD on the averaged pseudo-gradient (or --plain averaging)."""
    from pulsectl.loco import step_files

    out: Output = ctx.obj
    step_files(
        global_,
        update,
        output,
        momentum_path=momentum,
        lr=lr,
        beta=beta,
        plain=plain,
        force=force,
    )
    how = "plain averaging" if plain else f"Nesterov lr {lr:g}, momentum {beta:g}"
    out.info(f"wrote {output} ({how})")
