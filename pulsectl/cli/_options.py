"""Option types shared by several commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite OUT if it exists.")]
Workers = Annotated[
    int | None,
    typer.Option("--workers", "-j", min=1, help="Worker threads (default: all cores, max 16)."),
]
Checkpoint = Annotated[
    Path, typer.Argument(help="A .safetensors file or a Hugging Face checkpoint folder.")
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]
