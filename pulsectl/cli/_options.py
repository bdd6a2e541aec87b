"""Option types shared by several commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite the output if it exists.")]
Workers = Annotated[
    int | None,
    typer.Option(
        "--workers",
        "-j",
        min=1,
        metavar="N",
        help="Worker threads (default: one per core, up to 16).",
    ),
]
_CKPT_HELP = "A .safetensors file or a Hugging Face checkpoint folder."
Checkpoint = Annotated[Path, typer.Argument(metavar="CKPT", help=_CKPT_HELP)]
OldCheckpoint = Annotated[Path, typer.Argument(metavar="OLD", help=_CKPT_HELP)]
NewCheckpoint = Annotated[Path, typer.Argument(metavar="NEW", help=_CKPT_HELP)]
BaseCheckpoint = Annotated[Path, typer.Argument(metavar="BASE", help=_CKPT_HELP)]
Fsync = Annotated[
    bool,
    typer.Option(
        "--fsync", help="fsync the output before renaming it into place (power-loss safe)."
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]


def device_option(what: str) -> Any:
    """``--device auto|cpu|cuda[:N]``; ``what`` says what runs on the device."""
    return typer.Option(
        "--device",
        metavar="DEVICE",
        help=f"auto, cpu or cuda[:N]: where {what} (auto: CUDA when torch sees a GPU, and "
        "the CPU should the GPU fail, e.g. out of memory). The result is the same on every "
        "device.",
    )


FindDevice = Annotated[str, device_option("changed words are found")]


def check_cast_target(value: str | None, option: str = "--as") -> None:
    """Refuse an unknown cast target (``--as int8``) before any work, naming the option."""
    if value is not None:
        from pulsectl.cast import target_dtype

        target_dtype(value, option=option)
