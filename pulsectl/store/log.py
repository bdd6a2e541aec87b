"""log: the published steps of a store, with sizes, chain lengths and density."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pulsectl.store.base import Store, open_store
from pulsectl.store.catalog import Catalog
from pulsectl.store.layout import ANCHORS_PREFIX, PATCHES_PREFIX

LOG_SCHEMA = 1  # version of the JSON `pulsectl log --json` prints


def read_log(store: Store | str | Path) -> dict[str, Any]:
    """The documented `log --json` object: one entry per step, oldest first."""
    store = store if isinstance(store, Store) else open_store(store)
    catalog = Catalog(store)
    catalog.require_store()
    manifests = {m.step: m for m in catalog.load_all()}
    present = store.list(ANCHORS_PREFIX) | store.list(PATCHES_PREFIX)
    steps: list[dict[str, Any]] = []
    # Whether a step can be rebuilt from the store alone: an anchor with all its objects, or
    # a patch whose object is there on top of a reachable base of the right fingerprint. A
    # step whose own objects are all there can still be cut off (its base's manifest gone).
    reachable: dict[int, bool] = {}
    for step in catalog.steps:
        m = manifests.get(step)
        if m is None:
            steps.append({"step": step, "kind": "damaged", "error": catalog.damaged.get(step)})
            continue
        missing = [f.key for f in m.files if present.get(f.key) != f.size]
        patch = m.patch
        whole = m.anchor is not None and all(present.get(f.key) == f.size for f in m.anchor)
        base = manifests.get(patch.base_step) if patch is not None else None
        reachable[step] = whole or (
            patch is not None
            and present.get(patch.key) == patch.size
            and base is not None
            and base.target_fingerprint == patch.base_fingerprint
            and reachable.get(patch.base_step, False)
        )
        steps.append(
            {
                "step": step,
                "kind": m.kind,
                "target_fingerprint": m.target_fingerprint,
                "target_bytes": m.target_bytes,
                "anchor_bytes": m.anchor_bytes if m.anchor is not None else None,
                "patch_bytes": patch.size if patch is not None else None,
                "base_step": patch.base_step if patch is not None else None,
                "anchor_step": m.anchor_step,
                "chain_length": m.chain_length,
                "changed_words": patch.changed_words if patch is not None else None,
                "total_words": patch.total_words if patch is not None else None,
                "density": patch.changed_words / patch.total_words
                if patch is not None and patch.total_words
                else None,
                "cast": m.cast,
                "published": m.published,
                "missing": missing,
                "reachable": reachable[step],
            }
        )
    return {"schema": LOG_SCHEMA, "store": store.url, "steps": steps}
