"""diff's memory-mapped reads (pulsectl._io.map_range, pulsectl/_speedups.c): the bytes of
pread, the same patches, and a file that gets shorter under a map ends the process with one
error line and no temp output left, as the pread path fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TEMP_GLOB, assert_roundtrip, patch_bytes
from hypothesis import given, settings
from hypothesis import strategies as st

import pulsectl._io
from pulsectl._io import map_range, pread_array
from pulsectl.codecs import _fast

needs_native = pytest.mark.skipif(_fast.native is None, reason="the C extension is not loaded")


@needs_native
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 3 * 4096 + 17), offset=st.integers(0, 2 * 4096 + 9))
def test_a_map_holds_the_bytes_pread_reads(tmp_path_factory, size: int, offset: int) -> None:
    path = tmp_path_factory.mktemp("map") / "data"
    path.write_bytes(np.random.default_rng(size * 7919 + offset).bytes(offset + size + 5))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert map_range(fd, offset, size, str(path)) is None  # below MIN_MAP_BYTES: read
        old = pulsectl._io.MIN_MAP_BYTES
        pulsectl._io.MIN_MAP_BYTES = 1
        try:
            mapped = map_range(fd, offset, size, str(path))
        finally:
            pulsectl._io.MIN_MAP_BYTES = old
        assert mapped is not None
        assert not mapped.flags.writeable
        assert mapped.tobytes() == pread_array(fd, offset, size, str(path)).tobytes()
    finally:
        os.close(fd)


HUGE = 2 << 20


@needs_native
@pytest.mark.parametrize(
    ("offset", "size"),
    [
        (0, HUGE),
        (1, HUGE),
        (4095, 2 * HUGE + 1),
        (HUGE, HUGE),
        (HUGE + 3, 2 * HUGE - 3),  # to the last 2 MiB boundary
        (HUGE - 1, 2 * HUGE + 1234),  # to the end of the file, past the last boundary
        (5, 3 * HUGE + 1228),  # ends one byte before the end
    ],
)
def test_a_map_widened_to_2_mib_boundaries_holds_the_bytes_pread_reads(
    tmp_path: Path, offset: int, size: int
) -> None:
    # Ranges of 2 MiB and more are mapped from and to 2 MiB boundaries of the file, never past
    # its end (pulsectl/_speedups.c, map_file): the array is still exactly the range asked for.
    path = tmp_path / "data"
    path.write_bytes(np.random.default_rng(offset).bytes(3 * HUGE + 1234))
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = map_range(fd, offset, size, str(path))
        assert mapped is not None
        assert mapped.size == size
        assert mapped.tobytes() == pread_array(fd, offset, size, str(path)).tobytes()
    finally:
        os.close(fd)


@needs_native
def test_a_range_past_the_end_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 5000)
    monkeypatch.setattr(pulsectl._io, "MIN_MAP_BYTES", 1)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(Exception, match="shorter than its header says"):
            map_range(fd, 4000, 1001, str(path))
    finally:
        os.close(fd)


def test_mapped_and_read_diffs_write_the_same_patch(
    chain: list[Path], sharded_chain: list[Path], tmp_path: Path, monkeypatch
) -> None:
    """Every read mapped (threshold 1 byte) or none: the same patch bytes, and it applies."""
    calls = []
    real = pulsectl._io.map_range

    def counted(*args):
        view = real(*args)
        calls.append(view is not None)
        return view

    monkeypatch.setattr("pulsectl.sources.map_range", counted)
    for old, new in [(chain[0], chain[4]), (sharded_chain[0], sharded_chain[2])]:
        for context in (False, True):
            monkeypatch.setattr(pulsectl._io, "MIN_MAP_BYTES", 1 << 62)
            read = patch_bytes(old, new, block_bytes=4096, workers=2, context=context)
            monkeypatch.setattr(pulsectl._io, "MIN_MAP_BYTES", 1)
            calls.clear()
            mapped = assert_roundtrip(
                old, new, tmp_path, block_bytes=4096, workers=2, context=context
            )
            assert mapped == read
            assert calls and all(calls) == (_fast.native is not None)


SHRINK = """
import os, sys
from pathlib import Path
import pulsectl._io
from pulsectl._atomic import atomic_file
src, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
fd = os.open(src, os.O_RDWR)
pulsectl._io.MIN_MAP_BYTES = 1
with atomic_file(out, force=False) as f:
    f.write(b"the start of a patch")
    f.flush()
    if mode == "ours":
        data = pulsectl._io.map_range(fd, 0, 1 << 20, src)
    else:  # a map that is not pulsectl's (Python's own mmap module)
        import mmap
        data = memoryview(mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ))
        pulsectl._io.map_range(fd, 0, 4096, src)  # pulsectl's handler is installed too
    os.ftruncate(fd, 4096)
    print(data[(1 << 20) - 1])
"""


@needs_native
def test_a_file_that_shrinks_under_a_map_ends_with_one_error_line(tmp_path: Path) -> None:
    src = tmp_path / "ckpt.safetensors"
    src.write_bytes(b"\1" * (1 << 20))
    out = tmp_path / "out.pulse"
    run = subprocess.run(
        [sys.executable, "-c", SHRINK, str(src), str(out), "ours"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1, run
    assert run.stderr == (
        f"pulsectl: error: {src}: file is shorter than its header says (changed while reading?)\n"
    )
    assert run.stdout == ""
    assert not out.exists()
    assert not list(tmp_path.glob(TEMP_GLOB))  # the temp output was removed


@needs_native
def test_a_sigbus_outside_pulsectls_maps_is_not_caught(tmp_path: Path) -> None:
    src = tmp_path / "ckpt.safetensors"
    src.write_bytes(b"\1" * (1 << 20))
    run = subprocess.run(
        [sys.executable, "-c", SHRINK, str(src), str(tmp_path / "out.pulse"), "other"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == -signal.SIGBUS, run
    assert "pulsectl: error" not in run.stderr


DEVICE_PROBE = """
import io, sys
import pulsectl._io
from pulsectl.diff import DiffOptions, diff_checkpoints
pulsectl._io.MIN_MAP_BYTES = 1
buf = io.BytesIO()
diff_checkpoints(sys.argv[1], sys.argv[2], buf, options=DiffOptions(workers=2, device="cpu"))
sys.stdout.write(buf.getvalue().hex())
"""


def test_a_diff_on_a_device_reads_without_maps_and_warns_nothing(chain: list[Path]) -> None:
    """torch warns about every read-only array it wraps: with --device, diff reads its blocks
    into buffers instead of mapping them, and the patch is the same."""
    run = subprocess.run(
        [sys.executable, "-W", "error", "-c", DEVICE_PROBE, str(chain[0]), str(chain[3])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert bytes.fromhex(run.stdout) == patch_bytes(chain[0], chain[3], workers=2)
