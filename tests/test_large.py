"""Checkpoints past 4 GiB: offsets and sizes that do not fit 32 bits, end to end.

Real shards are often 5 GB or more, so every offset of a file, a tensor and a patch must be
64-bit. This test writes two sparse 4.5 GiB files (holes cost no disk) whose changes lie on both
sides of the 4 GiB mark, then diffs, applies and checks the output with the safetensors library.
It reads about 10 GB through the page cache and writes 4.5 GiB (about 20 s here), and it is
skipped where the disk has less than 8 GiB free; PULSECTL_LARGE_TESTS=0 skips it too. Its files
are removed when it ends, pass or fail, rather than left for pytest's kept temp folders.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

BIG = (4 << 30) + (512 << 20)  # bytes of the BF16 tensor "big"
TAIL = 4096  # bytes of the F32 tensor "tail", which starts at 4.5 GiB
# Offsets in "big" of the BF16 words that change: below 4 GiB, at it, above it, the last word.
BIG_CHANGES = ((4 << 30) - 2, 4 << 30, (4 << 30) + 2, (4 << 30) + (100 << 20), BIG - 2)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("PULSECTL_LARGE_TESTS") == "0", reason="PULSECTL_LARGE_TESTS=0"
    ),
]
NEED_FREE = 8 << 30


def _write(path: Path, tail: np.ndarray, changed: bool) -> None:
    header = {
        "big": {"dtype": "BF16", "shape": [BIG // 2], "data_offsets": [0, BIG]},
        "tail": {"dtype": "F32", "shape": [TAIL // 4], "data_offsets": [BIG, BIG + TAIL]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(start + BIG + TAIL)  # a hole: zeros that take no disk
        f.seek(start + BIG)
        f.write(tail.tobytes())
        if changed:
            for offset in BIG_CHANGES:
                f.seek(start + offset)
                f.write(struct.pack("<H", 0x3F80))  # BF16 1.0 over a zero


def _pulsectl(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pulsectl", *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def work(tmp_path: Path):
    free = shutil.disk_usage(tmp_path).free
    if free < NEED_FREE:
        pytest.skip(f"{free / 2**30:.1f} GiB free; it needs {NEED_FREE >> 30} GiB")
    yield tmp_path
    for path in tmp_path.iterdir():
        path.unlink()


def test_diff_and_apply_past_4_gib(work: Path) -> None:
    tmp_path = work
    rng = np.random.default_rng(0)
    tail_old = rng.standard_normal(TAIL // 4).astype(np.float32)
    tail_new = tail_old.copy()
    tail_new[7] += 1.0
    tail_new[-1] = np.float32("nan")
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    _write(old, tail_old, changed=False)
    _write(new, tail_new, changed=True)
    patch, out = tmp_path / "step.pulse", tmp_path / "out.safetensors"

    summary = _pulsectl("diff", str(old), str(new), "-o", str(patch)).stderr
    assert "7 of 2,415,920,128 words changed" in summary
    _pulsectl("inspect", "--check", str(patch))
    _pulsectl("apply", str(old), str(patch), "-o", str(out))

    assert filecmp.cmp(out, new, shallow=False)
    # The official reader finds the tensors past 4 GiB where they should be.
    with safe_open(str(out), framework="pt") as f:
        tail = f.get_tensor("tail").numpy()
        np.testing.assert_array_equal(tail.view(np.uint32), tail_new.view(np.uint32))
        big = f.get_slice("big")
        for offset in BIG_CHANGES:
            word = offset // 2
            assert big[word : word + 1].view(torch.int16).item() == 0x3F80
        assert big[word - 1 : word].view(torch.int16).item() == 0
