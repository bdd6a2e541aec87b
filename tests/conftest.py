"""Shared fixtures for the diff/apply test suites: realistic chains and a few file helpers."""

from __future__ import annotations

import io
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from pulsectl.apply import apply_patches
from pulsectl.diff import DiffOptions, diff_checkpoints
from pulsectl.synth import generate_chain


@pytest.fixture(autouse=True)
def _interrupts_raise() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt inside every test, as in a terminal.

    A shell without job control starts background jobs (`./.ci/run &`, nohup) with SIGINT
    ignored, and Python then installs no handler for it: the tests that send themselves
    SIGINT to stand for a user's Ctrl-C would see nothing happen.
    """
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if before == signal.SIG_IGN:
            signal.signal(signal.SIGINT, before)


TEMP_GLOB = ".*.pulsectl-tmp-*"


def patch_bytes(old: Path, new: Path, **options: Any) -> bytes:
    """The patch from ``old`` to ``new`` (single worker unless told otherwise), in memory."""
    buf = io.BytesIO()
    diff_checkpoints(old, new, buf, options=DiffOptions(**{"workers": 1, **options}))
    return buf.getvalue()


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a checkpoint (a file, or a folder walked recursively) by relative path."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def raw_tensors(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """Tensors as the official safetensors library loads them: dtype, shape and raw bytes."""
    files = [path] if path.is_file() else sorted(path.rglob("*.safetensors"))
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                out[name] = (t.dtype, tuple(t.shape), raw)
    return out


def assert_roundtrip(base: Path, new: Path, tmp: Path, **options: Any) -> bytes:
    """diff, then apply: the result must equal ``new`` byte for byte. Returns the patch."""
    patch = tmp / "roundtrip.pulse"
    patch.write_bytes(patch_bytes(base, new, **options))
    out = tmp / "roundtrip.out"
    apply_patches(base, [patch], out, workers=options.get("workers", 1), force=True)
    assert tree_bytes(out) == tree_bytes(new)
    assert raw_tensors(out) == raw_tensors(new)
    assert not list(tmp.glob(TEMP_GLOB))
    return patch.read_bytes()


@pytest.fixture(scope="session")
def chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A tiny BF16 chain step_000..step_005, one .safetensors file per step (read-only use)."""
    return generate_chain(tmp_path_factory.mktemp("chain"), "tiny", steps=5, lr=1e-3, seed=7)


@pytest.fixture(scope="session")
def sharded_chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The same kind of chain as HF folders: 2 shards, index and config (read-only use)."""
    return generate_chain(
        tmp_path_factory.mktemp("sharded"), "tiny", steps=3, lr=1e-3, seed=11, shards=2
    )
