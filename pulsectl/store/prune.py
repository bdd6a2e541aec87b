"""prune: delete old steps, never leaving a kept step without the anchor and patches it needs.

Kept: the last ``keep_steps`` steps (always the latest) and the last ``keep_anchors`` anchors,
plus, for every kept step, each step on its patch chain back to a whole anchor. Manifests go
first (so no reader starts on a step whose objects are going), then the objects. Objects of steps up
to the last published one that no kept manifest names (left by an interrupted publish) go
too; nothing newer than the last manifest is touched, so a publish running meanwhile is safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pulsectl import _placed
from pulsectl.errors import UsageError
from pulsectl.store.base import Store, open_store
from pulsectl.store.catalog import Catalog
from pulsectl.store.layout import (
    ANCHORS_PREFIX,
    PATCHES_PREFIX,
    StepManifest,
    manifest_key,
    step_of_data_key,
)


@dataclass(frozen=True)
class PrunePlan:
    kept_steps: tuple[int, ...]
    deleted_steps: tuple[int, ...]
    deletions: tuple[tuple[str, int], ...]  # (key, size): manifests first, then objects

    @property
    def deleted_bytes(self) -> int:
        return sum(size for _, size in self.deletions)


def plan_prune(store: Store, keep_anchors: int, keep_steps: int) -> PrunePlan:
    """What ``prune`` would delete."""
    if keep_anchors < 0 or keep_steps < 0:
        raise UsageError("--keep-anchors and --keep-steps take 0 or more", option="--keep-steps")
    catalog = Catalog(store)
    catalog.require_store()
    manifests = {m.step: m for m in catalog.load_all()}
    if not manifests:
        return PrunePlan((), (), ())
    # The latest step is always kept: workers are on it, and publish numbers the next step
    # after it (dropping it would let a step number come back with other content).
    objects = store.list(ANCHORS_PREFIX) | store.list(PATCHES_PREFIX)
    kept: set[int] = set()
    for step in sorted(manifests)[-max(keep_steps, 1) :]:
        kept |= _path_steps(manifests, manifests[step], objects)
    anchors = [s for s in sorted(manifests) if manifests[s].anchor is not None]
    for step in anchors[-keep_anchors:] if keep_anchors else []:
        kept |= _path_steps(manifests, manifests[step], objects)

    deleted = sorted(s for s in manifests if s not in kept)
    steps_listing = store.list("steps/")
    deletions = [(manifest_key(s), steps_listing.get(manifest_key(s), 0)) for s in deleted]
    referenced = {f.key for s in kept for f in manifests[s].files}
    last = max(catalog.steps)
    for key, size in sorted(objects.items()):
        owner = step_of_data_key(key)
        if owner is None or owner > last or owner in catalog.damaged or key in referenced:
            continue
        deletions.append((key, size))
    return PrunePlan(tuple(sorted(kept)), tuple(deleted), tuple(deletions))


def prune(
    store: Store | str | Path, *, keep_anchors: int, keep_steps: int, dry_run: bool = False
) -> PrunePlan:
    """Delete what ``plan_prune`` lists (nothing with ``dry_run``)."""
    store = store if isinstance(store, Store) else open_store(store)
    plan = plan_prune(store, keep_anchors, keep_steps)
    if not dry_run and plan.deletions:
        # Newest first: a prune stopped part-way leaves a prefix of the dropped steps, each
        # still on its chain back to its anchor (oldest first left steps whose base was gone,
        # which log showed as healthy and pull could not rebuild).
        manifests = sorted((k for k, _ in plan.deletions if k.startswith("steps/")), reverse=True)
        _placed.done(
            f"while prune was deleting steps of {store.url} (the steps left are whole: run "
            "prune again to finish)"
        )
        store.delete(manifests)
        store.delete(k for k, _ in plan.deletions if not k.startswith("steps/"))
    return plan


def _path_steps(
    manifests: dict[int, StepManifest], m: StepManifest, objects: dict[str, int]
) -> set[int]:
    """``m`` and every step on its patch chain back to the nearest anchor whose objects are
    all in the store with their manifest's sizes (``objects``: key -> size, as listed). An
    anchor that is missing or cut short is no end of a route: the chain goes on past it, so
    that prune does not delete the one route left (the older anchor and its patches)."""
    out = {m.step}
    node = m
    while not _whole_anchor(node, objects) and node.patch is not None:
        prev = manifests.get(node.patch.base_step)
        if prev is None or prev.step in out:
            break
        out.add(prev.step)
        node = prev
    return out


def _whole_anchor(m: StepManifest, objects: dict[str, int]) -> bool:
    return m.anchor is not None and all(objects.get(f.key) == f.size for f in m.anchor)
