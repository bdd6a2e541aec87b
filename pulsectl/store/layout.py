"""Object names and the per-step manifest of a patch store (docs/STORE.md mirrors this)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pulsectl._paths import paths_problem
from pulsectl.errors import FormatError

STORE_SCHEMA = 1  # version of the store layout and of the manifest JSON
MARKER_KEY = "pulse-store.json"  # written once, by the first publish; never rewritten
STEPS_PREFIX = "steps/"
PATCHES_PREFIX = "patches/"
ANCHORS_PREFIX = "anchors/"
STEP_DIGITS = 8
NAME_FINGERPRINT_DIGITS = 16  # the target fingerprint prefix in anchor and patch names

_MANIFEST_KEY = re.compile(r"^steps/(\d{8,})\.json$")
_DATA_KEY = re.compile(r"^(?:anchors|patches)/(\d{8,})-[0-9a-f]+(?:\.|/)")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")


def manifest_key(step: int) -> str:
    return f"{STEPS_PREFIX}{step:0{STEP_DIGITS}d}.json"


def patch_key(step: int, target_fingerprint: str, patch_fingerprint: str) -> str:
    """A patch's name also holds its own fingerprint's first digits: two publishers of one
    step (another --level, another base) write different bytes, and under one name the
    refused one would replace the patch the other published. (Names written before 2026-12-02 lack
    it; readers take every name from the manifest, and old prunes still match the new ones.)"""
    own = patch_fingerprint[:NAME_FINGERPRINT_DIGITS]
    return f"{PATCHES_PREFIX}{_stem(step, target_fingerprint)}.{own}.pulse"


def anchor_key(step: int, target_fingerprint: str, layout: str, relpath: str = "") -> str:
    """A single-file anchor is one object; a folder anchor is one object per file below a prefix."""
    stem = f"{ANCHORS_PREFIX}{_stem(step, target_fingerprint)}"
    return f"{stem}.safetensors" if layout == "file" else f"{stem}/{relpath}"


def step_of_manifest_key(key: str) -> int | None:
    m = _MANIFEST_KEY.match(key)
    return int(m.group(1)) if m else None


def step_of_data_key(key: str) -> int | None:
    """The step an anchor or patch object belongs to, from its name (None for other names)."""
    m = _DATA_KEY.match(key)
    return int(m.group(1)) if m else None


def _stem(step: int, fingerprint: str) -> str:
    return f"{step:0{STEP_DIGITS}d}-{fingerprint[:NAME_FINGERPRINT_DIGITS]}"


def canonical_json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class StoredFile:
    """One object of the store: its key, its path inside the checkpoint, size and fingerprint."""

    key: str
    path: str  # "" for a single-file checkpoint or a patch
    size: int
    fingerprint: str  # xxh3-128 of the object's bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "path": self.path,
            "size": self.size,
            "fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class PatchRef:
    """The patch that turns step ``base_step`` into this step."""

    file: StoredFile
    base_step: int
    base_fingerprint: str
    changed_words: int
    total_words: int

    @property
    def key(self) -> str:
        return self.file.key

    @property
    def size(self) -> int:
        return self.file.size


@dataclass(frozen=True)
class StepManifest:
    """What one published step holds: an anchor (full checkpoint), a patch, or both."""

    step: int
    layout: str  # "file" or "dir"
    target_fingerprint: str
    target_bytes: int
    anchor: tuple[StoredFile, ...] | None
    patch: PatchRef | None
    anchor_step: int  # the nearest anchor at or before this step along the chain
    chain_length: int  # patches from anchor_step to this step (0 for an anchor)
    cast: str | None  # "bf16" when the store holds casts (`publish --as bf16`)
    writer: str
    published: str  # UTC time, informational

    @property
    def kind(self) -> str:
        return "anchor" if self.anchor is not None else "patch"

    @property
    def anchor_bytes(self) -> int:
        return sum(f.size for f in self.anchor) if self.anchor is not None else 0

    @property
    def files(self) -> list[StoredFile]:
        out = list(self.anchor or ())
        if self.patch is not None:
            out.append(self.patch.file)
        return out

    def to_json(self) -> dict[str, Any]:
        patch = None
        if self.patch is not None:
            patch = {
                **self.patch.file.to_json(),
                "base_step": self.patch.base_step,
                "base_fingerprint": self.patch.base_fingerprint,
                "changed_words": self.patch.changed_words,
                "total_words": self.patch.total_words,
            }
            del patch["path"]
        return {
            "schema": STORE_SCHEMA,
            "step": self.step,
            "kind": self.kind,
            "layout": self.layout,
            "target": {"fingerprint": self.target_fingerprint, "bytes": self.target_bytes},
            "anchor": None
            if self.anchor is None
            else {"files": [f.to_json() for f in self.anchor]},
            "patch": patch,
            "chain": {"anchor_step": self.anchor_step, "length": self.chain_length},
            "cast": self.cast,
            "writer": self.writer,
            "published": self.published,
        }

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_json())


def manifest_from_bytes(data: bytes, key: str, shown: str | None = None) -> StepManifest:
    """Parse and check the manifest stored under ``key`` (``steps/00000042.json``: the step it
    must describe); FormatError naming it as ``shown`` (default ``key``) when it is not one."""
    name = shown or key

    def fail(what: str) -> FormatError:
        return FormatError(f"{name}: not a valid step manifest: {what}", path=name)

    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:  # ValueError: also an int of 4300+ digits
        raise fail(f"bad JSON ({exc})") from None
    except RecursionError:
        raise fail("bad JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise fail("not a JSON object")
    try:
        if doc["schema"] != STORE_SCHEMA:
            raise fail(f"schema {doc['schema']!r}; this pulsectl reads schema {STORE_SCHEMA}")
        step = _int(doc["step"], "step", fail)
        if step_of_manifest_key(key) not in (None, step):
            raise fail(f"it describes step {step}")
        layout = doc["layout"]
        if layout not in ("file", "dir"):
            raise fail(f"layout {layout!r}")
        target_fp = _fp(doc["target"]["fingerprint"], "target.fingerprint", fail)
        anchor = None
        if doc["anchor"] is not None:
            anchor = tuple(_stored(f, fail) for f in doc["anchor"]["files"])
            if not anchor:
                raise fail("an anchor without files")
            # pull writes the anchor's files at these paths: nothing may climb out of its folder.
            problem = paths_problem([f.path for f in anchor], layout)
            if problem is not None:
                raise fail(f"anchor files: {problem}")
        patch = None
        if doc["patch"] is not None:
            p = doc["patch"]
            patch = PatchRef(
                _stored({**p, "path": ""}, fail),
                _int(p["base_step"], "patch.base_step", fail),
                _fp(p["base_fingerprint"], "patch.base_fingerprint", fail),
                _int(p["changed_words"], "patch.changed_words", fail),
                _int(p["total_words"], "patch.total_words", fail),
            )
            if patch.base_step >= step:
                raise fail("its patch's base step is not before it")
        if anchor is None and patch is None:
            raise fail("neither an anchor nor a patch")
        manifest = StepManifest(
            step=step,
            layout=layout,
            target_fingerprint=target_fp,
            target_bytes=_int(doc["target"]["bytes"], "target.bytes", fail),
            anchor=anchor,
            patch=patch,
            anchor_step=_int(doc["chain"]["anchor_step"], "chain.anchor_step", fail),
            chain_length=_int(doc["chain"]["length"], "chain.length", fail),
            cast=_cast(doc["cast"], fail),
            writer=str(doc["writer"]),
            published=str(doc["published"]),
        )
    except (KeyError, TypeError) as exc:
        raise fail(f"missing or mistyped field {exc}") from None
    if manifest.kind != doc.get("kind"):
        raise fail(f"kind {doc.get('kind')!r} does not match its contents")
    return manifest


def _int(value: Any, name: str, fail: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise fail(f"{name} is {value!r}, not a non-negative integer")
    return value


def _cast(value: Any, fail: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise fail(f"cast is {value!r}, not a dtype name or null")
    return value


def _fp(value: Any, name: str, fail: Any) -> str:
    if not isinstance(value, str) or not _HEX32.match(value):
        raise fail(f"{name} is {value!r}, not a 32-digit fingerprint")
    return value


def _stored(doc: Any, fail: Any) -> StoredFile:
    key = doc["key"]
    if not isinstance(key, str) or not key.startswith((ANCHORS_PREFIX, PATCHES_PREFIX)):
        raise fail(f"file key {key!r} is not under {ANCHORS_PREFIX} or {PATCHES_PREFIX}")
    if ".." in key.split("/") or "\\" in key or "\0" in key:
        raise fail(f"file key {key!r} is not a plain relative name")
    path = doc["path"]
    if not isinstance(path, str):
        raise fail(f"file path {path!r} is not a string")
    return StoredFile(
        key,
        path,
        _int(doc["size"], "size", fail),
        _fp(doc["fingerprint"], "fingerprint", fail),
    )
