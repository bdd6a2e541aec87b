"""Block patches (ParaBlock): one checkpoint update split into patches that apply on their own.

``diff_blocks`` splits the tensors by layer index into ``n`` contiguous groups of layers, plus
one patch for the tensors outside the layers (embeddings, final norm, head). Each is a block
patch (scope "tensors", docs/FORMAT.md): it binds only its own tensors, by their fingerprints,
so the patches apply in any order, each on its own, and all of them give the same bytes as one
full patch.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path

from pulsectl.checkpoint import Checkpoint
from pulsectl.diff import DiffOptions, DiffSummary, diff_to_path
from pulsectl.errors import OutputError, UsageError
from pulsectl.stats import layer_index


def block_groups(names: list[str], n: int) -> list[tuple[str, list[str]]]:
    """``(label, tensor names)`` for ``n`` groups of consecutive layers, then the rest."""
    if n < 1:
        raise UsageError("--blocks needs at least 1 block")
    layers = sorted({i for i in map(layer_index, names) if i is not None})
    if len(layers) < n:
        raise UsageError(f"--blocks {n}: the checkpoint has only {len(layers)} layers")
    groups: list[tuple[str, list[str]]] = []
    for b in range(n):
        chunk = set(layers[b * len(layers) // n : (b + 1) * len(layers) // n])
        groups.append((f"block{b}", [name for name in names if layer_index(name) in chunk]))
    rest = [name for name in names if layer_index(name) is None]
    if rest:
        groups.append(("rest", rest))
    return groups


def block_paths(out: Path, labels: list[str]) -> list[Path]:
    """``step.pulse`` -> ``step.block0.pulse``, ..., ``step.rest.pulse``."""
    stem = out.name[: -len(".pulse")] if out.name.endswith(".pulse") else out.name
    return [out.with_name(f"{stem}.{label}.pulse") for label in labels]


def diff_blocks(
    old: str | Path,
    new: str | Path,
    out: str | Path,
    n: int,
    *,
    force: bool = False,
    options: DiffOptions | None = None,
    durable: bool = False,
) -> list[tuple[Path, DiffSummary]]:
    """Write the update from ``old`` to ``new`` as ``n`` layer-block patches plus the rest."""
    options = options or DiffOptions()
    names = [t.name for _, t in Checkpoint.open(new).tensors()]
    groups = block_groups(names, n)
    paths = block_paths(Path(out), [label for label, _ in groups])
    if not force:
        for path in paths:
            if path.exists():
                raise OutputError(f"{path}: output exists; pass -f to overwrite", path=path)
    written = []
    for path, (_, members) in zip(paths, groups, strict=True):
        selected = dataclasses.replace(options, tensors=tuple(glob.escape(m) for m in members))
        summary = diff_to_path(old, new, path, force=force, options=selected, durable=durable)
        written.append((path, summary))
    return written
