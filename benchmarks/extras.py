"""Sections of docs/BENCHMARKS.md from the other harnesses' JSON, when they have been run:

- OUT/overlap/overlap.json: `python benchmarks/overlap.py` (ParaBlock: transfer/compute overlap)
- OUT/gpu.json: `python benchmarks/gpu.py --json OUT/gpu.json` (live weights, CUDA or CPU)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def render(out: Path) -> str:
    parts = []
    overlap = out / "overlap" / "overlap.json"
    if overlap.exists():
        parts.append(_overlap(json.loads(overlap.read_text())))
    gpu = out / "gpu.json"
    parts.append(_gpu(json.loads(gpu.read_text()) if gpu.exists() else None))
    return "\n" + "\n".join(parts)


def _overlap(r: dict[str, Any]) -> str:
    lines = [
        "## Transfer/compute overlap and block patches (ParaBlock)",
        "",
        f"`python benchmarks/overlap.py` on a {r['size_bytes'] / 1e9:.2f} GB BF16 checkpoint pair "
        f"(~1% of words moved by one unit), patch {r['patch_bytes']:,} bytes, {r['cores']} cores. "
        "The patch goes through a pipe paced at each rate (fixed rates, and the one at which "
        "transfer takes as long as a local apply, measured first); *sequential* receives it "
        "whole, then "
        "applies it; *overlapped* is `pulsectl apply BASE -` reading the pipe; *ideal* is "
        "max(transfer, compute), where compute is `apply` from a local file, measured beside "
        f"each rate. Each figure is the median of {r.get('repeat', 3)} runs, each started with no "
        "old output and no dirty pages; "
        + (
            "in each round the four runs of a rate (compute, transfer, sequential, overlapped) "
            "take turns."
            if r.get("in_turn")
            else "the runs of each column were made one after another."
        ),
        "",
        "| MB/s | transfer s | compute s | sequential s | overlapped s | ideal s "
        "| overlapped / ideal | saved vs sequential | overlapped / ideal, fastest runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rates"]:
        runs = x.get("runs_s")
        best = (
            f"{min(runs['overlapped']) / max(min(runs['transfer']), min(runs['compute'])):.2f}"
            if runs
            else "—"
        )
        lines.append(
            f"| {x['rate_mb_s']:g} | {x['transfer_s']:.2f} | {x['compute_s']:.2f} | "
            f"{x['sequential_s']:.2f} | {x['overlapped_s']:.2f} | {x['ideal_s']:.2f} | "
            f"{x['overlapped_over_ideal']:.2f} | {x['saving_vs_sequential']:.0%} | {best} |"
        )
    within = all(x["overlapped_over_ideal"] <= 1.15 for x in r["rates"])
    similar = [x for x in r["rates"] if 0.5 <= x["transfer_s"] / x["compute_s"] <= 2]
    saved = all(x["saving_vs_sequential"] >= 0.30 for x in similar) if similar else None
    computes = [c for x in r["rates"] for c in x.get("runs_s", {}).get("compute", [])]
    if computes:
        lines += [
            "",
            f"Single runs of the same local `apply` (compute) took {min(computes):.2f}–"
            f"{max(computes):.2f} s across this benchmark: the spread of this shared machine, "
            "against which each figure above is a median. The last column compares the fastest "
            "of each kind of run instead (the targets below use the medians).",
        ]
    lines += [
        "",
        f"Targets: overlapped within 15% of the ideal at every rate: "
        f"**{'met' if within else 'not met'}**; at least 30% below sequential where transfer "
        f"and compute are of similar size (ratio 0.5-2): "
        f"**{'met' if saved else 'not met' if saved is not None else 'no such rate measured'}**.",
        "",
    ]
    b = r["blocks"]
    lines += [
        f"Block patches: `diff --blocks 4` wrote {b['patches']} patches ({b['bytes']:,} bytes in "
        f"all, against {r['patch_bytes']:,} for one patch). Applied together (one pass over the "
        f"checkpoint) they took {b['block_chain_apply_s']:.2f} s, one full patch "
        f"{b['one_patch_apply_s']:.2f} s.",
        "",
    ]
    return "\n".join(lines)


def _gpu(r: dict[str, Any] | None) -> str:
    lines = ["## Live weights on a GPU", ""]
    if r is None:
        return "\n".join(
            lines
            + [
                "Not measured on a GPU yet: no CUDA machine was available to this project's "
                "sessions. `python benchmarks/gpu.py` measures the issue's targets (live 7B state "
                "-> patch bytes <= 1 s, patch -> live GPU tensors <= 0.5 s, byte-identical to the "
                "CPU path) when run on one.",
                "",
            ]
        )
    cuda = [x for x in r["rows"] if x["device"] == "cuda"]
    if not cuda:
        lines.append(
            "Not measured on a GPU yet: no CUDA machine was available to this project's "
            "sessions. The same harness on the CPU (smaller shape, so the code path is exercised):"
        )
    lines += [
        "",
        f"`python benchmarks/gpu.py` ({r['machine']}, torch {r['torch']}):",
        "",
        "| device | shape | state | patch | live state -> patch | patch -> live tensors | exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        name = x["gpu"] or "CPU"
        lines.append(
            f"| {name} | {x['shape']} | {x['state_bytes'] / 1e9:.2f} GB | "
            f"{x['patch_bytes'] / 1e6:.2f} MB | {x['publish_s']:.2f} s | {x['apply_s']:.2f} s | "
            f"{x['exact']} |"
        )
    lines += ["", f"Patches identical across devices: {r['identical_across_devices']}.", ""]
    return "\n".join(lines)
