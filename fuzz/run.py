"""Fuzz the readers for a while: `python fuzz/run.py --minutes 10`.

Runs tests/test_fuzz.py again and again under the "long" hypothesis profile, each round with a
new seed, in a child process whose address space is capped (a memory blow-up becomes a
MemoryError, counted as a miss), until the time is up. Prints the total counts: inputs tried,
caught (a clean PulseError), correct results, missed (anything else). Exit status 1 on a miss.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cap_memory(limit_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to fuzz")
    parser.add_argument("--examples", type=int, default=1000, help="examples per test per round")
    parser.add_argument("--memory-gib", type=float, default=4.0, help="address-space cap")
    parser.add_argument("--seed", type=int, default=None, help="first round's seed")
    args = parser.parse_args()

    deadline = time.monotonic() + args.minutes * 60
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    totals: Counter[str] = Counter()
    rounds = failed = 0
    while time.monotonic() < deadline:
        with tempfile.NamedTemporaryFile(suffix=".json") as stats:
            env = {
                **os.environ,
                "HYPOTHESIS_PROFILE": "long",
                "PULSECTL_FUZZ_EXAMPLES": str(args.examples),
                "PULSECTL_FUZZ_STATS": stats.name,
            }
            cmd = [
                sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                str(ROOT / "tests" / "test_fuzz.py"), f"--hypothesis-seed={seed}",
            ]  # fmt: skip
            limit = int(args.memory_gib * 2**30)
            r = subprocess.run(cmd, cwd=ROOT, env=env, preexec_fn=partial(_cap_memory, limit))
            counts = json.loads(Path(stats.name).read_text() or "{}")
        totals.update(counts)
        rounds += 1
        if r.returncode != 0:
            failed += 1
            print(f"round {rounds} (seed {seed}) FAILED; rerun with --seed {seed}", flush=True)
            break
        print(
            f"round {rounds} (seed {seed}): {counts.get('tried', 0)} tried, "
            f"{counts.get('missed', 0)} missed",
            flush=True,
        )
        seed += 1
    print(
        f"fuzz: {rounds} rounds, {totals['tried']} inputs tried, {totals['caught']} caught, "
        f"{totals['ok']} correct, {totals['missed']} missed"
    )
    return 1 if failed or totals["missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
