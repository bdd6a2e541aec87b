"""What a patch says, as typed objects: the header and trailer of docs/FORMAT.md, validated.

The container (pulsectl.format) carries them as canonical JSON; this module turns that JSON
into ``PatchHeader``/``PatchTrailer`` and refuses anything inconsistent, so the apply pipeline
can trust every index, size and path it reads from a patch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, cast

from pulsectl._dtypes import DTYPES
from pulsectl._paths import paths_problem
from pulsectl.checkpoint import SafetensorsHeader, parse_header
from pulsectl.errors import CorruptPatchError, FormatError, IntegrityError
from pulsectl.format import MAX_BLOCK_BYTES, MIN_BLOCK_BYTES

_HEX128 = re.compile(r"[0-9a-f]{32}\Z")
_WORDS = (1, 2, 4, 8)


@dataclass(frozen=True)
class FileRef:
    """A file of a checkpoint as the patch knows it."""

    path: str
    size: int
    fingerprint: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class TargetFile:
    """A file the patch produces: a safetensors file (header stored) or a blob."""

    path: str
    kind: Literal["safetensors", "blob"]
    size: int
    header: SafetensorsHeader | None  # parsed from ``header_raw`` for safetensors files

    def to_json(self) -> dict[str, Any]:
        if self.header is None:
            return {"path": self.path, "kind": "blob", "size": self.size}
        return {"path": self.path, "kind": "safetensors", "header": self.header.raw.decode()}


@dataclass(frozen=True)
class Item:
    """One frame's worth of output: a tensor of a target file, or a whole blob."""

    file: int  # index into PatchHeader.files
    name: str | None  # tensor name; None for a blob
    start: int  # byte offset of the item in its target file
    nbytes: int
    word: int
    base_file: int | None  # index into PatchHeader.base_files, None when carried whole
    base_name: str | None
    base_fingerprint: str | None

    @property
    def label(self) -> str:
        return self.name if self.name is not None else "<file>"

    def to_json(self) -> dict[str, Any]:
        base = None
        if self.base_file is not None:
            base = {"file": self.base_file, "name": self.base_name}
        return {
            "file": self.file,
            "name": self.name,
            "nbytes": self.nbytes,
            "word": self.word,
            "base": base,
            "base_fingerprint": self.base_fingerprint,
        }


@dataclass(frozen=True)
class PatchHeader:
    layout: Literal["file", "dir"]
    block_bytes: int
    writer: str
    base_fingerprint: str
    base_files: tuple[FileRef, ...]
    files: tuple[TargetFile, ...]
    items: tuple[Item, ...]
    # "checkpoint": the patch turns the whole base into the whole target. "tensors" (a block
    # patch): it replaces only its items' tensors, each bound by its own base fingerprint, in a
    # checkpoint whose files and headers stay as they are.
    scope: Literal["checkpoint", "tensors"] = "checkpoint"

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"scope": self.scope} if self.scope != "checkpoint" else {}
        return {
            **extra,
            "layout": self.layout,
            "block_bytes": self.block_bytes,
            "writer": self.writer,
            "base": {
                "fingerprint": self.base_fingerprint,
                "files": [f.to_json() for f in self.base_files],
            },
            "files": [f.to_json() for f in self.files],
            "items": [i.to_json() for i in self.items],
        }

    @property
    def target_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class ItemResult:
    fingerprint: str
    changed: int  # words that differ from the base (all words when carried whole)
    encoded: int  # bytes the frame takes in the patch


@dataclass(frozen=True)
class PatchTrailer:
    target_fingerprint: str
    target_files: tuple[FileRef, ...]
    items: tuple[ItemResult, ...]
    frames: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "target": {
                "fingerprint": self.target_fingerprint,
                "files": [f.to_json() for f in self.target_files],
            },
            "items": [
                {"fingerprint": r.fingerprint, "changed": r.changed, "encoded": r.encoded}
                for r in self.items
            ],
        }


def header_from_json(
    obj: dict[str, Any], name: str, parsed: dict[bytes, SafetensorsHeader] | None = None
) -> PatchHeader:
    """Validate a header's JSON and build the typed header; CorruptPatchError on any problem.

    ``parsed``: stored safetensors headers already parsed (by raw bytes), added to as they are;
    for several patches that store the same ones (block patches of one update)."""
    v = _Validator(name, "header")
    layout = v.choice(obj, "layout", ("file", "dir"))
    block_bytes = v.int_in(obj, "block_bytes", MIN_BLOCK_BYTES, MAX_BLOCK_BYTES)
    if block_bytes % 8:
        v.fail("block_bytes is not a multiple of 8")
    writer = v.str_(obj, "writer")
    base = v.dict_(obj, "base")
    base_fp = v.fingerprint(base, "fingerprint")
    base_files = tuple(v.file_ref(f, layout) for f in v.list_(base, "files"))
    _check_paths(v, [f.path for f in base_files], layout)
    files = tuple(_target_file(v, f, name, parsed) for f in v.list_(obj, "files"))
    _check_paths(v, [f.path for f in files], layout)
    scope = v.choice(obj, "scope", ("checkpoint", "tensors")) if "scope" in obj else "checkpoint"
    raw_items = v.list_(obj, "items")
    expected = [
        (i, t.name, t.start, t.nbytes, t.dtype)
        for i, f in enumerate(files)
        if f.header is not None
        for t in f.header.tensors
    ]
    expected_iter = iter(expected)
    items: list[Item] = []
    for raw in raw_items:
        if not isinstance(raw, dict):
            v.fail("an item is not an object")
        file_index = v.int_in(raw, "file", 0, len(files) - 1)
        target = files[file_index]
        item_name = v.get(raw, "name")
        nbytes = v.int_in(raw, "nbytes", 0, 2**63)
        word = v.int_in(raw, "word", 1, 8)
        if word not in _WORDS:
            v.fail(f"item word size {word} is not 1, 2, 4 or 8")
        if target.header is None:
            # A blob's word is 1: its size need not be a multiple of anything wider.
            if item_name is not None or nbytes != target.size or word != 1:
                v.fail(f"blob item for {target.path!r} does not match the file")
            start = 0
        else:
            exp = next(expected_iter, None)
            if scope == "tensors":  # a block patch names a subsequence of the tensors
                while exp is not None and (exp[0], exp[1]) != (file_index, item_name):
                    exp = next(expected_iter, None)
            if exp is None or exp[0] != file_index or exp[1] != item_name or exp[3] != nbytes:
                v.fail(f"item {item_name!r} does not match the target safetensors header")
            if word != DTYPES[exp[4]].word:
                v.fail(f"item {item_name!r} has word size {word}, dtype {exp[4]} needs another")
            start = exp[2]
        base_ref = v.get(raw, "base")
        base_file = base_name = base_item_fp = None
        if base_ref is not None:
            if not isinstance(base_ref, dict):
                v.fail("an item's base is not an object")
            base_file = v.int_in(base_ref, "file", 0, len(base_files) - 1)
            base_name = v.get(base_ref, "name")
            if not (base_name is None or isinstance(base_name, str)):
                v.fail("an item's base name is not a string")
            if (base_name is None) != (item_name is None):
                v.fail("an item's base is not of the same kind")
            base_item_fp = v.fingerprint(raw, "base_fingerprint")
        elif raw.get("base_fingerprint") is not None:
            v.fail("an item without base has a base fingerprint")
        items.append(
            Item(file_index, item_name, start, nbytes, word, base_file, base_name, base_item_fp)
        )
    if scope == "tensors":
        if not items or any(i.name is None or i.base_file is None for i in items):
            v.fail("a block patch names one or more tensors, each with its base")
    else:
        if next(expected_iter, None) is not None:
            v.fail("the items do not cover every tensor of the target files")
        blob_items = sum(1 for i in items if i.name is None)
        if blob_items != sum(1 for f in files if f.header is None):
            v.fail("the items do not cover every blob of the target files")
    if [i.file for i in items] != sorted(i.file for i in items):
        v.fail("items are not in file order")
    return PatchHeader(
        layout, block_bytes, writer, base_fp, base_files, files, tuple(items), cast(Any, scope)
    )


def trailer_from_json(obj: dict[str, Any], header: PatchHeader, name: str) -> PatchTrailer:
    """Validate a trailer against its header."""
    v = _Validator(name, "trailer")
    target = v.dict_(obj, "target")
    target_fp = v.fingerprint(target, "fingerprint")
    files = tuple(v.file_ref(f, header.layout) for f in v.list_(target, "files"))
    if [(f.path, f.size) for f in files] != [(f.path, f.size) for f in header.files]:
        v.fail("target files do not match the header")
    raw_items = v.list_(obj, "items")
    if len(raw_items) != len(header.items):
        v.fail("item count does not match the header")
    results = []
    for raw, item in zip(raw_items, header.items, strict=True):
        if not isinstance(raw, dict):
            v.fail("an item result is not an object")
        results.append(
            ItemResult(
                v.fingerprint(raw, "fingerprint"),
                v.int_in(raw, "changed", 0, item.nbytes // item.word),
                v.int_in(raw, "encoded", 0, 2**63),
            )
        )
    frames = v.list_(obj, "frames")
    if len(frames) != len(header.items) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in frames
    ):
        v.fail("frame index does not match the header")
    return PatchTrailer(target_fp, files, tuple(results), tuple(frames))


def _target_file(
    v: _Validator, raw: Any, name: str, parsed: dict[bytes, SafetensorsHeader] | None = None
) -> TargetFile:
    if not isinstance(raw, dict):
        v.fail("a target file is not an object")
    path = v.str_(raw, "path")
    kind = v.choice(raw, "kind", ("safetensors", "blob"))
    if kind == "blob":
        return TargetFile(path, "blob", v.int_in(raw, "size", 0, 2**63), None)
    try:
        header_raw = v.str_(raw, "header").encode("utf-8")
    except UnicodeEncodeError:
        v.fail(f"stored safetensors header of {path!r} is not valid text")
    header = None if parsed is None else parsed.get(header_raw)
    if header is None:
        try:
            # The data size is what the header itself implies; parse_header checks the tiling.
            header = _parse_stored_header(header_raw, f"{name} ({path or 'target'})")
        except FormatError as exc:
            raise CorruptPatchError(f"{name}: stored safetensors header is invalid: {exc}") from exc
        if parsed is not None:
            parsed[header_raw] = header
    return TargetFile(path, "safetensors", header.file_size, header)


def _parse_stored_header(raw: bytes, label: str) -> SafetensorsHeader:
    import json

    try:
        entries = json.loads(raw.decode("utf-8"))
        data_len = max(
            (int(e["data_offsets"][1]) for k, e in entries.items() if k != "__metadata__"),
            default=0,
        )
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        OverflowError,  # int(inf)
        RecursionError,  # deeply nested JSON
    ) as exc:
        raise FormatError(f"{label}: header is not a safetensors header") from exc
    return parse_header(raw, 8 + len(raw) + data_len, label)


def _check_paths(v: _Validator, paths: list[str], layout: str) -> None:
    problem = paths_problem(paths, layout)
    if problem is not None:
        v.fail(problem)


class _Validator:
    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self.what = what

    def fail(self, message: str) -> NoReturn:
        raise CorruptPatchError(f"{self.name}: {self.what}: {message}", path=self.name)

    def get(self, obj: Any, key: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            self.fail(f"missing field {key!r}")
        return obj[key]

    def str_(self, obj: Any, key: str) -> str:
        value = self.get(obj, key)
        if not isinstance(value, str):
            self.fail(f"field {key!r} is not a string")
        return value

    def choice(self, obj: Any, key: str, options: tuple[str, ...]) -> Any:
        value = self.get(obj, key)
        if value not in options:
            self.fail(f"field {key!r} is {value!r}, expected one of {', '.join(options)}")
        return value

    def int_in(self, obj: Any, key: str, low: int, high: int) -> int:
        value = self.get(obj, key)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            self.fail(f"field {key!r} is not an integer in [{low}, {high}]")
        return value

    def dict_(self, obj: Any, key: str) -> dict[str, Any]:
        value = self.get(obj, key)
        if not isinstance(value, dict):
            self.fail(f"field {key!r} is not an object")
        return value

    def list_(self, obj: Any, key: str) -> list[Any]:
        value = self.get(obj, key)
        if not isinstance(value, list):
            self.fail(f"field {key!r} is not a list")
        return value

    def fingerprint(self, obj: Any, key: str) -> str:
        value = self.get(obj, key)
        if not isinstance(value, str) or not _HEX128.match(value):
            self.fail(f"field {key!r} is not a 32-digit lowercase hex fingerprint")
        return value

    def file_ref(self, raw: Any, layout: str) -> FileRef:
        return FileRef(
            self.str_(raw, "path"),
            self.int_in(raw, "size", 0, 2**63),
            self.fingerprint(raw, "fingerprint"),
        )


def chain_out_of_order(
    name: str, expects: str, before: str, produces: str | None, before_expects: str | None
) -> IntegrityError:
    """The error for patch ``name``, which starts from ``expects``, given after ``before``,
    which makes ``produces`` from ``before_expects``: the patches out of order, one missing,
    or (when both start from the same base) one given twice."""
    fix = "give the patches in the order they were made, with none missing"
    if expects == before_expects:
        fix = f"both patches start from that base (one patch given twice?); {fix}"
    return IntegrityError(
        f"{name}: patch chain out of order: it expects base {expects}, but {before} produces "
        f"{produces}; {fix}",
        path=name,
        expected=expects,
        actual=str(produces),
    )
