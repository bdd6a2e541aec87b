"""Patches from and to live tensors (a model's state dict, on any device).

A state dict is treated as the safetensors file ``save_safetensors`` would write for it, so a
patch made here is byte for byte the patch ``pulsectl diff`` makes from the saved files, and a
patch made from files applies here. This module imports torch; the rest of pulsectl does not.

Trainer::

    from pulsectl.torch_api import Publisher
    publisher = Publisher()
    publisher.anchor(model.state_dict(), "anchor.safetensors")   # full checkpoint, once
    for step in range(steps):
        train_step(model)
        patch = publisher.publish(model.state_dict())   # bytes: send them anywhere

Worker::

    from pulsectl.torch_api import apply_patch
    apply_patch(model.state_dict(), patch)   # in place; refuses a wrong base, touching nothing
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import torch

from pulsectl._io import default_workers, ordered_map, window_for
from pulsectl.checkpoint import FileEntry, SafetensorsHeader, TensorInfo, build_header, parse_header
from pulsectl.codecs import decode_block, decode_moves
from pulsectl.codecs._bits import add_moves
from pulsectl.codecs.delta import find_changes
from pulsectl.diff import DiffOptions, DiffSummary, diff_checkpoints
from pulsectl.errors import CorruptPatchError, IntegrityError, OutputError, UsageError
from pulsectl.format import BLOCK_PAYLOAD_SLACK, PatchReader, blocks_in, read_trailer_at_end
from pulsectl.hashing import new_hasher
from pulsectl.patch import Item, header_from_json, trailer_from_json

__all__ = [
    "Publisher",
    "StateDictSource",
    "apply_patch",
    "make_patch",
    "state_dict_fingerprint",
    "write_patch",
]

TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _st in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
):
    if hasattr(torch, _name):
        TORCH_TO_SAFETENSORS[getattr(torch, _name)] = _st
SAFETENSORS_TO_TORCH = {v: k for k, v in TORCH_TO_SAFETENSORS.items()}
_WORD_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_WORD = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_HASH_CHUNK = 64 * 1024 * 1024
# Changed words written per indexed copy: bounds what apply_patch puts on the device besides
# the tensors (32 MiB of index and up to 32 MiB of words).
_SCATTER_WORDS = 1 << 22

PatchData = bytes | bytearray | memoryview | str | Path | BinaryIO
Level = int | Literal["max"]


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical bytes, row-major, as a flat uint8 tensor on its device (a view when
    contiguous, else a contiguous copy): the bytes safetensors saves for it."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        # One element counts as contiguous whatever its stride (scales[:, 0] of a (1, 4)
        # tensor), and torch views it as bytes only with stride 1 (found in review).
        flat = flat.as_strided((1,), (1,))
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy() if t.numel() else np.empty(0, dtype=np.uint8)


class StateDictSource:
    """A state dict as a pulsectl source: the single safetensors file it would be saved as.

    Make it on the thread that queued work on the tensors: it waits for the work queued on
    that thread's current CUDA streams, since the diff reads the tensors on other threads.
    """

    layout: Literal["file", "dir"] = "file"

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
    ) -> None:
        meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, t in tensors.items():
            _require_data(name, t)
            if t.dtype not in TORCH_TO_SAFETENSORS:
                raise UsageError(f"tensor {name!r}: dtype {t.dtype} has no safetensors dtype")
            meta[name] = (TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape))
        if metadata is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise UsageError("metadata must map strings to strings (as safetensors stores it)")
        raw, _ = build_header(meta, metadata)
        data = sum(_tensor_bytes_len(t) for t in tensors.values())
        _wait_for_queued_work(tensors.values())
        header = parse_header(raw, 8 + len(raw) + data, "<state dict>")
        self.header: SafetensorsHeader = header
        self.files: tuple[FileEntry, ...] = (
            FileEntry("", Path("<state dict>"), header.file_size, header),
        )
        self._tensors = dict(tensors)
        self._starts = [t.start for t in header.tensors]
        self._infos = list(header.tensors)
        self._by_name = {t.name: t for t in header.tensors}
        # The row-major bytes of the last non-contiguous tensor read: its blocks are read one
        # after another, and copying the whole tensor for each block would cost its size
        # squared over the block size.
        self._copied: tuple[str, torch.Tensor] | None = None
        self._copy_lock = threading.Lock()

    def read(self, file_index: int, offset: int, nbytes: int) -> np.ndarray:
        return _to_numpy(self.read_device(file_index, offset, nbytes))

    def read_device(self, file_index: int, offset: int, nbytes: int) -> torch.Tensor:
        """The same bytes as ``read``, as a uint8 tensor on the tensor's own device."""
        info = self._locate(offset, nbytes)
        lo = offset - info.start
        t = self._tensors[info.name]
        if t.is_contiguous():
            return _tensor_bytes(t)[lo : lo + nbytes]
        with self._copy_lock:
            if self._copied is None or self._copied[0] != info.name:
                self._copied = (info.name, _tensor_bytes(t))
            return self._copied[1][lo : lo + nbytes]

    def _locate(self, offset: int, nbytes: int) -> TensorInfo:
        import bisect

        i = bisect.bisect_right(self._starts, offset) - 1
        while i >= 0 and self._infos[i].nbytes == 0 and nbytes:
            i -= 1
        info = self._infos[max(i, 0)]
        if not (info.start <= offset and offset + nbytes <= info.start + info.nbytes):
            # An empty read at a zero-size tensor's offset, or a range crossing tensors.
            if nbytes == 0:
                return info
            raise ValueError(f"read of {nbytes} bytes at {offset} crosses a tensor boundary")
        return info

    def find_tensor(self, name: str) -> tuple[FileEntry, TensorInfo] | None:
        info = self._by_name.get(name)
        return None if info is None else (self.files[0], info)

    def file(self, relpath: str) -> FileEntry | None:
        return self.files[0] if relpath == "" else None

    def close(self) -> None:
        pass


def _tensor_bytes_len(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _require_data(name: object, t: object, patch_name: str | None = None) -> None:
    """Refuse what a safetensors file cannot hold as it is: an entry that is not a dense
    tensor under a string name (``_extra_state`` objects, sparse tensors), a conjugate or
    negative view (its bytes are not its values), and a tensor on the ``meta`` device (a model
    built without its weights, or one whose weights are offloaded): it has a dtype and a shape
    but no bytes to read or write."""
    where, end = (f"{patch_name}: ", "; nothing was changed") if patch_name else ("", "")
    if not isinstance(name, str):
        raise UsageError(f"{where}state dict key {name!r} is not a string{end}")
    if not isinstance(t, torch.Tensor):
        raise UsageError(
            f"{where}entry {name!r} is a {type(t).__name__}, not a tensor (a module's extra "
            f"state?); leave it out of the state dict{end}",
            tensor=name,
        )
    if hasattr(t, "__tensor_flatten__"):
        # A wrapper subclass: a DTensor (FSDP2, tensor parallel), a quantized tensor. Its own
        # bytes are not the tensor's (found in review: a raw RuntimeError from .numpy()).
        raise UsageError(
            f"{where}tensor {name!r} is a {type(t).__name__}, a tensor subclass whose data is "
            f"not one dense tensor; gather it (a DTensor's full_tensor()) or leave it out{end}",
            tensor=name,
        )
    if t.layout != torch.strided:
        raise UsageError(
            f"{where}tensor {name!r} is {t.layout}, not dense; make it dense (to_dense()) or "
            f"leave it out{end}",
            tensor=name,
        )
    if t.is_conj() or t.is_neg():
        raise UsageError(
            f"{where}tensor {name!r} is a conjugate or negative view; resolve it "
            f"(resolve_conj(), resolve_neg()) first{end}",
            tensor=name,
        )
    if t.device.type == "meta":
        raise UsageError(
            f"{where}tensor {name!r} is on the meta device: it has no data (a model made "
            f"without its weights, or with them offloaded); load its weights first{end}",
            tensor=name,
        )


def _wait_for_queued_work(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the work the calling thread has queued on its current CUDA streams.

    A source's tensors are read on other threads (the diff's workers, the thread that hashes
    the base), and torch's current stream is per thread: there they are read on each device's
    default stream, which does not wait for a stream the caller made current (``with
    torch.cuda.stream(s):``, as a trainer that overlaps work does; torch's own streams do not
    synchronise with the default stream). Without this a worker could read a tensor before the
    kernels the caller queued have written it, and the patch would silently hold stale bytes.
    """
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def _workers(workers: int | None) -> int:
    """``workers``, or one per core (up to 16) for None; anything but a positive int refused."""
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UsageError(f"workers {workers!r}: give 1 or more, or None for all cores")
    return workers


def _options(level: Level, workers: int | None, *states: Mapping[str, torch.Tensor]) -> DiffOptions:
    """Diff options; changed words are found on the tensors' device when it is not the CPU."""
    from pulsectl._names import MAX_PRESET_LEVEL

    workers = _workers(workers)
    if level != "max" and (
        isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 22
    ):
        raise UsageError(f"level {level!r}: give 1..22 or 'max'")
    devices = {t.device for state in states for t in state.values()}
    device = None
    if len(devices) == 1 and devices != {torch.device("cpu")}:
        from pulsectl.device import chosen

        device = chosen(str(devices.pop()))  # where the tensors are: the host path if it fails
    if level == "max":
        return DiffOptions(level=MAX_PRESET_LEVEL, context=True, workers=workers, device=device)
    return DiffOptions(level=int(level), workers=workers, device=device)


def write_patch(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    out: str | Path | BinaryIO,
    *,
    level: Level = 3,
    metadata: Mapping[str, str] | None = None,
    workers: int | None = None,
) -> DiffSummary:
    """Write the patch from state dict ``old`` to ``new`` to a path or a binary file object.

    >>> summary = write_patch(before, model.state_dict(), "step_001.pulse")  # doctest: +SKIP
    """
    base = StateDictSource(old, metadata)
    target = StateDictSource(new, metadata)
    options = _options(level, workers, old, new)
    if isinstance(out, (str, Path)):
        from pulsectl.diff import diff_to_path

        return diff_to_path(base, target, out, force=True, options=options)
    try:
        return diff_checkpoints(base, target, out, options=options)
    except OSError as exc:  # the caller's stream (a socket, a pipe) failed
        where = str(getattr(out, "name", "<stream>"))
        raise OutputError(f"{where}: cannot write the patch: {exc.strerror or exc}") from exc


def make_patch(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    level: Level = 3,
    metadata: Mapping[str, str] | None = None,
    workers: int | None = None,
) -> bytes:
    """The patch from state dict ``old`` to ``new``, as bytes.

    >>> patch = make_patch(before, model.state_dict())  # doctest: +SKIP
    """
    buf = io.BytesIO()
    write_patch(old, new, buf, level=level, metadata=metadata, workers=workers)
    return buf.getvalue()


def state_dict_fingerprint(
    state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> str:
    """The fingerprint `pulsectl hash` would print for the saved state dict."""
    # StateDictSource checks the entries, builds the header and waits for queued work.
    return _fingerprint_as(state, StateDictSource(state, metadata).header)


@dataclass
class Publisher:
    """Remembers the last published state and turns each new one into a patch.

    The remembered state is a host copy (``keep_on_device=False``, the default) or a clone on
    the tensors' device. ``level`` is 1..22 or ``"max"``; ``metadata`` goes into the (virtual)
    safetensors header, e.g. ``{"format": "pt"}`` to match what transformers saves.
    """

    level: Level = 3
    metadata: Mapping[str, str] | None = None
    keep_on_device: bool = False
    workers: int | None = None

    def __post_init__(self) -> None:
        self._last: dict[str, torch.Tensor] | None = None
        self.fingerprint: str | None = None  # of the last published state
        self.step = 0

    def anchor(self, state: Mapping[str, torch.Tensor], out: str | Path | None = None) -> str:
        """Remember ``state`` as the base of the next patch; optionally save it to ``out``.

        When saving fails, the publisher still holds the previous anchor (and fingerprint)."""
        _options(self.level, self.workers)  # a bad level or workers: refused now, not later
        snapshot = self._snapshot(state)
        if out is not None:
            from pulsectl.checkpoint import save_safetensors

            save_safetensors(
                out,
                {
                    name: (
                        TORCH_TO_SAFETENSORS[t.dtype],
                        tuple(t.shape),
                        _to_numpy(_tensor_bytes(t)),
                    )
                    for name, t in snapshot.items()
                },
                self.metadata,
            )
        fingerprint = state_dict_fingerprint(snapshot, self.metadata)
        self._last, self.fingerprint = snapshot, fingerprint
        return fingerprint

    def publish(
        self, state: Mapping[str, torch.Tensor], out: str | Path | BinaryIO | None = None
    ) -> bytes | DiffSummary:
        """The patch from the last published state to ``state`` (bytes, or written to ``out``).

        ``state`` becomes the new last published state.
        """
        if self._last is None:
            raise UsageError("Publisher.publish: call anchor() with the starting state first")
        if out is None:
            result: bytes | DiffSummary = make_patch(
                self._last, state, level=self.level, metadata=self.metadata, workers=self.workers
            )
            target_fp = _target_of(result)  # type: ignore[arg-type]
        else:
            result = write_patch(
                self._last,
                state,
                out,
                level=self.level,
                metadata=self.metadata,
                workers=self.workers,
            )
            target_fp = result.target_fingerprint
        self._last = self._snapshot(state)
        self.fingerprint = target_fp
        self.step += 1
        return result

    def _snapshot(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for name, t in state.items():
            _require_data(name, t)
        if self.keep_on_device:
            kept = {k: v.detach().clone() for k, v in state.items()}
            # The clones are queued on the caller's stream: done before the trainer's next
            # step (on any stream) can change what they copy.
            _wait_for_queued_work(kept.values())
            return kept
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _target_of(patch: bytes) -> str:
    stream = io.BytesIO(patch)
    reader = PatchReader(stream, "<patch>")
    header = header_from_json(reader.header, reader.name)
    return trailer_from_json(
        read_trailer_at_end(stream, "<patch>"), header, "<patch>"
    ).target_fingerprint


def _read_all(patch: PatchData) -> tuple[bytes, str]:
    if isinstance(patch, (bytes, bytearray, memoryview)):
        return bytes(patch), "<patch>"
    if isinstance(patch, (str, Path)):
        from pulsectl.errors import InputError

        try:
            return Path(patch).read_bytes(), str(patch)
        except OSError as exc:
            raise InputError(f"{patch}: cannot read patch: {exc.strerror}", path=patch) from exc
    name = str(getattr(patch, "name", "<stream>"))
    if isinstance(patch, io.TextIOBase):  # its reads are str, decoded (found in review)
        raise UsageError(f"{name}: the patch is open in text mode; open it with 'rb'")
    return patch.read(), name


@dataclass(frozen=True)
class _Update:
    name: str
    positions: np.ndarray | None  # word indices into the tensor (None: replace the tensor)
    words: np.ndarray  # new words at ``positions``, or every byte of the new tensor


def apply_patch(
    state: MutableMapping[str, torch.Tensor],
    patch: PatchData,
    *,
    workers: int | None = None,
    replace: bool | None = None,
) -> str:
    """Apply a single-file patch to ``state`` in place; returns the target fingerprint.

    Nothing is modified unless every base tensor the patch reads has the fingerprint the patch
    expects, every decoded tensor has the fingerprint the patch promises and every write can be
    made: the changes are decoded and verified on the host first, then written into the tensors
    (on their device) with indexed copies of at most 4 Mi words each. A tensor is patched by
    its logical row-major bytes (what safetensors saves), so a non-contiguous one
    (channels_last, a transposed view) is patched through its strides, keeping its layout;
    one whose elements share memory (an expanded view) is refused. So is a write into memory
    another entry also spans (tied weights, overlapping views), unless the two are the same
    view and the patch gives both the same target fingerprint (a tied embedding and output
    weight changed together).

    A patch that adds a tensor, removes one or changes one's dtype or shape cannot be applied in
    place: it changes the mapping (tensors the target does not have are removed from ``state``;
    new or replaced ones are put in it, on the device of the tensor they replace, or of the
    first one not on the meta device). ``replace=None`` (the default) does that for a mapping
    of its own, such as ``load_file``'s dict, and refuses, before any write, a module's state
    dict (one made by ``model.state_dict()``, or holding ``nn.Parameter`` entries): the module
    would silently keep its old tensors. ``replace=True`` changes the mapping anyway (a
    module's parameters are then not touched); ``replace=False`` refuses such a patch for any
    mapping. A tensor on the meta device that the patch keeps or replaces is refused too: it
    has no data. An entry the target lacks that is the same view as a tensor patched in place
    (a tied head that ``save_model`` wrote once) follows it: kept where the mapping may not
    change, not refused.

    >>> apply_patch(model.state_dict(), patch_bytes)  # doctest: +SKIP
    """
    data, name = _read_all(patch)
    stream = io.BytesIO(data)
    reader = PatchReader(stream, name)
    header = header_from_json(reader.header, name)
    if header.layout != "file":
        raise UsageError(
            f"{name}: a folder patch applies to folders (apply_patches), not a state dict"
        )
    trailer = trailer_from_json(read_trailer_at_end(io.BytesIO(data), name), header, name)
    tfile = header.files[0]
    assert tfile.header is not None
    targets = {t.name: t for t in tfile.header.tensors}
    for key, entry in state.items():
        if key in targets:
            _require_data(key, entry, name)
        elif not isinstance(entry, torch.Tensor):  # one the patch removes is only deleted
            _require_data(key, entry, name)  # but it must be a tensor: refused there
    workers = _workers(workers)
    if header.scope == "tensors":
        # A block patch binds only its tensors; the others must be there as the target's
        # header has them (as `pulsectl apply` checks a file's header), whatever their values.
        for info in tfile.header.tensors:
            t = state.get(info.name)
            if t is None or not isinstance(t, torch.Tensor):
                raise IntegrityError(
                    f"{name}: wrong base: the state dict has no tensor {info.name!r}; a block "
                    "patch applies to the model it was made for",
                    tensor=info.name,
                )
            if TORCH_TO_SAFETENSORS.get(t.dtype) != info.dtype or tuple(t.shape) != info.shape:
                raise IntegrityError(
                    f"{name}: wrong base: tensor {info.name!r} is {t.dtype} {tuple(t.shape)}, "
                    f"the patch's model has {info.dtype} {list(info.shape)}",
                    tensor=info.name,
                )

    # 1. The base: every tensor the patch reads must be there, with the expected bytes.
    for item in header.items:
        if item.base_name is None:
            continue
        if item.base_name != item.name:
            raise UsageError(
                f"{name}: tensor {item.name!r} is patched from base tensor {item.base_name!r}; a "
                "state dict is patched tensor by tensor in place: apply this patch to the saved "
                "files (apply_patches)",
                tensor=item.name,
            )
        t = state.get(item.base_name)
        want = targets[item.name] if item.name is not None else None
        if t is None:
            raise IntegrityError(
                f"{name}: wrong base: the state dict has no tensor {item.base_name!r}; apply "
                "the patch to the state it was made from",
                tensor=item.base_name,
            )
        if want is not None and (
            TORCH_TO_SAFETENSORS.get(t.dtype) != want.dtype or tuple(t.shape) != want.shape
        ):
            raise IntegrityError(
                f"{name}: wrong base: tensor {item.base_name!r} is {t.dtype} {tuple(t.shape)}, "
                f"the patch expects {want.dtype} {list(want.shape)}",
                tensor=item.base_name,
            )
        got = _fingerprint_tensor(t)
        if got != item.base_fingerprint:
            raise IntegrityError(
                f"{name}: wrong base: tensor {item.base_name!r} has fingerprint {got}, the patch "
                f"expects {item.base_fingerprint}; apply the patch to the state it was made from",
                tensor=item.base_name,
                expected=item.base_fingerprint,
                actual=got,
            )

    # Tied entries that a deduplicating writer left out of the file (save_model and HF
    # save_pretrained keep a tied output weight once): they follow their twin's in-place writes.
    carried_whole = {item.name for item in header.items if item.base_name is None}
    followers = _tied_followers(state, targets, carried_whole)
    keep_followers = _check_entries(
        state, header.items, targets, name, replace, followers, block=header.scope == "tensors"
    )

    # 2. Decode and verify everything on the host; nothing is touched yet. The workers read
    # the base tensors on their own threads, so on each device's default stream, not the
    # caller's current one; step 1 read every one of them on the caller's stream with a
    # blocking copy, so the work the caller queued on them is done.
    bb = header.block_bytes
    updates: list[_Update] = []

    def tasks() -> Iterator[Callable[[], tuple[np.ndarray | None, np.ndarray, np.ndarray | None]]]:
        for index, item in enumerate(header.items):
            nblocks = blocks_in(item.nbytes, bb)
            reader.read_frame(index, nblocks)
            base_bytes = (
                _tensor_bytes(state[item.base_name]) if item.base_name is not None else None
            )
            if base_bytes is not None and base_bytes.device.type == "cuda":
                # A non-contiguous tensor's copy was queued on this thread's current stream;
                # the workers read it on the device's default stream.
                _wait_for_queued_work([base_bytes])
            for b in range(nblocks):
                size = min(bb, item.nbytes - b * bb)
                block = reader.read_block(bb + BLOCK_PAYLOAD_SLACK, f"tensor {item.label!r}")
                yield _decode(block.codec, block.payload, base_bytes, b * bb, size, item.word)

    results = ordered_map(tasks(), workers, window_for(workers, bb))
    for item, promised in zip(header.items, trailer.items, strict=True):
        assert item.name is not None
        h = new_hasher()
        positions: list[np.ndarray] = []
        words: list[np.ndarray] = []
        for b in range(blocks_in(item.nbytes, bb)):
            old, new, pos = next(results)
            h.update(new)
            if item.base_name is None:
                words.append(new)
            else:
                assert old is not None
                if pos is None:  # a block stored whole: compare to find what changed
                    pos = find_changes(old, new, item.word)
                positions.append(pos + b * bb // item.word)
                words.append(new.view(_NP_WORD[item.word])[pos])
        got = h.hexdigest()
        if got != promised.fingerprint:
            raise IntegrityError(
                f"{name}: tensor {item.name!r} decodes to fingerprint {got}, the patch promises "
                f"{promised.fingerprint}; nothing was changed",
                tensor=item.name,
                expected=promised.fingerprint,
                actual=got,
            )
        if item.base_name is None:
            updates.append(_Update(item.name, None, _concat(words, np.uint8)))
        else:
            updates.append(
                _Update(
                    item.name, _concat(positions, np.int64), _concat(words, _NP_WORD[item.word])
                )
            )
    # Every frame head is read, those of trailing items without blocks (empty tensors) too:
    # the generator stops at the last block otherwise (one worker runs it inline).
    for _ in results:
        raise CorruptPatchError(f"{name}: more blocks than its items hold")
    reader.read_trailer()  # the whole-file checksum

    # 3. Everything that could refuse is checked before the first write: where each changed
    # word lies in memory (a non-contiguous tensor is patched through its strides), and that
    # no write changes another entry that shares its memory.
    writes: dict[str, tuple[torch.Tensor, np.ndarray]] = {}
    for update in updates:
        if update.positions is not None and update.positions.size:
            info = targets[update.name]
            writes[update.name] = _locate_words(
                name, update.name, state[update.name], info.word, update.positions
            )
    replaced = {update.name for update in updates if update.positions is None}
    for key in replaced:
        if targets[key].dtype not in SAFETENSORS_TO_TORCH:
            raise UsageError(
                f"{name}: tensor {key!r} is {targets[key].dtype}, which torch has no dtype for; "
                "apply this patch to the saved files (apply_patches); nothing was changed",
                tensor=key,
            )
    kept = [key for key in state if key in targets and key not in replaced]
    promised_fps = {
        item.name: promised.fingerprint
        for item, promised in zip(header.items, trailer.items, strict=True)
    }
    _check_aliases(name, state, kept, writes.keys(), promised_fps)

    # 4. Write.
    default_device = next(
        (t.device for t in state.values() if t.device.type != "meta"), torch.device("cpu")
    )
    for update in updates:
        info = targets[update.name]
        if update.positions is None:
            device = state[update.name].device if update.name in state else default_device
            raw = torch.from_numpy(update.words.copy())
            dtype = SAFETENSORS_TO_TORCH[info.dtype]
            new_t = (
                raw.view(dtype).reshape(info.shape)
                if info.nbytes
                else torch.empty(info.shape, dtype=dtype)
            )
            state[update.name] = new_t.to(device)
        elif update.name in writes:
            memory, index = writes[update.name]
            # In slices: the index (8 bytes a word) and the words are copied to the device
            # first, and a tensor whose every word changed would need five times its size
            # (a BF16 one) there at once.
            for lo in range(0, index.size, _SCATTER_WORDS):
                where = torch.from_numpy(index[lo : lo + _SCATTER_WORDS]).to(memory.device)
                memory[where] = torch.from_numpy(update.words[lo : lo + _SCATTER_WORDS]).to(
                    memory.device
                )
    for key in [k for k in state if k not in targets and header.scope != "tensors"]:
        if not (keep_followers and key in followers):
            del state[key]
    if header.scope == "tensors":
        # The target's fingerprint is the state's only once every block is in: say what the
        # state is now, as apply_patches does for a file.
        return _fingerprint_as(state, tfile.header)
    return trailer.target_fingerprint


def _fingerprint_as(state: Mapping[str, torch.Tensor], header: SafetensorsHeader) -> str:
    """The fingerprint of the file ``header`` describes, holding the tensors of ``state``."""
    h = new_hasher()
    h.update(len(header.raw).to_bytes(8, "little") + header.raw)
    for info in header.tensors:
        flat = _tensor_bytes(state[info.name])
        for off in range(0, info.nbytes, _HASH_CHUNK):
            h.update(_to_numpy(flat[off : off + _HASH_CHUNK]))
    return h.hexdigest()


def _tied_followers(
    state: Mapping[str, torch.Tensor],
    targets: Mapping[str, TensorInfo],
    carried_whole: Collection[str | None],
) -> dict[str, str]:
    """Entries of ``state`` the target does not have that are the same view of the same memory
    as an entry it patches in place (``{follower: twin}``): a tied output weight that
    ``save_model`` or ``save_pretrained`` wrote once, under its twin's name. Writing the twin
    updates them; removing them from a module's state dict would change nothing."""
    views: dict[tuple[Any, ...], str] = {}
    for key, t in state.items():
        if key in targets and key not in carried_whole and t.numel():
            views.setdefault(_view_key(t), key)
    out: dict[str, str] = {}
    for key, t in state.items():
        if key not in targets and t.numel():
            twin = views.get(_view_key(t))
            if twin is not None:
                out[key] = twin
    return out


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _check_entries(
    state: Mapping[str, torch.Tensor],
    items: tuple[Item, ...],
    targets: Mapping[str, TensorInfo],
    patch_name: str,
    replace: bool | None,
    followers: Collection[str] = (),
    block: bool = False,
) -> bool:
    """Refuse, before anything is written, a patch that must add, remove or replace entries of
    ``state`` when ``replace`` says no (see apply_patch). Tied ``followers`` of a tensor patched
    in place are not counted as removed; returns whether to keep them in ``state`` (the mapping
    may not change: a module's, or ``replace=False``)."""
    replaced = [item.name for item in items if item.base_name is None and item.name is not None]
    # A block patch replaces its own tensors and nothing else: an entry the checkpoint lacks (a
    # buffer saved apart, say) stays, as a full patch would remove it.
    removed = [] if block else [key for key in state if key not in targets and key not in followers]
    if replace is True:
        return False
    # A module's: model.state_dict() (its `_metadata`), or any mapping that holds a Parameter
    # (found in review: a dict of named_parameters() and named_buffers() had a buffer replaced
    # in the dict only, and the module kept its old one).
    module = getattr(state, "_metadata", None) is not None or any(
        isinstance(t, torch.nn.Parameter) for t in state.values()
    )
    if replace is None and not module:
        return False
    if not (replaced or removed):
        return True
    if replaced:
        key = replaced[0]
        info = targets[key]
        old = state.get(key)
        what = (
            f"adds tensor {key!r}"
            if old is None
            else f"replaces tensor {key!r} ({TORCH_TO_SAFETENSORS.get(old.dtype, old.dtype)} "
            f"{list(old.shape)} -> {info.dtype} {list(info.shape)})"
        )
    else:
        key = removed[0]
        what = f"removes tensor {key!r}"
    more = len(replaced) + len(removed) - 1
    what += f" (and changes {more} more entries)" if more else ""
    if module:
        why = (
            "this mapping is an nn.Module's (model.state_dict() or its Parameters), and the "
            "module would keep its old tensors: "
            "rebuild the module from the patched checkpoint (apply_patches on the saved files), "
            "or pass replace=True to change only this mapping"
        )
    else:
        why = "replace=False allows only in-place changes"
    raise UsageError(
        f"{patch_name}: the patch {what}, which cannot be done in place; {why}; nothing was "
        "changed",
        tensor=key,
    )


def _check_aliases(
    patch_name: str,
    state: Mapping[str, torch.Tensor],
    kept: list[str],
    written: Collection[str],
    promised: Mapping[str | None, str],
) -> None:
    """Refuse, before anything is written, a write into memory that another kept entry of
    ``state`` also uses (tied weights, overlapping views): it would change that entry too. Tied
    entries (the same view of the same memory) are fine when the patch writes both and gives
    them the same target fingerprint. Overlap is judged by the byte ranges the tensors span."""
    spans = []
    for key in kept:
        t = state[key]
        if t.numel():
            start = t.data_ptr()
            end = start + _span(tuple(t.shape), tuple(t.stride())) * t.element_size()
            spans.append((str(t.device), start, end, key))
    spans.sort()
    for i, (device, start, end, key) in enumerate(spans):
        for device2, start2, _, key2 in spans[i + 1 :]:
            if device2 != device or start2 >= end:
                break
            if key not in written and key2 not in written:
                continue
            a, b = state[key], state[key2]
            same_view = (start, a.dtype, a.shape, a.stride()) == (
                start2,
                b.dtype,
                b.shape,
                b.stride(),
            )
            both = key in written and key2 in written
            if same_view and both and promised[key] == promised[key2]:
                continue  # tied, and both get the same bytes
            changed, other = (key, key2) if key in written else (key2, key)
            if not same_view:
                why = (
                    f"span overlapping memory, so writing {changed!r} may change {other!r} "
                    "(views that interleave without sharing elements are refused too)"
                )
            elif both:
                why = "are tied (the same memory), and the patch gives them different values"
            else:
                why = f"are tied (the same memory), and the patch changes {changed!r} only"
            raise UsageError(
                f"{patch_name}: tensors {key!r} and {key2!r} {why}; apply the patch to a state "
                "dict whose tensors do not share memory (e.g. clone one of them); nothing was "
                "changed",
                tensor=changed,
            )


def _word_view(t: torch.Tensor, word: int) -> torch.Tensor:
    """``t`` as integer words of ``word`` bytes over the same memory, in the order of its logical
    bytes (a complex tensor as its real and imaginary parts)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.element_size() != word:
        raise UsageError(f"a {t.dtype} tensor has no {word}-byte words")
    return t.view(_WORD_DTYPE[word])


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a non-empty strided tensor's first element to its last one, inclusive."""
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def _may_self_overlap(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """False when no two elements of the strided tensor can share memory (a sufficient test:
    True for an expanded view, and for exotic interleavings it cannot prove apart)."""
    reach = 0  # the farthest element the dimensions of smaller stride reach
    for step, size in sorted((st, sz) for sz, st in zip(shape, stride, strict=True) if sz > 1):
        if step <= reach:
            return True
        reach += (size - 1) * step
    return False


def _locate_words(
    patch_name: str, name: str, t: torch.Tensor, word: int, positions: np.ndarray
) -> tuple[torch.Tensor, np.ndarray]:
    """Where the words at logical ``positions`` of tensor ``t`` lie in its memory: a flat word
    view over the memory it spans and the index of each word in it. Refuses, before anything is
    written, a tensor whose elements share memory (an expanded view): no in-place write can
    give its elements different values."""
    words = _word_view(t, word)
    shape, stride = tuple(words.shape), tuple(words.stride())
    if _may_self_overlap(shape, stride):
        raise UsageError(
            f"{patch_name}: tensor {name!r} is a view whose elements share memory (stride "
            f"{list(t.stride())} for shape {list(t.shape)}, e.g. expanded); cannot patch it in "
            "place: give apply_patch a contiguous copy (.contiguous()); nothing was changed",
            tensor=name,
        )
    memory = words.as_strided((_span(shape, stride),), (1,))
    if words.is_contiguous():
        return memory, positions
    index = np.zeros_like(positions)
    rest = positions.copy()
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        index += (rest % size) * step
        rest //= size
    return memory, index


def _decode(
    codec: int, payload: bytes, base: torch.Tensor | None, offset: int, size: int, word: int
) -> Callable[[], tuple[np.ndarray | None, np.ndarray, np.ndarray | None]]:
    def run() -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
        old = None if base is None else _to_numpy(base[offset : offset + size])
        moves = None if old is None else decode_moves(codec, payload, old, word)
        if moves is None:
            return old, decode_block(codec, payload, old, size, word), None
        assert old is not None
        new = old.copy()
        add_moves(new, moves[0], moves[1], word)
        return old, new, moves[0]  # the changed words, known without comparing again

    return run


def _fingerprint_tensor(t: torch.Tensor) -> str:
    flat = _tensor_bytes(t)
    h = new_hasher()
    for off in range(0, flat.numel(), _HASH_CHUNK):
        h.update(_to_numpy(flat[off : off + _HASH_CHUNK]))
    return h.hexdigest()


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
