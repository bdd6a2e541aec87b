"""The `pulsectl demo` walk-through: generate a chain, diff it, apply it, verify it."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pulsectl import _placed
from pulsectl._atomic import TEMP_MARK, missing_folder, os_error
from pulsectl.apply import apply_patches
from pulsectl.diff import diff_to_path
from pulsectl.errors import OutputError, UsageError, counted
from pulsectl.info import verify_checkpoint
from pulsectl.synth import PRESETS, generate_chain


def run_demo(
    keep: Path | None = None,
    shape: str = "small",
    steps: int = 3,
    lr: float = 3e-6,
    say: Callable[[str], None] = print,
) -> list[Path]:
    """Run the demo; returns the patch paths. Works in a temp folder unless ``keep`` is given,
    which must be a new or empty folder (the demo writes a chain, patches and a rebuilt
    checkpoint there, and replaces no file of the user's)."""
    if shape not in PRESETS:
        raise UsageError(f"--shape {shape!r}: choose one of {', '.join(PRESETS)}", option="--shape")
    if keep is not None:
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            what = "is not a folder" if not keep.is_dir() else "is a folder that is not empty"
            raise OutputError(
                f"{keep}: {what}; give --keep a new or empty folder (the demo writes its chain, "
                "patches and rebuilt checkpoint there)",
                path=keep,
            )
        if not keep.parent.is_dir():  # as for any output: its folder is the user's to make
            raise missing_folder(keep)
        made = not keep.exists()
        try:
            keep.mkdir(exist_ok=True)
        except OSError as exc:
            raise os_error(exc, keep) from exc
        try:
            return _run(keep, shape, steps, lr, say)
        except BaseException:
            # Everything in ``keep`` is the demo's (it was new or empty): a failed or interrupted
            # demo takes it away, so that the same command can run again.
            if not _clear(keep, made):
                _placed.done(
                    f"while the demo was writing into {keep} (remove what it holds to reuse it)"
                )
            raise
    with tempfile.TemporaryDirectory(prefix="pulsectl-demo-") as tmp:
        return _run(Path(tmp), shape, steps, lr, say)


def _clear(folder: Path, remove: bool) -> bool:
    """Delete what the demo writes in ``folder`` (its chain, patches, rebuilt checkpoint, and
    temps of these), never another name that appeared there meanwhile; and ``folder`` too if
    ``remove`` and it is then empty. Whether the demo's files are all gone."""
    try:
        for entry in folder.iterdir():
            if not _DEMO_NAME.fullmatch(entry.name) and TEMP_MARK not in entry.name:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        if remove and not any(folder.iterdir()):
            folder.rmdir()
    except OSError:
        return False
    return True


_DEMO_NAME = re.compile(r"chain|rebuilt\.safetensors|step_\d{3,}\.pulse")


def _run(root: Path, shape: str, steps: int, lr: float, say: Callable[[str], None]) -> list[Path]:
    adam = counted(steps, "AdamW step")
    say(f"building a '{shape}' checkpoint chain: {adam} at lr {lr:g}, BF16 casts")
    chain = generate_chain(root / "chain", shape=shape, steps=steps, lr=lr, seed=0)
    size = chain[0].stat().st_size
    say(f"  {len(chain)} checkpoints of {size:,} bytes in {root / 'chain'}")
    patches: list[Path] = []
    for i, (old, new) in enumerate(zip(chain, chain[1:], strict=False), start=1):
        patch = root / f"step_{i:03d}.pulse"
        t0 = time.perf_counter()
        summary = diff_to_path(old, new, patch, force=True)
        dt = time.perf_counter() - t0
        density = summary.changed_words / summary.total_words
        say(
            f"pulsectl diff {old.name} {new.name} -o {patch.name}: {summary.changed_words:,} words "
            f"changed ({density:.2%}), patch {summary.patch_bytes:,} bytes "
            f"({summary.target_bytes / summary.patch_bytes:.0f}x smaller, "
            f"{summary.patch_bytes / max(summary.changed_words, 1):.2f} B/change) in {dt:.2f}s"
        )
        patches.append(patch)
    out = root / "rebuilt.safetensors"
    t0 = time.perf_counter()
    result = apply_patches(chain[0], patches, out, force=True)
    dt = time.perf_counter() - t0
    say(
        f"pulsectl apply {chain[0].name} {' '.join(p.name for p in patches)} -o {out.name}: "
        f"{result.target_bytes:,} bytes in {dt:.2f}s"
    )
    verify_checkpoint(out, patch=patches[-1])
    identical = out.read_bytes() == chain[-1].read_bytes()
    say(
        f"pulsectl verify {out.name} --patch {patches[-1].name}: ok, fingerprint "
        f"{result.target_fingerprint}; byte-identical to {chain[-1].name}: {identical}"
    )
    total = sum(p.stat().st_size for p in patches)
    say(
        f"sent {total:,} bytes of patches instead of {size * len(patches):,} bytes of "
        f"checkpoints: {size * len(patches) / total:.0f}x less"
    )
    if not identical:
        raise AssertionError("demo output differs from the target (a bug in pulsectl)")
    return patches
