"""The example scripts in docs/examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "docs" / "examples"


def test_trainer_then_worker(tmp_path: Path):
    out = tmp_path / "run"
    trainer = subprocess.run(
        [sys.executable, str(EXAMPLES / "trainer.py"), str(out), "--steps", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert trainer.stdout.count("step ") == 3
    assert len(list(out.glob("step_*.pulse"))) == 3
    worker = subprocess.run(
        [sys.executable, str(EXAMPLES / "worker.py"), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    targets = [line.split()[-1] for line in trainer.stdout.splitlines() if line.startswith("step ")]
    applied = [
        line.split()[-1] for line in worker.stdout.splitlines() if line.startswith("applied")
    ]
    assert applied == [t.rstrip(")") for t in targets]
