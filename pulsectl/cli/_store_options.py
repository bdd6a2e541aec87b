"""Option types shared by the store commands (publish, pull, log, prune)."""

from __future__ import annotations

from typing import Annotated

import typer

StoreUrl = Annotated[
    str,
    typer.Argument(
        metavar="STORE", help="A store: a folder or s3://BUCKET/PREFIX (docs/STORE.md)."
    ),
]
