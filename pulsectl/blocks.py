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
import re
from collections.abc import Callable
from pathlib import Path

from pulsectl._atomic import check_file_target, commit_outputs, file_path
from pulsectl.checkpoint import Checkpoint
from pulsectl.diff import DiffOptions, DiffSummary, diff_to_path, refuse_input_as_output
from pulsectl.errors import OutputError, UsageError
from pulsectl.format import MAGIC
from pulsectl.sources import FileSource
from pulsectl.stats import layer_index


def block_groups(names: list[str], n: int) -> list[tuple[str, list[str]]]:
    """``(label, tensor names)`` for ``n`` groups of consecutive layers, then the rest."""
    if n < 1:
        raise UsageError("--blocks needs at least 1 block", option="--blocks")
    layers = sorted({i for i in map(layer_index, names) if i is not None})
    if len(layers) < n:
        raise UsageError(
            f"--blocks {n}: the checkpoint has only {len(layers)} layers", option="--blocks"
        )
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
    return [out.with_name(f"{_stem(out)}.{label}.pulse") for label in labels]


def _stem(out: Path) -> str:
    return out.name[: -len(".pulse")] if out.name.endswith(".pulse") else out.name


def stale_blocks(out: Path, paths: list[Path]) -> list[Path]:
    """Block patches of an earlier ``--blocks`` run to ``out`` that this run does not write
    (it has fewer blocks, or no rest): ``STEM.blockN.pulse`` and ``STEM.rest.pulse`` files
    that are .pulse patches. Left beside the new set, a glob would pick them up."""
    pattern = re.compile(re.escape(_stem(out)) + r"\.(block[0-9]+|rest)\.pulse")
    found = []
    for path in sorted(out.parent.iterdir()) if out.parent.is_dir() else []:
        if path in paths or not pattern.fullmatch(path.name) or not path.is_file():
            continue
        with open(path, "rb") as f:
            if f.read(len(MAGIC)) == MAGIC:
                found.append(path)
    return found


def diff_blocks(
    old: str | Path,
    new: str | Path,
    out: str | Path,
    n: int,
    *,
    force: bool = False,
    options: DiffOptions | None = None,
    durable: bool = False,
    say: Callable[[str], None] | None = None,
) -> list[tuple[Path, DiffSummary]]:
    """Write the update from ``old`` to ``new`` as ``n`` layer-block patches plus the rest.

    The patches are one output: without ``force`` none of them, nor a block patch of an
    earlier run to ``out``, may exist; with it, those of an earlier run that this one does not
    write are removed once the new ones are written (``say`` is told of each)."""
    out = file_path(out, "patch")  # the name the block patches are named after
    options = options or DiffOptions()
    target_ckpt = Checkpoint.open(new)
    names = [t.name for _, t in target_ckpt.tensors()]
    groups = block_groups(names, n)
    paths = block_paths(out, [label for label, _ in groups])
    stale = stale_blocks(out, paths)
    if not force:
        for path in [*paths, *stale]:
            if path.exists():
                raise OutputError(f"{path}: output exists; pass -f to overwrite", path=path)
    for path in paths:  # every one before the first is written
        refuse_input_as_output(path, (old, new))
        check_file_target(path, force, "patch")  # a folder, a device in the way
    # The block patches are one output: each is written to a temp file and all are renamed
    # into place at the end, so an error halfway (a full disk) never leaves some new block
    # patches beside the old update's others, which `apply BASE out.*.pulse` would take as
    # one update.
    # Both checkpoints are opened, parsed and hashed once for all the patches (each patch
    # still names every fingerprint of the base and of the target).
    with (
        FileSource(Checkpoint.open(old), remember_scans=True, name=str(old)) as base,
        FileSource(target_ckpt, remember_scans=True, name=str(new)) as target,
    ):

        def writer(members: list[str]) -> Callable[[Path], DiffSummary]:
            selected = dataclasses.replace(options, tensors=tuple(glob.escape(m) for m in members))
            return lambda tmp: diff_to_path(
                base, target, tmp, force=True, options=selected, durable=durable
            )

        summaries = commit_outputs(
            [(path, writer(members)) for path, (_, members) in zip(paths, groups, strict=True)]
        )
    written = list(zip(paths, summaries, strict=True))
    for path in stale:
        path.unlink(missing_ok=True)
        if say is not None:
            say(f"{path}: removed (a block patch of an earlier run, not part of this one)")
    return written
