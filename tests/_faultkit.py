"""Inputs and checks shared by the fault suites (fuzz, bit flips, kills, faults).

Small checkpoints whose patch exercises every block codec, a parser that splits a patch into
header JSON, frames and trailer JSON, and a rebuilder that writes them back with valid checksums
(so a mutation reaches the validator or the codec instead of stopping at a checksum).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from pulsectl import format as pulse_format
from pulsectl.apply import apply_patches
from pulsectl.checkpoint import save_safetensors
from pulsectl.diff import DiffOptions, diff_checkpoints
from pulsectl.errors import PulseError
from pulsectl.format import BLOCK_PAYLOAD_SLACK, PatchReader, PatchWriter, blocks_in
from pulsectl.patch import header_from_json

TEMP_MARK = ".pulsectl-tmp-"


def bf16_words(rng: np.random.Generator, n: int, scale: float = 0.02) -> np.ndarray:
    """``n`` BF16 words (uint16) of normal values, truncated from float32."""
    return (rng.normal(0.0, scale, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def nudge(rng: np.random.Generator, words: np.ndarray, fraction: float) -> np.ndarray:
    """A copy with ``fraction`` of the words moved by one unit in the last place."""
    out = words.copy()
    picks = rng.choice(words.size, max(1, int(words.size * fraction)), replace=False)
    out[picks] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), picks.size)
    return out


def write_small_pair(folder: Path, seed: int = 1234) -> tuple[Path, Path]:
    """base/new single files whose patch uses every codec (context at ``--level max``)."""
    rng = np.random.default_rng(seed)
    big = bf16_words(rng, 4096)  # 8 KiB: two 4 KiB blocks
    same = bf16_words(rng, 64)
    ctx = bf16_words(rng, 2048, 1.0)  # 4 KiB: changes where the exponent is small (codec 4)
    exponents = (ctx >> 7) & 0xFF
    small = np.flatnonzero(exponents < np.quantile(exponents, 0.25))
    ctx_new = ctx.copy()
    ctx_new[rng.choice(small, small.size // 2, replace=False)] += 1
    run = bf16_words(rng, 512)  # a contiguous run of moves: byte-planed gaps win (codec 3)
    run_new = run.copy()
    run_new[100:400] += 1
    # Moves of one unit down or up pair up (value plane 0 paired: codecs 6 and 7); moves all
    # +1 compress as well plain (codecs 4 and 5, the plain twins).
    more = np.random.default_rng(seed + 1)
    a_new = nudge(rng, big, 0.02)
    a_new[2048:] = big[2048:] + (a_new[2048:] != big[2048:])  # second block: all +1 (codec 5)
    ctx2 = bf16_words(more, 2048, 1.0)
    ctx2_new = ctx2.copy()
    small2 = np.flatnonzero(((ctx2 >> 7) & 0xFF) < np.quantile((ctx2 >> 7) & 0xFF, 0.25))
    picks = more.choice(small2, small2.size // 2, replace=False)
    ctx2_new[picks] += more.choice(np.array([1, 0xFFFF], dtype=np.uint16), picks.size)
    base = {
        "a.weight": ("BF16", [64, 64], big),
        "e.weight": ("BF16", [2048], ctx),
        "b.weight": ("BF16", [64], same),
        "d.mask": ("U8", [256], rng.integers(0, 256, 256, dtype=np.uint8)),
        "f.weight": ("BF16", [512], run),
        "g.weight": ("BF16", [2048], ctx2),
    }
    new = {
        "a.weight": ("BF16", [64, 64], a_new),
        "b.weight": ("BF16", [64], same),
        "c.bias": ("F32", [6], rng.normal(0, 1, 6).astype(np.float32)),  # new: store
        "d.mask": ("I8", [256], np.zeros(256, dtype=np.int8)),  # dtype changed: zstd
        "e.weight": ("BF16", [2048], ctx_new),
        "f.weight": ("BF16", [512], run_new),
        "g.weight": ("BF16", [2048], ctx2_new),
    }
    base_path, new_path = folder / "base.safetensors", folder / "new.safetensors"
    save_safetensors(base_path, base, {"format": "pt"})
    save_safetensors(new_path, new, {"format": "pt", "step": "1"})
    return base_path, new_path


def write_small_folders(folder: Path, seed: int = 99) -> tuple[Path, Path]:
    """base/new folder checkpoints: two shards, a changed blob, a new blob, a removed blob."""
    rng = np.random.default_rng(seed)
    w1, w2 = bf16_words(rng, 2048), bf16_words(rng, 512)
    base, new = folder / "base", folder / "new"
    for root in (base, new):
        (root / "sub").mkdir(parents=True)
    save_safetensors(base / "model-00001-of-00002.safetensors", {"w1": ("BF16", [2048], w1)})
    save_safetensors(base / "model-00002-of-00002.safetensors", {"w2": ("BF16", [512], w2)})
    save_safetensors(
        new / "model-00001-of-00002.safetensors", {"w1": ("BF16", [2048], nudge(rng, w1, 0.03))}
    )
    save_safetensors(new / "model-00002-of-00002.safetensors", {"w2": ("BF16", [512], w2)})
    (base / "config.json").write_text('{"step": 100, "lr": 0.001}\n')
    (new / "config.json").write_text('{"step": 101, "lr": 0.001}\n')  # same size
    (base / "sub" / "old.txt").write_text("gone\n")
    (new / "sub" / "notes.txt").write_text("fresh blob\n" * 5)
    return base, new


def make_patch(base: Path, new: Path, *, level: str = "3", block_bytes: int = 4096) -> bytes:
    """The patch from ``base`` to ``new`` in memory (one worker, small blocks)."""
    options = DiffOptions(
        level=19 if level == "max" else int(level),
        context=level == "max",
        block_bytes=block_bytes,
        workers=1,
    )
    buf = io.BytesIO()
    diff_checkpoints(base, new, buf, options=options)
    return buf.getvalue()


@dataclass
class ParsedPatch:
    """A patch taken apart: header JSON, each frame's blocks, trailer JSON, region offsets."""

    header: dict[str, Any]
    frames: list[list[tuple[int, bytes]]]
    trailer: dict[str, Any]
    boundaries: list[int] = field(default_factory=list)  # offsets where a part starts

    def codecs(self) -> set[int]:
        return {codec for frame in self.frames for codec, _ in frame}


def parse_patch(data: bytes) -> ParsedPatch:
    """Split a valid patch into its parts (raises if it is not valid)."""
    reader = PatchReader(io.BytesIO(data), "<parse>")
    header = header_from_json(reader.header, "<parse>")
    boundaries = [0, 24, reader.offset]
    frames: list[list[tuple[int, bytes]]] = []
    for index, item in enumerate(header.items):
        nblocks = blocks_in(item.nbytes, header.block_bytes)
        reader.read_frame(index, nblocks)
        blocks = []
        for _ in range(nblocks):
            boundaries.append(reader.offset)
            block = reader.read_block(header.block_bytes + BLOCK_PAYLOAD_SLACK, "block")
            blocks.append((block.codec, block.payload))
        frames.append(blocks)
        boundaries.append(reader.offset)
    trailer_offset = reader.offset
    trailer = reader.read_trailer()
    boundaries += [trailer_offset, len(data) - 24, len(data) - 16, len(data) - 8, len(data)]
    boundaries += reader.frame_offsets
    trailer.pop("frames", None)
    return ParsedPatch(reader.header, frames, trailer, sorted(set(boundaries)))


# JSON texts that no Python value dumps to: huge integers, deep nesting, non-finite numbers,
# lone surrogates. A fuzzed value that is one of the placeholders is written as the token.
RAW_TOKENS = [
    "9" * 5000,
    "-" + "7" * 4400,
    "[" * 50000 + "]" * 50000,
    '{"a":' * 20000 + "1" + "}" * 20000,
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "1.0",
    "-0",
    '"\\ud800"',
]
PLACEHOLDERS = [f"\x00RAW{i}\x00" for i in range(len(RAW_TOKENS))]


def json_text(obj: Any, *, canonical: bool = True) -> bytes:
    """``obj`` as JSON text, with every placeholder string replaced by its raw token."""
    if canonical:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    else:
        text = json.dumps(obj, separators=(",", ":"))
    for i, token in enumerate(RAW_TOKENS):
        text = text.replace(f'"\\u0000RAW{i}\\u0000"', token)
    return text.encode()


def build_patch(
    header: Any, frames: list[list[tuple[int, bytes]]], trailer: Any, items: list[int] | None = None
) -> bytes:
    """Write a patch from parts with valid checksums; ``items`` overrides each frame's item index.

    ``header`` may be a JSON value or JSON text (bytes), written as is.
    """
    buf = io.BytesIO()
    if isinstance(header, bytes):
        text = header
        with mock.patch.object(pulse_format, "canonical_json", lambda obj: text):
            writer = PatchWriter(buf, {})
    else:
        writer = PatchWriter(buf, header)
    for index, blocks in enumerate(frames):
        writer.begin_frame(index if items is None else items[index], len(blocks))
        for codec, payload in blocks:
            writer.add_block(codec, payload)
    writer.finish(trailer)
    return buf.getvalue()


class _Summary:
    """Prints the fault suites' counts at the end of the run, whatever the capture mode."""

    def __init__(self) -> None:
        self.lines: dict[str, str] = {}

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.section("pulsectl fault suites")
        for title, line in self.lines.items():
            terminalreporter.write_line(f"{title}: {line}")


def report(config: Any, title: str, line: str) -> None:
    """Add (or replace) one line of the end-of-run summary."""
    plugin = config.pluginmanager.get_plugin("pulsectl-fault-summary")
    if plugin is None:
        plugin = _Summary()
        config.pluginmanager.register(plugin, "pulsectl-fault-summary")
    plugin.lines[title] = line


def temps_in(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if TEMP_MARK in p.name]


@contextmanager
def scratch_dir(prefix: str = "pulsectl-fault-") -> Iterator[Path]:
    """A fresh folder on a RAM disk when there is one (fsync is cheap there)."""
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix=prefix, dir=root) as name:
        yield Path(name)


def snapshot(path: Path) -> bytes | dict[str, bytes]:
    """A file's bytes, or every file of a folder by relative path."""
    if path.is_file():
        return path.read_bytes()
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def apply_outcome(
    base: Path, patch: bytes, out: Path, expected: bytes | dict[str, bytes] | None
) -> str:
    """Apply ``patch`` (a stream) to ``base``; "caught" for a clean PulseError, "ok" if correct.

    On an error the output and any temp file must be absent and the message one line. On
    success the output must equal ``expected`` (when given) and is removed again. Any other
    exception propagates: that is a miss.
    """
    try:
        apply_patches(base, [io.BytesIO(patch)], out, workers=1)
    except PulseError as exc:
        assert "\n" not in str(exc), f"multi-line message: {exc!s}"
        assert str(exc), "empty message"
        assert not out.exists(), f"output left behind after: {exc}"
        assert not temps_in(out.parent), f"temp file left behind after: {exc}"
        return "caught"
    got = snapshot(out)
    if out.is_dir():
        shutil.rmtree(out)
    else:
        out.unlink()
    assert not temps_in(out.parent)
    if expected is not None:
        assert got == expected, "apply succeeded with a wrong result"
    return "ok"


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small file system mounted at ``path`` (made here), for a disk that fills up; the test
    is skipped where mounting needs a root this process does not have."""
    import pytest

    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def read_only(path: Path) -> None:
    """Remount the tmpfs at ``path`` read-only (as root, chmod does not stop writes)."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
