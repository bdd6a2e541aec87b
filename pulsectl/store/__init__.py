"""Patch stores: publish and pull checkpoint chains over a folder, rsync or S3 (docs/STORE.md)."""

from pulsectl.store.base import MissingObjectError, StepUnreachableError, Store, open_store
from pulsectl.store.catalog import Catalog
from pulsectl.store.layout import StepManifest, StoredFile
from pulsectl.store.log import read_log
from pulsectl.store.prune import PrunePlan, plan_prune, prune
from pulsectl.store.publish import PublishOptions, PublishSummary, publish
from pulsectl.store.pull import PullSummary, pull

__all__ = [
    "Catalog",
    "MissingObjectError",
    "PrunePlan",
    "PublishOptions",
    "PublishSummary",
    "PullSummary",
    "StepManifest",
    "StepUnreachableError",
    "Store",
    "StoredFile",
    "open_store",
    "plan_prune",
    "prune",
    "publish",
    "pull",
    "read_log",
]
