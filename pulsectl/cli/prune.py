"""`pulsectl prune STORE --keep-anchors A --keep-steps S [--dry-run]`."""

from __future__ import annotations

from typing import Annotated

import typer

from pulsectl.cli._output import Output
from pulsectl.cli._store_options import StoreUrl
from pulsectl.errors import counted


def prune(
    ctx: typer.Context,
    store: StoreUrl,
    keep_anchors: Annotated[
        int, typer.Option("--keep-anchors", metavar="A", min=0, help="Keep the last A anchors.")
    ],
    keep_steps: Annotated[
        int,
        typer.Option(
            "--keep-steps",
            metavar="S",
            min=0,
            help="Keep the last S steps (the latest always), with everything they need.",
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", "-n", help="List what would be deleted; delete nothing.")
    ] = False,
) -> None:
    """Delete old steps of STORE; every kept step stays pullable. Deleted keys go to stdout."""
    from pulsectl.store.prune import prune as prune_store

    out: Output = ctx.obj
    plan = prune_store(store, keep_anchors=keep_anchors, keep_steps=keep_steps, dry_run=dry_run)
    for key, _size in plan.deletions:
        if dry_run:
            out.data(key)
        elif not out.report(key, f"{store} was pruned"):
            break  # the keys are gone whatever stdout does: one warning, and no more keys
    verb = "would delete" if dry_run else "deleted"
    out.info(
        f"{verb} {counted(len(plan.deleted_steps), 'step')}, "
        f"{counted(len(plan.deletions), 'object')}, {plan.deleted_bytes:,} bytes; "
        f"kept {counted(len(plan.kept_steps), 'step')}"
        + (f" ({plan.kept_steps[0]}..{plan.kept_steps[-1]})" if plan.kept_steps else "")
    )
