"""`pulsectl log STORE [--json]`."""

from __future__ import annotations

import typer

from pulsectl.cli._options import JsonFlag
from pulsectl.cli._output import Output
from pulsectl.cli._store_options import StoreUrl
from pulsectl.errors import escape_controls as shown


def log(ctx: typer.Context, store: StoreUrl, as_json: JsonFlag = False) -> None:
    """The published steps of STORE: kind, sizes, chain length, density."""
    from pulsectl.store.log import read_log

    out: Output = ctx.obj
    doc = read_log(store)
    if as_json:
        out.json(doc)
        return
    out.data(
        f"{'step':>8}  {'kind':<7} {'anchor':>14} {'patch':>12} {'chain':>5} {'density':>8}  "
        "fingerprint"
    )
    for s in doc["steps"]:
        if s["kind"] == "damaged":
            out.data(f"{s['step']:>8}  damaged  {s['error']}")  # a PulseError's: one line
            continue
        anchor = f"{s['anchor_bytes']:,}" if s["anchor_bytes"] is not None else "-"
        patch = f"{s['patch_bytes']:,}" if s["patch_bytes"] is not None else "-"
        density = f"{s['density']:.3%}" if s["density"] is not None else "-"
        note = f"  MISSING {shown(', '.join(s['missing']))}" if s["missing"] else ""
        if not s["reachable"]:
            note += "  UNREACHABLE (no whole chain back to an anchor)"
        out.data(
            f"{s['step']:>8}  {s['kind']:<7} {anchor:>14} {patch:>12} {s['chain_length']:>5} "
            f"{density:>8}  {s['target_fingerprint']}{note}"
        )
