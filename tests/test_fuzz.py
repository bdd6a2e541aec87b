"""Fuzzing the readers: every input ends in a clean PulseError or a correct result.

Targets: the patch reader with full apply (PatchReader, header_from_json, the codecs, the
trailer checks), the safetensors reader (parse_header, Checkpoint.open), a folder store's
step manifests (manifest_from_bytes, then pull), PULSELoCo patches (loco.loads), the live
weights API (torch_api.apply_patch on a state dict), squash, and the readers that
write nothing (stats PATCH, inspect --check). Inputs: truncation
at every byte, random byte edits, and structure-aware edits that keep every checksum valid
(a changed header, trailer, stored safetensors header or block payload), so that the
validators and the decoders see them, not only the checksums.

Outcomes are counted: "caught" (a PulseError, output absent, no temp file), "ok" (the exact
target, or a valid parse), "missed" (anything else: the test fails). The counts are printed
at the end of the run. CI runs a fixed-seed subset (profile "ci"); a longer run is
``HYPOTHESIS_PROFILE=long pytest tests/test_fuzz.py`` or ``python fuzz/run.py --minutes 10``.
"""

from __future__ import annotations

import copy
import io
import json
import os
import resource
import shutil
import signal
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _faultkit import (
    PLACEHOLDERS,
    ParsedPatch,
    apply_outcome,
    build_patch,
    json_text,
    make_patch,
    parse_patch,
    report,
    scratch_dir,
    snapshot,
    temps_in,
    write_small_folders,
    write_small_pair,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from pulsectl.checkpoint import Checkpoint, parse_header
from pulsectl.codecs import CODEC_NAMES, decode_block
from pulsectl.errors import PulseError
from pulsectl.format import PatchReader, read_trailer_at_end
from pulsectl.patch import header_from_json
from pulsectl.store import PublishOptions, publish, pull
from pulsectl.store.layout import manifest_from_bytes, manifest_key

PROFILES: dict[str, dict[str, Any]] = {
    "ci": {"max_examples": 150, "derandomize": True},
    "long": {
        "max_examples": int(os.environ.get("PULSECTL_FUZZ_EXAMPLES", 5000)),
        "derandomize": False,
    },
}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
FUZZ = settings(
    **PROFILES.get(PROFILE, PROFILES["ci"]),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HANG_SECONDS = 20  # one input taking longer than this counts as a hang

COUNTS: Counter[str] = Counter()
_RSS_START = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Hang


def run_input(target: str, fn: Callable[[], str]) -> str:
    """Run one fuzz input; count its outcome. A non-PulseError or a hang is a miss."""
    COUNTS["tried"] += 1
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    try:
        outcome = fn()
    except PulseError:
        outcome = "caught"
    except BaseException:
        COUNTS["missed"] += 1
        COUNTS[f"missed:{target}"] += 1
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    COUNTS[outcome] += 1
    COUNTS[f"{outcome}:{target}"] += 1
    return outcome


class Seeds:
    """The valid inputs every mutation starts from (made once per module)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.out = folder / "out"
        self.file_base, self.file_new = write_small_pair(folder)
        self.dirs_base, self.dirs_new = write_small_folders(folder)
        self.patches: dict[str, tuple[Path, bytes, bytes | dict[str, bytes]]] = {
            "file": (
                self.file_base,
                make_patch(self.file_base, self.file_new),
                snapshot(self.file_new),
            ),
            "file-max": (
                self.file_base,
                make_patch(self.file_base, self.file_new, level="max"),
                snapshot(self.file_new),
            ),
            "folder": (
                self.dirs_base,
                make_patch(self.dirs_base, self.dirs_new),
                snapshot(self.dirs_new),
            ),
        }
        self.parsed = {k: parse_patch(v[1]) for k, v in self.patches.items()}
        self.back = make_patch(self.file_new, self.file_base)  # new -> base, for squash
        self.safetensors = self.file_new.read_bytes()
        # A folder store of two steps: an anchor (step 0) and a patch (step 1).
        self.store = folder / "store"
        for step in (self.file_base, self.file_new):
            options = PublishOptions(anchor_every=10, cache_dir=folder / "publish-cache")
            publish(self.store, step, options=options)
        self.manifests = {step: (self.store / manifest_key(step)).read_bytes() for step in (0, 1)}


@pytest.fixture(scope="module")
def seeds() -> Iterator[Seeds]:
    with scratch_dir() as folder, pytest.MonkeyPatch.context() as mp:
        mp.setattr("pulsectl.hashing.READ_CHUNK", 1 << 16)  # small files: no 16 MiB buffer
        yield Seeds(folder)


PATCH_KINDS = st.sampled_from(["file", "file-max", "folder"])


# --- byte-level edits --------------------------------------------------------------------


@st.composite
def byte_edits(draw: st.DrawFn, data: bytes) -> bytes:
    """1-4 random edits: flip, set, delete, insert, duplicate, truncate."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not out:
            break
        op = draw(st.sampled_from(["flip", "set", "delete", "insert", "dup", "truncate"]))
        at = draw(st.integers(0, len(out) - 1))
        if op == "flip":
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            out[at] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x01]))
        elif op == "delete":
            del out[at : at + draw(st.integers(1, 16))]
        elif op == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "dup":
            out[at:at] = out[at : at + draw(st.integers(1, 32))]
        else:
            del out[at:]
    return bytes(out)


def test_truncation_at_every_byte(seeds: Seeds) -> None:
    """Every prefix of every seed patch (frame boundaries included) fails cleanly."""
    for kind, (base, patch, _) in seeds.patches.items():
        assert set(seeds.parsed[kind].boundaries) <= set(range(len(patch) + 1))
        for end in range(len(patch)):
            cut = partial(apply_outcome, base, patch[:end], seeds.out, None)
            outcome = run_input("truncate", cut)
            assert outcome == "caught", (kind, end)


def test_truncation_on_the_random_access_path(seeds: Seeds) -> None:
    """`inspect`/`verify` read the trailer through the footer: every prefix fails cleanly."""
    for _, patch, _ in seeds.patches.values():
        for end in range(len(patch)):

            def read(cut: bytes = patch[:end]) -> str:
                read_trailer_at_end(io.BytesIO(cut), "<cut>")
                return "ok"

            assert run_input("truncate-footer", read) == "caught"


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS)
def test_fuzz_patch_bytes(seeds: Seeds, data: st.DataObject, kind: str) -> None:
    base, patch, expected = seeds.patches[kind]
    mutated = data.draw(byte_edits(patch))
    outcome = run_input("patch-bytes", lambda: apply_outcome(base, mutated, seeds.out, expected))
    assert outcome == "caught" or mutated == patch


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS)
def test_fuzz_patch_reader_only(seeds: Seeds, data: st.DataObject, kind: str) -> None:
    """PatchReader + header_from_json + read_trailer_at_end on edited bytes (no checkpoint)."""
    mutated = data.draw(byte_edits(seeds.patches[kind][1]))

    def read() -> str:
        reader = PatchReader(io.BytesIO(mutated), "<fuzz>")
        header_from_json(reader.header, "<fuzz>")
        read_trailer_at_end(io.BytesIO(mutated), "<fuzz>")
        return "ok"

    run_input("patch-reader", read)


# --- structure-aware edits (checksums stay valid) ------------------------------------------

HOSTILE_INTS = [
    0,
    1,
    -1,
    7,
    8,
    4095,
    4096,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    10**12,
    10**30,
]
JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from(HOSTILE_INTS),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(PLACEHOLDERS),
    st.sampled_from(
        ["", "..", "/etc/passwd", "a/../b", ".hidden", "BF16", "U8", "blob", "safetensors"]
    ),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from _paths(value, (*prefix, index))


@st.composite
def json_edits(draw: st.DrawFn, obj: Any) -> Any:
    """1-3 edits anywhere in a JSON tree: replace a value, delete a key, copy or swap items."""
    obj = copy.deepcopy(obj)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(obj))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "tweak-int", "dup"]))
        if not path:
            if op == "replace":
                obj = draw(JSON_VALUES)
            continue
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        value = parent[key]
        if op == "replace":
            parent[key] = draw(JSON_VALUES)
        elif op == "delete":
            del parent[key]
        elif op == "tweak-int" and isinstance(value, int) and not isinstance(value, bool):
            parent[key] = value + draw(st.sampled_from([-1, 1, 8, -8, 4096, 2**32, 2**40]))
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(value))
        elif op == "dup" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = copy.deepcopy(value)
    return obj


def _rebuild(
    parsed: ParsedPatch, header: Any = None, trailer: Any = None, frames: Any = None
) -> bytes:
    """Write a patch from edited parts, with valid checksums."""
    return build_patch(
        parsed.header if header is None else header,
        parsed.frames if frames is None else frames,
        parsed.trailer if trailer is None else trailer,
    )


EDIT_PARTS = st.sampled_from(["header", "block", "bytes"])


def edited_patch(data: st.DataObject, raw: bytes, part: str) -> bytes:
    """``raw`` (a valid patch) with its header JSON edited, one block's codec id and payload
    edited (checksums kept valid), or its bytes edited."""
    if part == "bytes":
        return data.draw(byte_edits(raw))
    parsed = parse_patch(raw)
    if part == "header":
        return _rebuild(parsed, header=json_text(data.draw(json_edits(parsed.header))))
    frames = [list(f) for f in parsed.frames]
    spots = [(i, j) for i, f in enumerate(frames) for j in range(len(f))]
    i, j = data.draw(st.sampled_from(spots))
    codec, payload = frames[i][j]
    if payload:
        payload = data.draw(byte_edits(payload))
    frames[i][j] = (data.draw(st.sampled_from(sorted(CODEC_NAMES)) | st.just(codec)), payload)
    return _rebuild(parsed, frames=frames)


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS)
def test_fuzz_header_json(seeds: Seeds, data: st.DataObject, kind: str) -> None:
    base, _, expected = seeds.patches[kind]
    parsed = seeds.parsed[kind]
    header = data.draw(json_edits(parsed.header))
    patch = _rebuild(parsed, header=json_text(header))
    run_input("header-json", lambda: apply_outcome(base, patch, seeds.out, expected))


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS)
def test_fuzz_stored_safetensors_header(seeds: Seeds, data: st.DataObject, kind: str) -> None:
    """Edit the target safetensors header carried in the patch header (a JSON string)."""
    base, _, expected = seeds.patches[kind]
    parsed = seeds.parsed[kind]
    header = copy.deepcopy(parsed.header)
    stored = [f for f in header["files"] if f["kind"] == "safetensors"]
    target = data.draw(st.sampled_from(stored))
    edited = data.draw(json_edits(json.loads(target["header"])))
    text = json_text(edited, canonical=False).decode()
    target["header"] = text + " " * data.draw(st.integers(0, 9))
    patch = _rebuild(parsed, header=header)
    run_input("stored-header", lambda: apply_outcome(base, patch, seeds.out, expected))


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS)
def test_fuzz_trailer_json(seeds: Seeds, data: st.DataObject, kind: str) -> None:
    base, _, expected = seeds.patches[kind]
    parsed = seeds.parsed[kind]
    trailer = data.draw(json_edits(parsed.trailer))
    if not isinstance(trailer, dict):
        trailer = {"target": trailer}
    patch = _rebuild(parsed, trailer=trailer)
    run_input("trailer-json", lambda: apply_outcome(base, patch, seeds.out, expected))


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS)
def test_fuzz_block_payloads(seeds: Seeds, data: st.DataObject, kind: str) -> None:
    """Edit a block's codec id or payload; the checksum is recomputed, the decoder must cope."""
    base, _, expected = seeds.patches[kind]
    parsed = seeds.parsed[kind]
    frames = [list(f) for f in parsed.frames]
    spots = [(i, j) for i, f in enumerate(frames) for j in range(len(f))]
    i, j = data.draw(st.sampled_from(spots))
    codec, payload = frames[i][j]
    if data.draw(st.booleans()):
        codec = data.draw(st.integers(0, 255) | st.sampled_from(sorted(CODEC_NAMES)))
    if payload and data.draw(st.booleans()):
        payload = data.draw(byte_edits(payload))
    elif data.draw(st.booleans()):
        payload = data.draw(st.binary(max_size=64))
    frames[i][j] = (codec, payload)
    patch = _rebuild(parsed, frames=frames)
    run_input("block-payload", lambda: apply_outcome(base, patch, seeds.out, expected))


@FUZZ
@given(
    codec=st.sampled_from(sorted(CODEC_NAMES)),
    word=st.sampled_from([1, 2, 4, 8]),
    nwords=st.integers(1, 64),
    payload=st.binary(max_size=200),
    with_base=st.booleans(),
)
def test_fuzz_decode_block(
    codec: int, word: int, nwords: int, payload: bytes, with_base: bool
) -> None:
    """The codecs alone, on random payloads: a CorruptPatchError or a block of the right size."""
    size = word * nwords
    old = np.arange(size, dtype=np.uint8) if with_base else None

    def decode() -> str:
        out = decode_block(codec, payload, old, size, word)
        assert out.dtype == np.uint8 and out.size == size
        return "ok"

    run_input("decode-block", decode)


# --- the safetensors reader ----------------------------------------------------------------


def _check_safetensors(folder: Path, data: bytes) -> str:
    """Checkpoint.open on ``data``; when it accepts, the official reader must agree."""
    path = folder / "fuzz.safetensors"
    path.write_bytes(data)
    ckpt = Checkpoint.open(path)
    header = ckpt.files[0].header
    assert header is not None and header.file_size == len(data)
    with safe_open(str(path), framework="np") as f:
        official = {
            name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape()))
            for name in f.keys()  # noqa: SIM118 - safe_open is not a mapping
        }
    ours = {t.name: (t.dtype, t.shape) for t in header.tensors}
    assert ours == official, (ours, official)
    return "ok"


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_bytes(seeds: Seeds, data: st.DataObject) -> None:
    mutated = data.draw(byte_edits(seeds.safetensors))
    run_input("safetensors-bytes", lambda: _check_safetensors(seeds.folder, mutated))


@FUZZ
@given(data=st.data(), pad=st.integers(0, 9), extra=st.integers(-16, 16))
def test_fuzz_safetensors_header_json(
    seeds: Seeds, data: st.DataObject, pad: int, extra: int
) -> None:
    (n,) = struct.unpack_from("<Q", seeds.safetensors)
    header = json.loads(seeds.safetensors[8 : 8 + n])
    body = seeds.safetensors[8 + n :]
    edited = data.draw(json_edits(header))
    text = json_text(edited, canonical=False) + b" " * pad
    body = body[: len(body) + extra] if extra < 0 else body + bytes(extra)
    file = struct.pack("<Q", len(text)) + text + body
    run_input("safetensors-json", lambda: _check_safetensors(seeds.folder, file))


@FUZZ
@given(
    length=st.integers(0, 2**64 - 1) | st.sampled_from(HOSTILE_INTS[:-2]),
    rest=st.binary(max_size=64),
)
def test_fuzz_safetensors_length_prefix(seeds: Seeds, length: int, rest: bytes) -> None:
    """Any 8-byte length prefix: no huge allocation, a FormatError naming the file."""
    data = struct.pack("<Q", length % 2**64) + rest

    def parse() -> str:
        return _check_safetensors(seeds.folder, data)

    run_input("safetensors-prefix", parse)


@FUZZ
@given(raw=st.binary(max_size=200) | JSON_VALUES.map(lambda v: json_text(v, canonical=False)))
def test_fuzz_parse_header_text(raw: bytes) -> None:
    def parse() -> str:
        parse_header(raw, 8 + len(raw) + 64)
        return "ok"

    run_input("parse-header", parse)


# --- store manifests -------------------------------------------------------------------------


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@FUZZ
@given(data=st.data(), step=st.sampled_from([0, 1]))
def test_fuzz_store_manifest(seeds: Seeds, data: st.DataObject, step: int) -> None:
    """Edit a step manifest of a folder store, then pull step 1: the exact checkpoint or a
    clean error, and never a file written outside the worker's folder (pull writes an anchor's
    files at the paths its manifest names)."""
    edited = data.draw(json_edits(json.loads(seeds.manifests[step])))
    raw = json_text(edited, canonical=data.draw(st.booleans()))
    worker = seeds.folder / "worker"
    worker.mkdir()
    before = _tree(seeds.folder) - {"worker"}

    def run() -> str:
        (seeds.store / manifest_key(step)).write_bytes(raw)
        try:
            try:
                manifest_from_bytes(raw, manifest_key(step))
            except PulseError as exc:
                assert "\n" not in str(exc), f"multi-line message: {exc!s}"
            out = worker / "model.safetensors"
            pull(seeds.store, out, step=1)
            assert out.read_bytes() == seeds.file_new.read_bytes(), "pull gave a wrong result"
            return "ok"
        finally:
            (seeds.store / manifest_key(step)).write_bytes(seeds.manifests[step])
            assert (
                _tree(seeds.folder) - {"worker"} - {f"worker/{p}" for p in _tree(worker)} == before
            ), "pull wrote outside its folder"
            shutil.rmtree(worker)

    run_input("store-manifest", run)


# --- PULSELoCo patches and live weights ------------------------------------------------------


@pytest.fixture(scope="module")
def loco_seed() -> bytes:
    from pulsectl import loco

    rng = np.random.default_rng(5)
    dense = {
        "a.weight": rng.standard_normal((40, 30)).astype(np.float32),
        "b.bias": np.zeros(7, np.float32),
    }
    dense["a.weight"][rng.random((40, 30)) < 0.9] = 0
    return loco.dumps(loco.SparseUpdate.from_dense(dense))


@FUZZ
@given(data=st.data(), part=EDIT_PARTS)
def test_fuzz_loco_patch(loco_seed: bytes, data: st.DataObject, part: str) -> None:
    """Edit a PULSELoCo patch (its header, 'loco' field included, a block, or raw bytes) and
    read it as `loco reduce` and `loco step` do: the same update or a clean error."""
    from pulsectl import loco

    raw = loco_seed
    patch = edited_patch(data, raw, part)
    want = loco.loads(raw)

    def read() -> str:
        try:
            got = loco.loads(patch)
        except PulseError as exc:
            assert "\n" not in str(exc), f"multi-line message: {exc!s}"
            raise
        # The 'loco' field (kind, trainers, gate) is the header's to say; the data is not.
        assert got.shapes == want.shapes
        for name in want.shapes:
            assert np.array_equal(got.positions[name], want.positions[name])
            assert np.array_equal(
                got.values[name].view(np.uint32), want.values[name].view(np.uint32)
            )
        return "ok"

    run_input("loco-patch", read)


@FUZZ
@given(data=st.data(), part=EDIT_PARTS)
def test_fuzz_live_apply(seeds: Seeds, data: st.DataObject, part: str) -> None:
    """torch_api.apply_patch on an edited patch: the target state, or a clean error that left
    every tensor of the state dict as it was (it promises to touch nothing until all checks)."""
    import torch
    from safetensors.torch import load_file

    from pulsectl.torch_api import apply_patch

    patch = edited_patch(data, seeds.patches["file"][1], part)
    state = load_file(str(seeds.file_base))
    before = {k: v.clone() for k, v in state.items()}
    target = load_file(str(seeds.file_new))

    def run() -> str:
        try:
            apply_patch(state, patch, workers=1)
        except PulseError as exc:
            assert "\n" not in str(exc), f"multi-line message: {exc!s}"
            assert state.keys() == before.keys(), "a failed apply changed the state's tensors"
            for k, v in before.items():
                assert torch.equal(state[k], v), f"a failed apply touched {k!r}"
            raise
        assert state.keys() == target.keys()
        for k, v in target.items():
            assert state[k].dtype == v.dtype and torch.equal(state[k], v), k
        return "ok"

    run_input("live-apply", run)


# --- squash ------------------------------------------------------------------------------------


@FUZZ
@given(
    data=st.data(),
    which=st.sampled_from([0, 1]),
    part=EDIT_PARTS,
    with_base=st.booleans(),
)
def test_fuzz_squash(
    seeds: Seeds, data: st.DataObject, which: int, part: str, with_base: bool
) -> None:
    """Squash a two-patch chain (base -> new -> base) with one patch edited: a clean error with
    nothing left behind, or a patch that applies to exactly the chain's end. Without --base
    squash never holds the tensors, so an input whose checksums hold but whose blocks were
    written wrong can give a patch that apply refuses (its target fingerprints are the last
    input's); never one that applies to anything else."""
    from pulsectl.squash import squash_patches

    chain = [seeds.patches["file"][1], seeds.back]
    chain[which] = edited_patch(data, chain[which], part)
    work = seeds.folder / "squash"
    work.mkdir()
    paths = [work / "p1.pulse", work / "p2.pulse"]
    for path, patch in zip(paths, chain, strict=True):
        path.write_bytes(patch)
    out = work / "squashed.pulse"

    def run() -> str:
        try:
            try:
                squash_patches(paths, out, base=seeds.file_base if with_base else None)
            except PulseError as exc:
                assert "\n" not in str(exc), f"multi-line message: {exc!s}"
                assert not out.exists() and not temps_in(work), f"left behind after: {exc}"
                raise
            outcome = apply_outcome(
                seeds.file_base, out.read_bytes(), seeds.out, snapshot(seeds.file_base)
            )
            assert outcome == "ok" or not with_base, "squash --base wrote a wrong patch"
            return outcome
        finally:
            shutil.rmtree(work)

    run_input("squash", run)


# --- readers that write nothing: stats PATCH, inspect --check -----------------------------------


@FUZZ
@given(data=st.data(), kind=PATCH_KINDS, part=EDIT_PARTS)
def test_fuzz_patch_readers(seeds: Seeds, data: st.DataObject, kind: str, part: str) -> None:
    """`inspect --check` (read_patch_info) and `stats PATCH` (patch_stats), which read every
    block and write nothing, on an edited patch: each gives a result or a clean one-line
    error."""
    from pulsectl.info import read_patch_info
    from pulsectl.stats import patch_stats

    patch = edited_patch(data, seeds.patches[kind][1], part)

    def read() -> str:
        for reader in (
            lambda: read_patch_info(io.BytesIO(patch), check=True),
            lambda: patch_stats(io.BytesIO(patch)),
        ):
            try:
                reader()
            except PulseError as exc:
                assert "\n" not in str(exc), f"multi-line message: {exc!s}"
                raise
        return "ok"

    run_input("patch-readers", read)


# --- the summary -----------------------------------------------------------------------------


def test_zz_fuzz_summary(request: pytest.FixtureRequest) -> None:
    """Print the counts (inputs tried, caught, correct, missed) and check nothing was missed."""
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _RSS_START) / 1024
    targets = sorted({k.split(":", 1)[1] for k in COUNTS if ":" in k})
    per_target = ", ".join(
        f"{t} {COUNTS[f'caught:{t}']}/{COUNTS[f'ok:{t}']}/{COUNTS[f'missed:{t}']}" for t in targets
    )
    report(
        request.config,
        f"fuzz ({PROFILE})",
        f"{COUNTS['tried']} inputs tried, {COUNTS['caught']} caught, {COUNTS['ok']} correct, "
        f"{COUNTS['missed']} missed; peak RSS grew {grown_mib:.0f} MiB "
        f"[caught/correct/missed per target: {per_target}]",
    )
    stats = os.environ.get("PULSECTL_FUZZ_STATS")
    if stats:
        Path(stats).write_text(json.dumps(dict(COUNTS)))
    if COUNTS["tried"] == 0:
        pytest.skip("no fuzz test ran")
    assert COUNTS["missed"] == 0
    assert grown_mib < 1024, f"memory grew by {grown_mib:.0f} MiB while fuzzing"
