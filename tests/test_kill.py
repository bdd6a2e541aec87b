"""Killed at any moment, apply leaves OUT absent or complete, and BASE untouched.

A ~200 MB BF16 checkpoint and a chain of two patches (1% of the words move each step). The
real CLI runs in a subprocess and gets SIGKILL, SIGTERM, SIGINT or SIGHUP after a random
delay. After each kill: OUT is absent or byte-identical to the target; BASE is untouched
(with --in-place: it is the old checkpoint or the new one, whole); after SIGINT, SIGTERM or
SIGHUP no temp is left; after SIGKILL a leftover is a `.NAME.pulsectl-tmp-*` temp beside OUT
(docs/GUARANTEES.md says to delete those), removed here before the next round.

CI: 24 kills, under a minute. `pytest -m slow tests/test_kill.py`: 60 more, `diff -o` included.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import xxhash
from _faultkit import TEMP_MARK, nudge, report

from pulsectl.checkpoint import save_safetensors
from pulsectl.diff import DiffOptions, diff_to_path

TENSORS = 25  # x 8 MiB
SIGNALS = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def file_fingerprint(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Chain:
    folder: Path
    base: Path
    middle: Path
    target: Path
    patches: list[Path]
    base_fp: str
    target_fp: str
    patch_fp: str  # of patches[0], for the `diff -o` kills
    apply_seconds: float


@pytest.fixture(scope="module")
def chain200(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    folder = tmp_path_factory.mktemp("kill")
    rng = np.random.default_rng(2024)
    words = {
        f"model.layers.{i}.weight": rng.integers(0, 1 << 16, 2048 * 2048, dtype=np.uint16)
        for i in range(TENSORS)
    }
    steps = []
    for step in range(3):
        if step:
            words = {name: nudge(rng, w, 0.01) for name, w in words.items()}
        path = folder / f"step{step}.safetensors"
        save_safetensors(path, {n: ("BF16", [2048, 2048], w) for n, w in words.items()})
        steps.append(path)
    del words
    patches = []
    for step in (1, 2):
        patch = folder / f"p{step}.pulse"
        diff_to_path(steps[step - 1], steps[step], patch, options=DiffOptions(workers=2))
        patches.append(patch)
    chain = Chain(
        folder,
        steps[0],
        steps[1],
        steps[2],
        patches,
        file_fingerprint(steps[0]),
        file_fingerprint(steps[2]),
        file_fingerprint(patches[0]),
        0.0,
    )
    # One uninterrupted run: it must work, and it tells how long a run takes here.
    out = folder / "full.out"
    start = time.monotonic()
    subprocess.run(apply_argv(chain, out), check=True, capture_output=True, timeout=120)
    chain.apply_seconds = time.monotonic() - start
    assert file_fingerprint(out) == chain.target_fp
    out.unlink()
    return chain


def apply_argv(chain: Chain, out: Path | None, base: Path | None = None) -> list[str]:
    where = ["--in-place"] if out is None else ["-o", str(out)]
    return [
        sys.executable, "-m", "pulsectl", "-q", "apply", str(base or chain.base),
        *map(str, chain.patches), *where,
    ]  # fmt: skip


def interrupt(
    argv: list[str], sig: signal.Signals, delay: float, hang_s: float = 120
) -> tuple[int, str]:
    """Start ``argv``, send ``sig`` after ``delay`` seconds; its exit status and stderr. A child
    still running ``hang_s`` seconds after the signal has hung: it is killed, and the test fails.

    The child starts with every signal at its default action: under `nohup` (SIGHUP ignored,
    which a child inherits and pulsectl respects) the SIGHUP rounds would test nothing."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=hang_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(
            f"{argv[4:]} hung: still running {hang_s:.0f} s after {sig.name} at {delay:.2f} s"
        )
    return proc.returncode, err.decode(errors="replace")


def leftovers(folder: Path, name: str, sig: signal.Signals) -> None:
    """No temp after SIGINT/SIGTERM/SIGHUP; after SIGKILL only `.NAME.pulsectl-tmp-*`, removed
    here."""
    temps = [p for p in folder.iterdir() if TEMP_MARK in p.name]
    if sig != signal.SIGKILL:
        assert not temps, f"temp files left after {sig.name}: {temps}"
    for p in temps:
        assert p.name.startswith(f".{name}{TEMP_MARK}"), p
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def check_exit(
    sig: signal.Signals, code: int, err: str, delay: float, written: Path | None
) -> None:
    """0 if it finished first; 130 and one line after SIGINT/SIGTERM/SIGHUP; -9 after SIGKILL.

    The line says that nothing was written, or, for a signal that came after OUT was renamed
    into place (``written``: the run's output is there, complete), that OUT was written.

    A signal that reaches Python before pulsectl's main() runs (interpreter start-up, site
    and .pth processing, imports) ends it with Python's own report and no pulsectl line:
    nothing was started then, which the file checks above confirm.
    """
    where = f"exit {code} after {sig.name} at {delay:.2f} s:\n{err}"
    if sig == signal.SIGKILL:
        assert code in (0, -signal.SIGKILL), where
    elif code != 0 and "pulsectl: error:" not in err:
        assert code in (1, -signal.SIGINT, -signal.SIGTERM, -signal.SIGHUP), where
    else:
        # After pulsectl's line, CPython may still end the process by SIGINT (it does so when
        # it saw a KeyboardInterrupt it considers unhandled): a shell reads that as 130 too.
        assert code in (0, 130, -signal.SIGINT), where
        if code != 0:
            lines = ["interrupted; no output was written"]
            if written is not None:  # the command's own report, or the interrupt it missed
                lines = [f"interrupted after {written} was written"]
                lines.append("interrupted after the command had finished")
            assert err.strip() in [f"pulsectl: error: {line}" for line in lines], where


def kill_rounds(chain: Chain, rounds: int, in_place_every: int, seed: int) -> Counter[str]:
    rng = random.Random(seed)
    seen: Counter[str] = Counter()
    work = chain.folder / "work"
    work.mkdir(exist_ok=True)
    for n in range(rounds):
        sig = SIGNALS[n % len(SIGNALS)]
        # Up to a little past the usual end: some kills land on the rename, some too late.
        delay = rng.uniform(0.05, 1.05) * chain.apply_seconds
        in_place = (n // len(SIGNALS)) % in_place_every == in_place_every - 1
        if in_place:
            victim = work / "ckpt.safetensors"
            shutil.copyfile(chain.base, victim)
            code, err = interrupt(apply_argv(chain, None, base=victim), sig, delay)
            fp = file_fingerprint(victim)
            assert fp in (chain.base_fp, chain.target_fp), f"BASE damaged by {sig.name}"
            state = "new" if fp == chain.target_fp else "old"
            leftovers(work, victim.name, sig)
            victim.unlink()
            written = victim if state == "new" else None
        else:
            out = work / "out.safetensors"
            code, err = interrupt(apply_argv(chain, out), sig, delay)
            state = "complete" if out.exists() else "absent"
            if out.exists():
                assert file_fingerprint(out) == chain.target_fp, f"OUT incomplete after {sig.name}"
                out.unlink()
            leftovers(work, out.name, sig)
            written = out if state == "complete" else None
        check_exit(sig, code, err, delay, written)
        seen[f"{'in-place' if in_place else '-o'} {sig.name} {state}"] += 1
    assert file_fingerprint(chain.base) == chain.base_fp, "BASE changed"
    return seen


def test_kill_apply(chain200: Chain, request: pytest.FixtureRequest) -> None:
    seen = kill_rounds(chain200, rounds=24, in_place_every=3, seed=7)
    report(
        request.config,
        "kills",
        f"{sum(seen.values())} kills of a {TENSORS * 8} MiB apply "
        f"(run {chain200.apply_seconds:.1f} s): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(seen.items())),
    )
    assert sum(seen.values()) == 24


@pytest.fixture(scope="module")
def dense200(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """200 MiB of random BF16 words and a patch that replaces 30% of them (blocks stored
    whole: a big patch read while the workers have little to do)."""
    folder = tmp_path_factory.mktemp("dense")
    rng = np.random.default_rng(6)
    tensors = {}
    targets = {}
    for i in range(8):
        words = rng.integers(0, 1 << 16, 25 * 2**19, dtype=np.uint16)
        tensors[f"layer{i}.w"] = ("BF16", [words.size], words)
        moved = words.copy()
        at = rng.random(words.size) < 0.3
        moved[at] = rng.integers(0, 1 << 16, int(at.sum()), dtype=np.uint16)
        targets[f"layer{i}.w"] = ("BF16", [words.size], moved)
    base, target, patch = (folder / n for n in ("a.safetensors", "b.safetensors", "p.pulse"))
    save_safetensors(base, tensors)
    save_safetensors(target, targets)
    diff_to_path(base, target, patch, options=DiffOptions(workers=2))
    target.unlink()
    return base, patch


def test_an_interrupt_early_in_apply_never_hangs_it(dense200: tuple[Path, Path]) -> None:
    """SIGINT or SIGTERM while apply's reader thread fills its queue: 130 within seconds.

    Before the pool's waits moved to C-level primitives (``_io._Slot``), an interrupt that
    landed inside ``queue.Queue``'s Python code could leave its lock held, and the clean-up
    then waited on it for good, until a second signal: these 16 rounds caught that in one of
    two runs of the old code (a race: the fix is in the design, this only watches for it)."""
    base, patch = dense200
    rng = random.Random(5)
    out = patch.parent / "out.safetensors"
    argv = [sys.executable, "-m", "pulsectl", "-q", "apply", str(base), str(patch), "-o", str(out)]
    for n in range(16):
        sig = (signal.SIGINT, signal.SIGTERM)[n % 2]
        delay = rng.uniform(0.12, 0.3)
        code, err = interrupt(argv, sig, delay, hang_s=20)
        written = out if out.exists() else None
        if written is not None:
            out.unlink()
        leftovers(out.parent, out.name, sig)
        check_exit(sig, code, err, delay, written)


@pytest.mark.slow
def test_kill_apply_long(chain200: Chain) -> None:
    seen = kill_rounds(chain200, rounds=60, in_place_every=2, seed=11)
    assert sum(seen.values()) == 60


@pytest.mark.slow
def test_kill_diff(chain200: Chain) -> None:
    """`diff -o` killed: the patch is absent or complete (diff output is deterministic)."""
    rng = random.Random(3)
    patch = chain200.folder / "work" / "killed.pulse"
    patch.parent.mkdir(exist_ok=True)
    argv = [
        sys.executable, "-m", "pulsectl", "-q", "diff", str(chain200.base), str(chain200.middle),
        "-o", str(patch), "--workers", "2",
    ]  # fmt: skip
    for n in range(12):
        sig = SIGNALS[n % len(SIGNALS)]
        code, err = interrupt(argv, sig, rng.uniform(0.2, 4.0))
        written = patch if patch.exists() else None
        if patch.exists():
            assert file_fingerprint(patch) == chain200.patch_fp
            patch.unlink()
        leftovers(patch.parent, patch.name, sig)
        check_exit(sig, code, err, 0.0, written)
    assert os.path.exists(chain200.base)
