"""`pulsectl stats OLD NEW | PATCH | C0 C1 ... Cn [--k 1,2,4,8] [--json] [--plot FILE.png]`."""

from __future__ import annotations

import codecs
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from pulsectl._names import DEFAULT_KS
from pulsectl.cli._options import FindDevice, Force, JsonFlag, Workers, check_cast_target
from pulsectl.cli._output import Output, smaller_than
from pulsectl.errors import UsageError, counted
from pulsectl.errors import escape_controls as shown

_BAR_WIDTH = 24
_EIGHTHS = " ▏▎▍▌▋▊▉"
_FULL = "█"


def stats(
    ctx: typer.Context,
    inputs: Annotated[
        list[str],
        typer.Argument(
            metavar="INPUT...",
            help="OLD NEW (two checkpoints), PATCH (one .pulse file, '-' for stdin) or a chain "
            "C0 C1 ... Cn (three or more checkpoints, or two with --k).",
        ),
    ],
    as_dtype: Annotated[
        str | None,
        typer.Option(
            "--as", metavar="DTYPE", help="Compare the casts (bf16, f16, f8_e4m3, f8_e5m2)."
        ),
    ] = None,
    k: Annotated[
        str | None,
        typer.Option(
            "--k",
            metavar="KS",
            help=f"Chain steps k, comma-separated (default for a chain: "
            f"{','.join(map(str, DEFAULT_KS))}).",
        ),
    ] = None,
    as_json: JsonFlag = False,
    plot: Annotated[
        str | None,
        typer.Option(
            "--plot",
            metavar="PNG",
            help="Also draw the figures to this PNG (needs matplotlib: the plot extra).",
        ),
    ] = None,
    top: Annotated[
        int,
        typer.Option("--top", metavar="N", min=0, help="Tensors listed, most changes first."),
    ] = 10,
    workers: Workers = None,
    device: FindDevice = "auto",
    force: Force = False,
) -> None:
    """Changed words, density, patch size and word-delta histogram, by layer and kind."""
    from pulsectl.device import resolve
    from pulsectl.stats import (
        chain_stats,
        check_plot_target,
        pair_stats,
        parse_ks,
        patch_stats,
        plot_stats,
    )

    out: Output = ctx.obj
    check_cast_target(as_dtype)
    if plot is not None:  # before any work: an existing file needs -f, an input never goes
        check_plot_target(plot, inputs, force)
    if len(inputs) == 1:
        if Path(inputs[0]).is_dir() or inputs[0].endswith(".safetensors"):
            raise UsageError(
                f"{inputs[0]}: one checkpoint has no update to count; give OLD NEW, a PATCH, "
                "or a chain C0 C1 ... Cn"
            )
        if as_dtype is not None or k is not None:
            raise UsageError(
                "--as and --k need checkpoints, not a patch",
                option="--as" if as_dtype is not None else "--k",
            )
        doc = patch_stats(inputs[0]).to_json()
    elif len(inputs) == 2 and k is None:
        doc = pair_stats(
            inputs[0], inputs[1], as_dtype=as_dtype, workers=workers, device=resolve(device)
        ).to_json()
    else:
        ks = parse_ks(k) if k is not None else DEFAULT_KS
        doc = chain_stats(
            inputs, ks, as_dtype=as_dtype, workers=workers, device=resolve(device)
        ).to_json()
    if plot is not None:
        plot_stats(doc, plot, force=force)
        out.info(f"wrote {plot}")
    if as_json:
        out.json(doc)
    elif doc["source"] == "chain":
        _show_chain(out, doc)
    else:
        _show_update(out, doc, top)


def _bar(value: float, largest: float) -> str:
    if largest <= 0:
        return ""
    if not _blocks_shown():  # one "#" per cell, rounded
        return "#" * round(_BAR_WIDTH * value / largest)
    eighths = round(_BAR_WIDTH * 8 * value / largest)
    return _FULL * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")


def _blocks_shown() -> bool:
    """Whether stdout's encoding has the block characters of the bars (UTF-8 has; a stdout
    forced to ASCII, or a legacy locale, may not: the bars are then drawn with '#')."""
    try:
        codecs.encode(_FULL + _EIGHTHS, getattr(sys.stdout, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _table(title: str, columns: list[str]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, justify="left" if col in ("", "tensor", "kind", "bar") else "right")
    return table


def _show_update(out: Output, doc: dict[str, Any], top: int) -> None:
    total = doc["total"]
    inputs = doc["inputs"]
    if doc["source"] == "patch":
        what = f"patch {shown(inputs['patch'])}"
    else:
        cast = f" (as {inputs['as']})" if inputs["as"] else ""
        what = f"{shown(inputs['old'])} -> {shown(inputs['new'])}{cast}"
    changed = sum(1 for t in doc["tensors"] if t["changed_words"])
    lines = [
        f"update         {what}",
        f"changed words  {total['changed_words']:,} of {total['words']:,} "
        f"({total['density']:.4%}) in {changed:,} of {counted(total['tensors'], 'tensor')}",
    ]
    if total["patch_bytes"] is not None:
        per = total["bytes_per_change"]
        lines.append(
            f"patch          {total['patch_bytes']:,} bytes"
            + (f", {per:.2f} B per changed word" if per is not None else "")
            + f", {_smaller(total)}"
        )
    out.data("\n".join(lines))

    hist = total["histogram"]
    changed = total["changed_words"]
    table = _table("word deltas (|new - old| in ULPs)", ["delta", "words", "share", "bar"])
    largest = max(hist.values(), default=0)
    from pulsectl.stats import BUCKETS, NO_DELTA

    for key in (*BUCKETS, NO_DELTA):
        if key == NO_DELTA and not hist[key]:
            continue
        share = f"{hist[key] / changed:.1%}" if changed else "-"
        label = "stored whole" if key == NO_DELTA else key
        table.add_row(label, f"{hist[key]:,}", share, _bar(hist[key], largest))
    out.rich(table)

    for by, title in (("layer", "by layer"), ("kind", "by kind")):
        groups = doc[f"by_{by}"]
        table = _table(title, [by, "tensors", "words", "changed", "density", "bytes", "bar"])
        largest = max((g["density"] for g in groups), default=0.0)
        for g in groups:
            key = g[by]
            table.add_row(
                "-" if key is None else shown(str(key)),
                str(g["tensors"]),
                f"{g['words']:,}",
                f"{g['changed_words']:,}",
                f"{g['density']:.3%}",
                "-" if g["encoded_bytes"] is None else f"{g['encoded_bytes']:,}",
                _bar(g["density"], largest),
            )
        out.rich(table)

    if top > 0:
        table = _table(f"most changed tensors (top {top})", ["tensor", "changed", "density"])
        ranked = sorted(doc["tensors"], key=lambda t: (-t["changed_words"], t["name"]))
        for t in ranked[:top]:
            table.add_row(shown(t["name"]), f"{t['changed_words']:,}", f"{t['density']:.3%}")
        out.rich(table)


def _show_chain(out: Output, doc: dict[str, Any]) -> None:
    n = len(doc["inputs"]["checkpoints"])
    cast = f", as {doc['inputs']['as']}" if doc["inputs"]["as"] else ""
    out.data(f"chain          {n} checkpoints{cast}")
    table = _table(
        "k-step density: diff(C_i, C_i+k) over every window",
        ["k", "windows", "mean", "min", "max", "sparsity", "bar"],
    )
    steps = doc["steps"]
    largest = max((s["mean_density"] or 0.0 for s in steps), default=0.0)
    for s in steps:
        if not s["windows"]:
            table.add_row(str(s["k"]), "0", "-", "-", "-", "-", "")
            continue
        table.add_row(
            str(s["k"]),
            str(s["windows"]),
            f"{s['mean_density']:.3%}",
            f"{s['min_density']:.3%}",
            f"{s['max_density']:.3%}",
            f"{1 - s['mean_density']:.2%}",
            _bar(s["mean_density"], largest),
        )
    out.rich(table)


def _smaller(total: dict[str, Any]) -> str:
    """The patch against what it covers: the target, or a block patch's own tensors."""
    covered = total["covered_bytes"]
    if covered == total["target_bytes"]:
        return smaller_than(total["patch_bytes"], covered)
    return smaller_than(total["patch_bytes"], covered, "its tensors")
