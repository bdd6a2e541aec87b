"""The benchmark scripts run as the README says, and their report judges targets fairly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pulsectl
from pulsectl.codecs import _fast

REPO = Path(__file__).resolve().parent.parent
LOOPS = REPO / "benchmarks" / "loops.py"
# The folder holding the pulsectl that the tests import: this checkout when built in place, or
# site-packages when the tests run against an installed copy (the compiled extension is there).
IMPORTED = Path(pulsectl.__file__).resolve().parent.parent

needs_native = pytest.mark.skipif(_fast.native is None, reason="pulsectl._speedups is not built")


def _loops(tmp_path: Path, against: Path) -> subprocess.CompletedProcess[str]:
    args = ["--out", str(tmp_path), "--preset", "small", "--lrs", "1e-5", "--ks", "1"]
    args += ["--blocks", "1", "--rounds", "2", "--against", str(against)]
    return subprocess.run(
        [sys.executable, str(LOOPS), *args], capture_output=True, text=True, timeout=300
    )


@needs_native
def test_loops_times_both_builds_on_the_same_blocks(tmp_path: Path):
    """Against this same build: both columns filled for all four loops; the script checks
    that the two builds give the same streams, payloads and rebuilt blocks, or it exits
    non-zero."""
    done = _loops(tmp_path, IMPORTED)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    titles = [line.split()[0] for line in lines if "ns per word" in line]
    assert titles == ["rice_encode", "rice_scatter", "context_encode", "context_scatter"]
    rows = [line for line in lines if line.startswith("lr 1e-05 k 1")]
    assert len(rows) == 4
    for row in rows:
        changed, *figures = row.split()[4:]  # after "lr 1e-05 k 1"
        assert changed.endswith("%"), row
        assert len(figures) == 2 and all(float(f) > 0 for f in figures), row


@needs_native
def test_loops_refuses_a_checkout_without_its_extension(tmp_path: Path):
    other = tmp_path / "other"
    (other / "pulsectl").mkdir(parents=True)
    done = _loops(tmp_path, other)
    assert done.returncode != 0
    assert "build it in place" in done.stderr


def test_planes_experiment_runs_and_pairs_losslessly(tmp_path: Path):
    """benchmarks/planes.py on the small preset: one row per pair, the paired plane no larger
    than the stored one there, and every paired plane decoded back (it exits otherwise)."""
    args = ["--out", str(tmp_path), "--preset", "small", "--lrs", "1e-5", "--ks", "1", "16"]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "planes.py"), *args, "--blocks", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("lr ")]
    assert [r[:4] for r in rows] == [["lr", "1e-05", "k", "1"], ["lr", "1e-05", "k", "16"]]
    for r in rows:
        entropy, stored, paired = map(float, r[4:7])
        assert 0 < entropy <= paired <= stored, r


def test_report_leaves_out_ratios_to_a_slowed_reference(monkeypatch: pytest.MonkeyPatch):
    """A pair whose `cp` (or compare pass) is far slower per byte than the run's others is not
    counted as meeting a target: its ratio would flatter pulsectl."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import report

    def pair(cp_s: float, compare_s: float, nbytes: int = 10**9) -> dict:
        return {"target_bytes": nbytes, "cp": {"wall_s": cp_s}, "compare": {"wall_s": compare_s}}

    pairs = [pair(0.30, 0.50), pair(0.28, 0.52), pair(1.21, 0.51), pair(0.34, 0.55)]
    slow = report.slow_references(pairs)
    assert [sorted(s) for s in slow] == [[], [], ["cp"], []]
    assert slow[2]["cp"] == pytest.approx(1.21 / ((0.30 + 0.34) / 2))
    # Per byte: the same time on a checkpoint twice the size is not slow.
    assert report.slow_references([pair(0.3, 0.5), pair(0.6, 1.0, 2 * 10**9), pair(0.3, 0.5)]) == [
        {},
        {},
        {},
    ]
    # Too few pairs for a median to mean anything: nothing is flagged.
    assert report.slow_references([pair(0.3, 0.5), pair(3.0, 0.5)]) == [{}, {}]
    assert report._verdict([1.2, 2.0, None], 1.5, unjudged=1) == (
        "**partly met** (1/2 pairs; 1 not judged ‡)"
    )
    assert report._verdict([1.2, 1.4], 1.5) == "**met** (2/2 pairs)"
    assert report._verdict([None], 1.5, unjudged=1) == "not measured (1 not judged ‡)"


def test_a_miss_against_a_slowed_reference_is_still_judged(monkeypatch: pytest.MonkeyPatch):
    """The slowed reference flatters a ratio: a pass against it is left out, but a ratio that
    misses even so is a miss for certain, and was hidden as 'not judged'."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import report

    def rec(apply_s: float) -> dict:
        return {
            "changed": 100,
            "largest_tensor_bytes": 10,
            "v31": {"bytes": 300, "encode_s": 1.0},
            "entropy": {"given_base_total": 1.0},
            "pulsectl": {"default": {"bytes": 120, "apply": {"wall_s": apply_s,
                                                             "max_rss_bytes": 1}}},
            "cp": {"wall_s": 1.0},
            "compare": {"wall_s": 1.0},
        }  # fmt: skip

    slow = {"cp": 3.0}
    assert "apply_vs_cp" in report.derived(rec(1.2), slow)["unjudged"]  # passes: left out
    assert "apply_vs_cp" not in report.derived(rec(8.6), slow)["unjudged"]  # misses: judged


def test_gpu_benchmark_harness_runs_and_checks_on_the_host(tmp_path: Path) -> None:
    """benchmarks/gpu.py, as it runs without a GPU (``--cpu`` on a machine with one): the
    reference rows, their checks and the JSON."""
    import json
    import os

    out = tmp_path / "gpu.json"
    script = REPO / "benchmarks" / "gpu.py"
    args = ["--cpu", "--shape", "tiny", "--density", "0.05", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(IMPORTED)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all checks passed" in run.stdout
    result = json.loads(out.read_text())
    assert result["ok"] and result["patch_bytes"] > 0
    assert [r["what"] for r in result["rows"]] == ["host: state -> patch", "host: patch -> tensors"]
    assert result["rows"][1]["exact"] and result["rows"][1]["fingerprint"]


def test_io_floor_times_cp_apply_and_a_copy_of_the_target(tmp_path: Path):
    """benchmarks/io_floor.py on the small preset: a row for each command, and the copy wrote
    the target's bytes in order (the script checks its fingerprint, and apply's exit status,
    and exits non-zero otherwise)."""
    args = ["--out", str(tmp_path), "--preset", "small", "--lr", "1e-5", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "io_floor.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:]}
    assert set(rows) == {"cp", "apply", "start-up", "copy", "copy,"}, done.stdout
    for name in ("cp", "apply", "start-up", "copy"):
        best, ratio = float(rows[name][1]), rows[name][2]
        assert best > 0 and ratio.startswith("(") and ratio.endswith("x)"), rows[name]
    assert rows["cp"][2] == "(1.00x)"
