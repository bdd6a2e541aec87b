"""The published steps of a store: the manifest listing, loaded lazily and cached."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pulsectl.errors import FormatError, InputError, IntegrityError
from pulsectl.store.base import MissingObjectError, Store
from pulsectl.store.layout import (
    MARKER_KEY,
    STEPS_PREFIX,
    StepManifest,
    manifest_from_bytes,
    manifest_key,
    step_of_manifest_key,
)

FETCH_THREADS = 16


class Catalog:
    """Step numbers from one listing of ``steps/``; manifests read on demand."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.steps: list[int] = sorted(
            s for s in map(step_of_manifest_key, store.list(STEPS_PREFIX)) if s is not None
        )
        self._listed = set(self.steps)
        self._manifests: dict[int, StepManifest] = {}
        self.damaged: dict[int, str] = {}  # step -> why its manifest cannot be used

    def require_store(self) -> None:
        """InputError unless the store is one: it has steps, or the marker the first publish
        writes. A mistyped path or prefix is an error here, not an empty store."""
        if not self.steps and not self.store.exists(MARKER_KEY):
            raise InputError(
                f"{self.store.url}: not a pulsectl store (no {MARKER_KEY} and no published "
                "step); check the path",
                path=self.store.url,
            )

    @property
    def latest_step(self) -> int | None:
        return self.steps[-1] if self.steps else None

    def get(self, step: int) -> StepManifest | None:
        """The manifest of ``step``; None when it is absent or damaged (see ``damaged``)."""
        if step in self._manifests:
            return self._manifests[step]
        if step in self.damaged or step not in self._listed:
            return None
        try:
            key = manifest_key(step)
            manifest = manifest_from_bytes(self.store.read(key), key, self.store.where(key))
        except (MissingObjectError, FormatError, IntegrityError) as exc:
            # pruned meanwhile, not a manifest, or bytes that fail S3's checksum every time
            self.damaged[step] = str(exc)
            return None
        self._manifests[step] = manifest
        return manifest

    def latest(self) -> StepManifest | None:
        """The highest step whose manifest reads; None for an empty store."""
        for step in reversed(self.steps):
            manifest = self.get(step)
            if manifest is not None:
                return manifest
        return None

    def load_all(self) -> list[StepManifest]:
        """Every readable manifest, in step order (fetched in parallel)."""
        todo = [s for s in self.steps if s not in self._manifests and s not in self.damaged]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(FETCH_THREADS, len(todo))) as pool:
                list(pool.map(self.get, todo))
        return [m for m in (self.get(s) for s in self.steps) if m is not None]

    def find_fingerprint(self, fingerprint: str) -> StepManifest | None:
        """A step whose target has ``fingerprint`` (the latest such step)."""
        for manifest in reversed(self.load_all()):
            if manifest.target_fingerprint == fingerprint:
                return manifest
        return None
