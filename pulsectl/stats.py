"""stats: how sparse an update is, from two checkpoints, from a patch, or across a chain.

Three inputs, one set of figures (docs/STATS.md describes them and the JSON schema):

- ``pair_stats(OLD, NEW)`` compares the checkpoints word by word (numpy, chunked preads) and
  measures the patch ``pulsectl diff`` would write by writing it to a temporary file.
- ``patch_stats(PATCH)`` reads the same figures from a patch alone: counts and sizes from the
  trailer, word deltas decoded from the value planes of the delta blocks (codecs 3 to 7
  store each changed word as ``new - old``, so the base is not needed). Changed words in blocks
  stored whole (dense blocks, tensors without a base) have no delta: counted as ``no_delta``.
- ``chain_stats(C0..Cn, ks)`` gives the k-step table: for each k the density of
  diff(C_i, C_{i+k}) over every window i (mean, min, max).

The word delta of a changed word is ``new - old`` of the raw words taken as a signed integer
(modulo 2**bits), in absolute value; for two floats of the same sign it is their distance in
units in the last place. Memory stays at a few chunks whatever the model size.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pulsectl._atomic import (
    atomic_file,
    check_file_target,
    file_path,
    refuse_inside_folder_input,
    same_file,
)
from pulsectl._io import default_workers, ordered_map
from pulsectl._names import DEFAULT_KS
from pulsectl.cast import cast_temporaries, target_dtype
from pulsectl.checkpoint import Checkpoint, TensorInfo
from pulsectl.codecs import (
    CODEC_CONTEXT,
    CODEC_RICE,
    DELTA_CODECS,
    context,
    delta,
    plain_codec,
    rice,
)
from pulsectl.codecs.delta import find_changes
from pulsectl.device import check_name
from pulsectl.diff import DiffOptions, diff_to_path
from pulsectl.errors import CorruptPatchError, UsageError
from pulsectl.format import BLOCK_PAYLOAD_SLACK, blocks_in, open_patch
from pulsectl.info import read_patch_info
from pulsectl.patch import header_from_json, trailer_from_json
from pulsectl.sources import FileSource

STATS_SCHEMA = 1  # version of the JSON of `pulsectl stats --json` (docs/STATS.md)
BUCKETS = ("1", "2", "3-8", ">8")  # word-delta histogram buckets, in ULPs
NO_DELTA = "no_delta"  # changed words whose delta is unknown (stored whole)
KINDS = ("embedding", "attention", "mlp", "norm", "bias", "other")


CHUNK_BYTES = 8 << 20  # bytes per read of one tensor (a multiple of every word size)

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
_EMBEDDING = re.compile(r"(embed|wte|wpe|lm_head|word_embeddings|position_embeddings)")
_NORM = re.compile(r"(norm|(^|\.)ln_?\w*\.|(^|\.)ln_f\.)")
_ATTENTION = re.compile(
    r"(attn|attention|(^|\.)(q|k|v|o)_proj\.|query_key_value|(^|\.)(wq|wk|wv|wo)\.)"
)
_MLP = re.compile(
    r"(mlp|feed_forward|ffn|(^|\.)(gate|up|down)_proj\.|c_fc|dense_h_to_4h|dense_4h_to_h|"
    r"experts|(^|\.)w[123]\.)"
)

Histogram = list[int]  # counts for BUCKETS then NO_DELTA


def layer_index(name: str) -> int | None:
    """The block index in ``model.layers.N.``, ``h.N.``, ``blocks.N.`` names, else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def tensor_kind(name: str) -> str:
    """embedding, attention, mlp, norm, bias or other, from Hugging Face Llama/Qwen/GPT names.

    Embeddings include the LM head; norm weights and biases are ``norm``; other biases are
    ``bias`` whatever layer they belong to.
    """
    n = name.lower()
    if _EMBEDDING.search(n):
        return "embedding"
    if _NORM.search(n):
        return "norm"
    if n.endswith(".bias") or n == "bias":
        return "bias"
    if _ATTENTION.search(n):
        return "attention"
    if _MLP.search(n):
        return "mlp"
    return "other"


def _empty_histogram() -> Histogram:
    return [0] * (len(BUCKETS) + 1)


def _histogram_of(magnitudes: np.ndarray) -> Histogram:
    """Bucket counts of word-delta magnitudes (all >= 1), no_delta = 0."""
    counts = np.bincount(np.minimum(magnitudes, 9).astype(np.intp), minlength=10)
    return [int(counts[1]), int(counts[2]), int(counts[3:9].sum()), int(counts[9]), 0]


def _changes(old: np.ndarray, new: np.ndarray, word: int, device: str | None) -> np.ndarray:
    if device is None:
        return find_changes(old, new, word)
    from pulsectl.device import find_changes as find_on_device

    found = find_on_device(old, new, word, device)
    return find_changes(old, new, word) if found is None else found


def word_delta_histogram(
    old: np.ndarray, new: np.ndarray, word: int, device: str | None = None
) -> tuple[int, Histogram]:
    """Changed words and their delta histogram between two equal-sized uint8 buffers.

    ``device`` (a torch device name) finds the changed words with torch there.
    """
    positions = _changes(old, new, word, device)
    if positions.size == 0:
        return 0, _empty_histogram()
    utype = _UINT[word]
    moved = new.view(utype)[positions] - old.view(utype)[positions]  # wraps modulo 2**bits
    magnitude = np.minimum(moved, ~moved + utype(1))  # |moved| as a signed number
    return int(positions.size), _histogram_of(magnitude)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class TensorStats:
    name: str
    file: str  # relpath of its file ("" for a single-file checkpoint)
    dtype: str
    shape: tuple[int, ...]
    words: int
    changed: int
    from_base: bool  # compared with a tensor of the same name, dtype and shape
    histogram: Histogram = field(default_factory=_empty_histogram)
    encoded: int | None = None  # bytes of its frame in the patch

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "layer": layer_index(self.name),
            "kind": tensor_kind(self.name),
            "words": self.words,
            "changed_words": self.changed,
            "density": _ratio(self.changed, self.words),
            "from_base": self.from_base,
            "encoded_bytes": self.encoded,
            "histogram": _histogram_json(self.histogram),
        }


@dataclass
class BlobStats:
    path: str
    bytes: int
    changed: int  # bytes that differ (all of them when the base has no file of that size)
    encoded: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bytes": self.bytes,
            "changed_bytes": self.changed,
            "encoded_bytes": self.encoded,
        }


@dataclass
class UpdateStats:
    """Figures of one update (a pair of checkpoints or a patch)."""

    source: str  # "pair" or "patch"
    inputs: dict[str, Any]
    tensors: list[TensorStats]
    blobs: list[BlobStats]
    patch_bytes: int | None
    target_bytes: int
    # What the update covers: the target's bytes, but for a block patch (diff --tensors,
    # --blocks) the bytes of the tensors it carries, the size to compare it with.
    covered_bytes: int | None = None

    @property
    def words(self) -> int:
        return sum(t.words for t in self.tensors)

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors)

    @property
    def histogram(self) -> Histogram:
        return [sum(col) for col in zip(*(t.histogram for t in self.tensors), strict=True)] or (
            _empty_histogram()
        )

    def to_json(self) -> dict[str, Any]:
        """The documented `stats --json` object for a pair or a patch (docs/STATS.md)."""
        changed = self.changed
        return {
            "schema": STATS_SCHEMA,
            "source": self.source,
            "inputs": self.inputs,
            "total": {
                "tensors": len(self.tensors),
                "words": self.words,
                "changed_words": changed,
                "density": _ratio(changed, self.words),
                "target_bytes": self.target_bytes,
                "covered_bytes": (
                    self.covered_bytes if self.covered_bytes is not None else self.target_bytes
                ),
                "patch_bytes": self.patch_bytes,
                "bytes_per_change": (
                    self.patch_bytes / changed if self.patch_bytes is not None and changed else None
                ),
                "histogram": _histogram_json(self.histogram),
            },
            "by_layer": _groups(self.tensors, "layer"),
            "by_kind": _groups(self.tensors, "kind"),
            "tensors": [t.to_json() for t in self.tensors],
            "blobs": [b.to_json() for b in self.blobs],
        }


@dataclass
class ChainStats:
    """The k-step table of a chain: ``changed[k][i]`` words of diff(C_i, C_i+k)."""

    checkpoints: list[str]
    as_dtype: str | None
    words: list[int]  # tensor words of each checkpoint
    changed: dict[int, list[int]]

    def to_json(self) -> dict[str, Any]:
        """The documented `stats --json` object for a chain (docs/STATS.md)."""
        steps = []
        for k, counts in self.changed.items():
            densities = [_ratio(c, self.words[i + k]) for i, c in enumerate(counts)]
            steps.append(
                {
                    "k": k,
                    "windows": len(counts),
                    "changed_words": counts,
                    "densities": densities,
                    "mean_density": sum(densities) / len(densities) if densities else None,
                    "min_density": min(densities) if densities else None,
                    "max_density": max(densities) if densities else None,
                }
            )
        return {
            "schema": STATS_SCHEMA,
            "source": "chain",
            "inputs": {"checkpoints": self.checkpoints, "as": self.as_dtype},
            "words": self.words,
            "steps": steps,
        }


def _ratio(a: int, b: int) -> float:
    return a / b if b else 0.0


def _histogram_json(h: Histogram) -> dict[str, int]:
    return dict(zip((*BUCKETS, NO_DELTA), h, strict=True))


def _groups(tensors: Sequence[TensorStats], by: str) -> list[dict[str, Any]]:
    groups: dict[Any, list[TensorStats]] = {}
    for t in tensors:
        key = layer_index(t.name) if by == "layer" else tensor_kind(t.name)
        groups.setdefault(key, []).append(t)
    if by == "layer":
        order = sorted(groups, key=lambda k: (k is None, k if k is not None else 0))
    else:
        order = [k for k in KINDS if k in groups]
    out = []
    for key in order:
        members = groups[key]
        words = sum(t.words for t in members)
        changed = sum(t.changed for t in members)
        encoded = [t.encoded for t in members]
        out.append(
            {
                by: key,
                "tensors": len(members),
                "words": words,
                "changed_words": changed,
                "density": _ratio(changed, words),
                "encoded_bytes": None if None in encoded else sum(e or 0 for e in encoded),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# Two checkpoints


def pair_stats(
    old: str | Path,
    new: str | Path,
    *,
    as_dtype: str | None = None,
    measure_patch: bool = True,
    workers: int | None = None,
    device: str | None = None,
) -> UpdateStats:
    """Figures of the update OLD -> NEW (of their casts to ``as_dtype`` when given).

    ``measure_patch`` writes the patch ``pulsectl diff`` would write (default options) to a
    temporary file to give its exact size and each frame's size.
    """
    check_name(device)
    if as_dtype is not None:
        target_dtype(as_dtype)
        as_dtype = as_dtype.lower()  # one spelling in the JSON, as in store manifests
    inputs = {"old": str(old), "new": str(new), "as": as_dtype}
    if as_dtype is not None:
        with cast_temporaries([old, new], to=as_dtype) as (old_cast, new_cast):
            stats = pair_stats(
                old_cast, new_cast, measure_patch=measure_patch, workers=workers, device=device
            )
        stats.inputs = inputs
        return stats
    workers = workers or default_workers()
    base = Checkpoint.open(old)
    target = Checkpoint.open(new)
    if base.layout != target.layout:
        raise UsageError(
            f"{old} and {new} are not both files or both folders; compare like with like"
        )
    tensors: list[TensorStats] = []
    blobs: list[BlobStats] = []
    plans: list[tuple[int, bool, TensorInfo, int, int]] = []  # index, blob?, info, base start, word
    for entry in target.files:
        if entry.header is None:
            bentry = base.file(entry.relpath)
            same = bentry is not None and bentry.header is None and bentry.size == entry.size
            blobs.append(BlobStats(entry.relpath, entry.size, 0 if same else entry.size))
            if same and entry.size:
                assert bentry is not None
                info = TensorInfo("", "U8", (entry.size,), 0, entry.size)
                plans.append((len(blobs) - 1, True, info, 0, 1))
            continue
        for t in entry.header.tensors:
            words = t.nbytes // t.word
            found = base.find_tensor(t.name)
            same = found is not None and (found[1].dtype, found[1].shape) == (t.dtype, t.shape)
            ts = TensorStats(t.name, entry.relpath, t.dtype, t.shape, words, 0, same)
            if not same:
                ts.changed = words
                ts.histogram[-1] = words
            elif t.nbytes:
                assert found is not None
                plans.append((len(tensors), False, t, found[1].start, t.word))
            tensors.append(ts)
    file_of = {e.relpath: i for i, e in enumerate(target.files)}
    base_file_of = {e.relpath: i for i, e in enumerate(base.files)}

    with FileSource(base) as base_fds, FileSource(target) as target_fds:

        def tasks() -> Iterator[Callable[[], tuple[int, bool, int, Histogram]]]:
            for index, is_blob, info, base_start, word in plans:
                relpath = blobs[index].path if is_blob else tensors[index].file
                fi = file_of[relpath]
                if is_blob:
                    bfi = base_file_of[relpath]
                else:
                    found = base.find_tensor(info.name)
                    assert found is not None
                    bfi = base_file_of[found[0].relpath]
                for offset in range(0, info.nbytes, CHUNK_BYTES):
                    size = min(CHUNK_BYTES, info.nbytes - offset)
                    yield _compare_task(
                        index, is_blob, word, target_fds, fi, info.start + offset,
                        base_fds, bfi, base_start + offset, size, device,
                    )  # fmt: skip

        for index, is_blob, changed, hist in ordered_map(tasks(), workers):
            if is_blob:
                blobs[index].changed += changed
            else:
                ts = tensors[index]
                ts.changed += changed
                ts.histogram = [a + b for a, b in zip(ts.histogram, hist, strict=True)]

    patch_bytes = None
    if measure_patch:
        patch_bytes = _measure_patch(old, new, tensors, blobs, workers, device)
    target_bytes = sum(e.size for e in target.files)
    return UpdateStats("pair", inputs, tensors, blobs, patch_bytes, target_bytes)


def _compare_task(
    index: int,
    is_blob: bool,
    word: int,
    target_fds: FileSource,
    fi: int,
    start: int,
    base_fds: FileSource,
    bfi: int,
    base_start: int,
    size: int,
    device: str | None = None,
) -> Callable[[], tuple[int, bool, int, Histogram]]:
    def run() -> tuple[int, bool, int, Histogram]:
        new = target_fds.read(fi, start, size)
        old = base_fds.read(bfi, base_start, size)
        changed, hist = word_delta_histogram(old, new, word, device)
        return index, is_blob, changed, hist

    return run


def _measure_patch(
    old: str | Path,
    new: str | Path,
    tensors: list[TensorStats],
    blobs: list[BlobStats],
    workers: int,
    device: str | None = None,
) -> int:
    with tempfile.TemporaryDirectory(prefix="pulsectl-stats-") as folder:
        path = Path(folder) / "measure.pulse"
        diff_to_path(old, new, path, options=DiffOptions(workers=workers, device=device))
        info = read_patch_info(path)
    encoded = {
        (info.header.files[item.file].path, item.name): result.encoded
        for item, result in zip(info.header.items, info.trailer.items, strict=True)
    }
    for t in tensors:
        t.encoded = encoded[(t.file, t.name)]
    for b in blobs:
        b.encoded = encoded[(b.path, None)]
    assert info.size is not None
    return info.size


# ---------------------------------------------------------------------------------------------
# A patch alone


def patch_stats(source: str | Path | BinaryIO) -> UpdateStats:
    """Figures of the update a patch carries, read (and checksum-verified) front to back.

    Counts and frame sizes come from the trailer; word deltas from the delta blocks' value
    planes. Changed words with no delta in the patch (blocks stored whole, tensors without a
    base) are counted under ``no_delta``.
    """
    reader, stream = open_patch(source)
    try:
        header = header_from_json(reader.header, reader.name)
        histograms: list[Histogram] = []
        max_payload = header.block_bytes + BLOCK_PAYLOAD_SLACK
        for index, item in enumerate(header.items):
            nblocks = blocks_in(item.nbytes, header.block_bytes)
            reader.read_frame(index, nblocks)
            hist = _empty_histogram()
            for b in range(nblocks):
                block = reader.read_block(max_payload, f"tensor {item.label!r} block {b}")
                if block.codec in DELTA_CODECS and item.name is not None:
                    nwords = min(header.block_bytes, item.nbytes - b * header.block_bytes)
                    part = delta_payload_histogram(
                        block.payload, item.word, block.codec, nwords // item.word
                    )
                    hist = [a + c for a, c in zip(hist, part, strict=True)]
            histograms.append(hist)
        trailer = trailer_from_json(reader.read_trailer(), header, reader.name)
        size = reader.offset + 16
    finally:
        if isinstance(source, (str, Path)) and str(source) != "-":
            stream.close()
    tensors: list[TensorStats] = []
    blobs: list[BlobStats] = []
    infos = {
        (fi, t.name): t
        for fi, f in enumerate(header.files)
        if f.header is not None
        for t in f.header.tensors
    }
    for item, result, hist in zip(header.items, trailer.items, histograms, strict=True):
        tfile = header.files[item.file]
        if item.name is None:
            blobs.append(BlobStats(tfile.path, item.nbytes, result.changed, result.encoded))
            continue
        info = infos[(item.file, item.name)]
        hist[-1] = result.changed - sum(hist)
        if hist[-1] < 0:
            raise CorruptPatchError(
                f"{reader.name}: tensor {item.name!r} has more word deltas than changed words",
                path=reader.name,
                tensor=item.name,
            )
        tensors.append(
            TensorStats(
                item.name,
                tfile.path,
                info.dtype,
                info.shape,
                item.nbytes // item.word,
                result.changed,
                item.base_file is not None,
                hist,
                result.encoded,
            )
        )
    inputs = {"patch": reader.name}
    covered = sum(i.nbytes for i in header.items) if header.scope == "tensors" else None
    return UpdateStats("patch", inputs, tensors, blobs, size, header.target_bytes, covered)


def delta_payload_histogram(payload: bytes, word: int, codec: int, nwords: int) -> Histogram:
    """Word-delta histogram of a delta payload (codecs 3-7) of a block of ``nwords`` words,
    from its moves alone (no base). A payload claiming more changes than ``nwords`` is
    damaged: the bound keeps a hostile count from sizing what decoding allocates."""
    codec, paired = plain_codec(codec)
    if codec == CODEC_CONTEXT:
        moved = context.decode_moves_only(payload, word, nwords, paired)
    elif codec == CODEC_RICE:
        _, moved = rice.decode_moves(payload, word, nwords, paired)
    else:
        _, moved = delta.decode_moves(payload, word, nwords)
    utype = _UINT[word]
    magnitude = np.minimum(moved, ~moved + utype(1))  # |moved| as a signed number
    if not magnitude.all():
        raise CorruptPatchError("delta block stores a change of zero")
    return _histogram_of(magnitude)


# ---------------------------------------------------------------------------------------------
# A chain


def parse_ks(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8); UsageError on anything but positive integers."""
    try:
        ks = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        ks = ()
    if not ks or ks[0] < 1:
        raise UsageError(f"--k {text!r}: give positive integers separated by commas", option="--k")
    return ks


def chain_stats(
    checkpoints: Sequence[str | Path],
    ks: Sequence[int] = DEFAULT_KS,
    *,
    as_dtype: str | None = None,
    workers: int | None = None,
    device: str | None = None,
) -> ChainStats:
    """Changed words of diff(C_i, C_{i+k}) for every k in ``ks`` and every window i.

    Only tensors count (blobs are left out). Each tensor is read once per checkpoint, chunk
    by chunk, and every window is compared on the chunk, so memory is one chunk per
    checkpoint. A tensor absent from C_i or of another dtype or shape counts as all changed.
    """
    check_name(device)
    if len(checkpoints) < 2:
        raise UsageError("a chain needs at least two checkpoints")
    ks = tuple(sorted(set(ks)))
    if not ks or ks[0] < 1:
        raise UsageError("k must be a positive integer")
    names = [str(c) for c in checkpoints]
    if as_dtype is not None:
        target_dtype(as_dtype)
        as_dtype = as_dtype.lower()  # one spelling in the JSON, as in store manifests
        with cast_temporaries(checkpoints, to=as_dtype) as casts:
            result = chain_stats(casts, ks, workers=workers, device=device)
        result.checkpoints, result.as_dtype = names, as_dtype
        return result
    workers = workers or default_workers()
    ckpts = [Checkpoint.open(c) for c in checkpoints]
    for a, b in zip(ckpts, ckpts[1:], strict=False):
        if a.layout != b.layout:  # as pair_stats and diff: like with like
            raise UsageError(
                f"{a.root} and {b.root} are not both files or both folders; compare like with like"
            )
    n = len(ckpts)
    pairs = [(k, i) for k in ks for i in range(n - k)]
    words = [sum(info.nbytes // info.word for _, info in c.tensors()) for c in ckpts]
    order: dict[str, None] = {}
    for c in reversed(ckpts):
        for _, info in c.tensors():
            order.setdefault(info.name)
    file_index = [{e.relpath: i for i, e in enumerate(c.files)} for c in ckpts]
    fds = [FileSource(c) for c in ckpts]
    changed = {k: [0] * max(0, n - k) for k in ks}
    try:
        for f in fds:
            f.__enter__()

        def tasks() -> Iterator[Callable[[], list[int]]]:
            for name in order:
                where: list[tuple[int, TensorInfo] | None] = []
                for c, index in zip(ckpts, file_index, strict=True):
                    found = c.find_tensor(name)
                    where.append(None if found is None else (index[found[0].relpath], found[1]))
                most = max(w[1].nbytes // w[1].word for w in where if w is not None)
                step = CHUNK_BYTES // 8  # words per chunk
                for w0 in range(0, most, step):
                    yield _window_task(where, fds, pairs, w0, step, device)

        for counts in ordered_map(tasks(), workers, window=workers + 1):
            for (k, i), count in zip(pairs, counts, strict=True):
                changed[k][i] += count
    finally:
        for f in fds:
            f.__exit__()
    return ChainStats(names, None, words, changed)


def _window_task(
    where: list[tuple[int, TensorInfo] | None],
    fds: list[FileSource],
    pairs: list[tuple[int, int]],
    w0: int,
    step: int,
    device: str | None = None,
) -> Callable[[], list[int]]:
    def run() -> list[int]:
        chunks: list[np.ndarray | None] = []
        for f, w in zip(fds, where, strict=True):
            if w is None:
                chunks.append(None)
                continue
            fi, info = w
            nwords = info.nbytes // info.word
            lo, hi = min(w0, nwords), min(w0 + step, nwords)
            chunk = f.read(fi, info.start + lo * info.word, (hi - lo) * info.word)
            chunks.append(chunk)
        counts = []
        for k, i in pairs:
            old, new, wo, wn = chunks[i], chunks[i + k], where[i], where[i + k]
            if new is None or wn is None:
                counts.append(0)
            elif (
                old is None
                or wo is None
                or (wo[1].dtype, wo[1].shape)
                != (
                    wn[1].dtype,
                    wn[1].shape,
                )
            ):
                counts.append(new.size // wn[1].word)
            else:
                counts.append(int(_changes(old, new, wn[1].word, device).size))
        return counts

    return run


# ---------------------------------------------------------------------------------------------
# Plot


def check_plot_target(path: str | Path, inputs: Sequence[str | Path], force: bool) -> None:
    """Before any work: refuse a plot path that is one of the command's inputs (even with
    ``force``: the PNG would replace the checkpoint or patch), ends in '/', exists (unless
    ``force``) or is a folder, and a missing matplotlib."""
    if str(path) == "-":
        raise UsageError(
            "--plot -: the plot is written as a PNG file, not to standard output; give a path "
            "(for a file named '-', its full path)",
            option="--plot",
        )
    path = file_path(path, "plot")
    for item in inputs:
        if same_file(path, item):
            raise UsageError(f"{path}: is an input of this command; write the plot elsewhere")
    refuse_inside_folder_input(path, inputs, "plot")
    check_file_target(path, force, "plot")
    _pyplot()


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; UsageError naming the extra when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed: pip install 'matplotlib>=3.7' "
            "(the plot extra)"
        ) from None
    return plt


def plot_stats(doc: dict[str, Any], path: str | Path, *, force: bool = False) -> None:
    """Draw a `stats --json` document as a PNG: density per layer and kind, or versus k.
    An existing file at ``path`` is replaced only with ``force``.

    Needs matplotlib (the ``plot`` extra); imported only here.
    """
    plt = _pyplot()
    if doc["source"] == "chain":
        fig, ax = plt.subplots(figsize=(6, 4))
        steps = [s for s in doc["steps"] if s["windows"]]
        ks = [s["k"] for s in steps]
        mean = [100 * s["mean_density"] for s in steps]
        low = [100 * s["min_density"] for s in steps]
        high = [100 * s["max_density"] for s in steps]
        ax.fill_between(ks, low, high, alpha=0.25, label="min..max over windows")
        ax.plot(ks, mean, marker="o", label="mean")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("k (steps between checkpoints)")
        ax.set_ylabel("changed words (%)")
        ax.set_title("k-step density")
        ax.legend()
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(3, 1))
        layers = doc["by_layer"]
        labels = ["-" if g["layer"] is None else str(g["layer"]) for g in layers]
        ax1.bar(labels, [100 * g["density"] for g in layers])
        ax1.set_xlabel("layer ('-': outside the blocks)")
        ax1.set_ylabel("changed words (%)")
        ax1.set_title("density per layer")
        kinds = doc["by_kind"]
        ax2.bar([g["kind"] for g in kinds], [100 * g["density"] for g in kinds])
        ax2.set_title("density per kind")
        ax2.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    try:
        with atomic_file(path, force) as f:
            fig.savefig(f, format="png", dpi=100, metadata={"Software": None})
    finally:
        plt.close(fig)
