"""Change detection on a torch device (CUDA when there is one).

The CPU path is numpy and never imports torch. With a device, the comparison and the
compaction of changed positions run in torch on that device and only the positions come back;
the codecs then work on the host exactly as on the CPU path, so the patch bytes are identical
(tests run this code with torch on the CPU).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pulsectl.errors import UsageError

_WORD_DTYPES: dict[int, Any] = {}


def resolve(spec: str) -> str | None:
    """``--device auto|cpu|cuda[:N]`` -> a torch device name, or None for the numpy CPU path.

    ``auto`` picks CUDA when torch sees a GPU, and does not import torch on machines without an
    NVIDIA driver (so the CPU path keeps its start-up time).
    """
    spec = spec.strip().lower()
    if spec == "cpu":
        return None
    if spec == "auto":
        if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not _nvidia_driver():
            return None
        import torch

        return "cuda" if torch.cuda.is_available() else None
    if spec == "cuda" or spec.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {spec}: torch sees no CUDA device here; use cpu or auto",
                option="--device",
            )
        index = spec[5:]
        count = torch.cuda.device_count()
        if spec != "cuda" and not (index.isdigit() and int(index) < count):
            raise UsageError(
                f"--device {spec}: torch sees {count} CUDA device(s) here, cuda:0 to "
                f"cuda:{count - 1}",
                option="--device",
            )
        return spec
    raise UsageError(f"--device {spec!r}: give auto, cpu or cuda[:N]", option="--device")


def _nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia").exists() or Path("/dev/nvidia0").exists()


def find_changes(old: Any, new: Any, word: int, device: str) -> np.ndarray:
    """Indices (int64, on the host) of the words that differ, computed with torch on ``device``.

    ``old`` and ``new`` are uint8 numpy arrays or torch tensors of equal length.
    """
    import torch

    if not _WORD_DTYPES:
        _WORD_DTYPES.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    a = _on(old, device).view(_WORD_DTYPES[word])
    b = _on(new, device).view(_WORD_DTYPES[word])
    return torch.nonzero(a != b).flatten().cpu().numpy()


def _on(x: Any, device: str) -> Any:
    import torch

    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return t.to(device, non_blocking=True)


def apply_moves(
    old: np.ndarray, positions: np.ndarray, moved: np.ndarray, word: int, device: str
) -> np.ndarray:
    """``old`` with ``moved`` added at ``positions`` (words), the scatter done on ``device``."""
    import torch

    if not _WORD_DTYPES:
        _WORD_DTYPES.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    dtype = _WORD_DTYPES[word]
    signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[word]
    block = _on(old.copy(), device).view(dtype)
    index = torch.from_numpy(positions).to(device)
    block.index_add_(0, index, torch.from_numpy(moved.view(signed)).to(device))  # wraps
    return block.view(torch.uint8).cpu().numpy()
