"""`pulsectl inspect PATCH [--json]`."""

from __future__ import annotations

from typing import Annotated

import typer

from pulsectl.cli._options import JsonFlag
from pulsectl.cli._output import Output
from pulsectl.errors import counted
from pulsectl.errors import escape_controls as shown


def inspect(
    ctx: typer.Context,
    patch: Annotated[str, typer.Argument(metavar="PATCH", help="A .pulse file, or '-' for stdin.")],
    as_json: JsonFlag = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Read the whole patch: every checksum, and each block's codec and size.",
        ),
    ] = False,
    top: Annotated[
        int,
        typer.Option("--top", metavar="N", min=0, help="Tensors listed, largest frames first."),
    ] = 20,
) -> None:
    """Show a patch's fingerprints, tensors, change counts and sizes."""
    from pulsectl.info import read_patch_info

    out: Output = ctx.obj
    info = read_patch_info(patch, check=check)
    doc = info.to_json()
    if as_json:
        out.json(doc)
        return
    from rich.table import Table

    lines = [
        f"patch          {shown(doc['patch'])} ({_size(doc['patch_bytes'])}, "
        f".pulse v{doc['format_version']}, "
        f"{shown(doc['writer'])}{', checksums verified' if doc['checked'] else ''})",
        f"layout         {doc['layout']}, {counted(len(doc['target']['files']), 'file')}, "
        f"{counted(len(doc['tensors']), 'item')}",
        f"base           {doc['base']['fingerprint']}",
        f"target         {doc['target']['fingerprint']} ({_size(doc['target']['bytes'])})",
        f"changed words  {doc['changed_words']:,} of {doc['total_words']:,} ({doc['density']:.4%})",
    ]
    if doc["patch_bytes"] and doc["scope"] == "tensors":  # a block patch: its own tensors
        covered = sum(t["nbytes"] for t in doc["tensors"])
        lines.append(
            f"ratio          {covered / doc['patch_bytes']:.1f}x "
            "(bytes of its tensors / patch bytes; a block patch)"
        )
    elif doc["patch_bytes"]:
        lines.append(
            f"ratio          {doc['target']['bytes'] / doc['patch_bytes']:.1f}x "
            "(target bytes / patch bytes)"
        )
    whole = [t for t in doc["tensors"] if t["name"] is not None and not t["from_base"]]
    if whole:  # new, reshaped or re-typed: nothing in the base to diff them against
        # Said by what the patch holds: a squash without --base also drops the reference of
        # a tensor reshaped and reshaped back within its chain, though the base has it.
        lines.append(
            f"carried whole  {counted(len(whole), 'tensor')} stored without a base reference "
            "(new, reshaped or re-typed; in a squashed chain, at some step) "
            f"({sum(t['encoded_bytes'] for t in whole):,} bytes of frames)"
        )
    out.data("\n".join(lines))
    table = Table(title=f"largest frames (top {top})")
    for col in ("tensor", "dtype", "shape", "changed", "density", "bytes", "B/change"):
        table.add_column(col, justify="left" if col in ("tensor", "dtype", "shape") else "right")
    for t in sorted(doc["tensors"], key=lambda t: -t["encoded_bytes"])[:top]:
        words = t["words"]
        changed = t["changed_words"]
        table.add_row(
            shown(t["name"] or t["file"]),
            t["dtype"] or "blob",
            shape_text(t["shape"]),
            f"{changed:,}",
            f"{changed / words:.3%}" if words else "-",
            f"{t['encoded_bytes']:,}",
            f"{t['encoded_bytes'] / changed:.2f}" if changed else "-",
        )
    if top > 0:
        out.rich(table)


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def shape_text(shape: list[int] | None) -> str:
    """A tensor's shape as the tables show it: 4096x64, 'scalar' for a 0-d tensor, '' for a
    blob."""
    if shape is None:
        return ""
    return "x".join(map(str, shape)) if shape else "scalar"
