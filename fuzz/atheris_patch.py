"""Coverage-guided fuzzing of apply with atheris (optional: `pip install atheris`).

    python fuzz/atheris_patch.py -max_total_time=600 [corpus_dir]

Every input is a .pulse stream applied in-process to a small base checkpoint. It must end in
a PulseError (with no output and no temp file left) or in the exact target; anything else is
a crash that atheris reports and saves. Seeds: the valid patches of tests/_faultkit.py.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

with atheris.instrument_imports():
    from _faultkit import apply_outcome, make_patch, write_small_pair

    import pulsectl.apply  # noqa: F401
    import pulsectl.codecs  # noqa: F401
    import pulsectl.format  # noqa: F401
    import pulsectl.patch  # noqa: F401

_DIR = Path(tempfile.mkdtemp(prefix="pulsectl-atheris-", dir="/dev/shm"))
_BASE, _NEW = write_small_pair(_DIR)


def test_one_input(data: bytes) -> None:
    apply_outcome(_BASE, data, _DIR / "out", None)  # a valid patch is verified by apply


def main() -> None:
    argv = list(sys.argv)
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if corpus:  # seed an empty corpus folder with the valid patches
        folder = Path(corpus[0])
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.iterdir()):
            for level in ("3", "max"):
                (folder / f"seed-{level}.pulse").write_bytes(make_patch(_BASE, _NEW, level=level))
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
