"""Change detection on a torch device (CUDA when there is one).

The CPU path is numpy and never imports torch. With a device, the comparison and the
compaction of changed positions run in torch on that device and only the positions come back;
the codecs then work on the host exactly as on the CPU path, so the patch bytes are identical
(tests run this code with torch on the CPU).

A device that ``auto`` chose may be busy: a training job on the same GPU holds its memory. A
failure there (torch raises out-of-memory and CUDA errors as RuntimeError) is told once on
stderr and the run goes on with the CPU path, which gives the same bytes; ``find_changes`` and
``apply_moves`` then return None. A device asked for by name fails with a ``DeviceError``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pulsectl.errors import DeviceError, UsageError, counted

_T = TypeVar("_T")
# Devices that `auto` chose (resolve) and that failed once: the CPU path does their work for
# the rest of the process (a device named by the caller fails with DeviceError instead).
_FAILED: set[str] = set()


class _Chosen(str):
    """A device name that pulsectl chose (``auto``, or where live tensors are) rather than one
    asked for by name: should it fail, the CPU path takes over. A mark on the name itself, so
    that one call's choice never turns another's named device into a silent fallback."""


_failing = threading.Lock()


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

        return chosen("cuda") if torch.cuda.is_available() else None
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
                f"--device {spec}: torch sees {counted(count, 'CUDA device')} here, cuda:0 to "
                f"cuda:{count - 1}",
                option="--device",
            )
        return spec
    raise UsageError(f"--device {spec!r}: give auto, cpu or cuda[:N]", option="--device")


_CHECKED: set[str] = set()  # device names check_name took


def check_name(device: object) -> None:
    """Refuse (UsageError), before any work, a ``device`` the library functions cannot use: a
    name torch has no device type for, ``"auto"`` (the command line's), or a CUDA device torch
    does not see. None (numpy on the CPU) is always fine, and so is any torch device name or
    ``torch.device`` torch parses ("cpu", "cuda:1", "mps"). Found in review: such a name failed
    only once work had started, with torch's own message."""
    if device is None or isinstance(device, _Chosen):
        return
    if device == "auto":
        raise UsageError(
            "device 'auto' is the command line's: pass pulsectl.device.resolve('auto'), a torch "
            "device name, or None for numpy on the CPU"
        )
    if str(device) in _CHECKED:  # DiffOptions copies (dataclasses.replace) check again
        return
    import torch

    try:
        parsed = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        raise UsageError(
            f"device {device!r}: not a torch device name ('cpu', 'cuda', 'cuda:N', ...); give "
            "one, or None for numpy on the CPU"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= count:
            raise UsageError(
                f"device {str(device)!r}: torch sees {counted(count, 'CUDA device')} here; use "
                "'cpu' or None"
            )
    _CHECKED.add(str(device))


def chosen(device: str) -> str:
    """``device``, marked as chosen by pulsectl rather than asked for by name (``auto``, or
    where live tensors are): should it fail, the CPU path takes over."""
    return _Chosen(device)


def _nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia").exists() or Path("/dev/nvidia0").exists()


def find_changes(old: Any, new: Any, word: int, device: str) -> np.ndarray | None:
    """Indices (int64, on the host) of the words that differ, computed with torch on ``device``;
    None where a device that ``auto`` chose has failed (find them on the host).

    ``old`` and ``new`` are uint8 numpy arrays or torch tensors of equal length.
    """

    def run() -> np.ndarray:
        import torch

        a = _on(old, device).view(_word_dtype(word))
        b = _on(new, device).view(_word_dtype(word))
        return torch.nonzero(a != b).flatten().cpu().numpy()

    return _on_device(device, "finding changed words", run)


def _on_device(device: str, what: str, run: Callable[[], _T]) -> _T | None:
    """``run()``, or None where ``device`` was chosen by ``auto`` and has failed (now or
    before); a DeviceError where it was asked for by name."""
    picked = isinstance(device, _Chosen)
    if picked and device in _FAILED:
        return None
    try:
        try:
            return run()
        except AssertionError as exc:  # a torch built without CUDA says so by an assert
            if "not compiled with CUDA" not in str(exc):
                raise
            raise RuntimeError(str(exc)) from exc
    except RuntimeError as exc:  # torch.OutOfMemoryError and CUDA errors
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not picked:
            raise DeviceError(
                f"--device {device}: {what} failed: {why}; use --device cpu (the same bytes) "
                "or free the device's memory"
            ) from exc
        with _failing:
            first = device not in _FAILED
            _FAILED.add(device)
        if first:
            print(
                f"pulsectl: warning: --device auto: {device} failed ({why}); {what} on the "
                "CPU instead (the same bytes)",
                file=sys.stderr,
            )
        return None


def _word_dtype(word: int) -> Any:
    """The torch dtype of ``word``-byte words (signed where torch's unsigned ones lack ops)."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[word]


def _on(x: Any, device: str) -> Any:
    import torch

    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return t.to(device, non_blocking=True)


def apply_moves(
    old: np.ndarray, positions: np.ndarray, moved: np.ndarray, word: int, device: str
) -> np.ndarray | None:
    """``old`` with ``moved`` added at ``positions`` (words), the scatter done on ``device``;
    None where a device that ``auto`` chose has failed (``old`` is then unchanged)."""

    def run() -> np.ndarray:
        import torch

        dtype = _word_dtype(word)
        signed = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[word]
        block = _on(old.copy(), device).view(dtype)
        index = torch.from_numpy(positions).to(device)
        block.index_add_(0, index, torch.from_numpy(moved.view(signed)).to(device))  # wraps
        result: np.ndarray = block.view(torch.uint8).cpu().numpy()
        return result

    return _on_device(device, "scattering the changes", run)
