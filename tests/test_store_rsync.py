"""A folder store mirrored with rsync: pull from the copy; a second rsync sends only new files."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pulsectl.store import PublishOptions, publish, pull
from pulsectl.synth import generate_chain

RSYNC = shutil.which("rsync")
pytestmark = pytest.mark.skipif(RSYNC is None, reason="rsync not installed (apt-get install rsync)")


def rsync(src: Path, dst: Path) -> list[str]:
    """Mirror ``src`` into ``dst`` as docs/STORE.md says; the itemized changes, one per line."""
    assert RSYNC is not None
    r = subprocess.run(
        [
            RSYNC,
            "-a",
            "--delete-after",
            "--exclude=.*",
            "--itemize-changes",
            "--stats",
            f"{src}/",
            f"{dst}/",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return r.stdout.splitlines()


def sent_files(lines: list[str]) -> list[str]:
    """Paths rsync transferred (itemized lines starting with '>f')."""
    return sorted(line.split(" ", 1)[1] for line in lines if line.startswith(">f"))


def test_rsync_mirror(tmp_path: Path) -> None:
    chain = generate_chain(tmp_path / "chain", "tiny", steps=6, lr=3e-6, seed=21)
    store, mirror, cache = tmp_path / "store", tmp_path / "mirror", tmp_path / "cache"
    opts = PublishOptions(anchor_every=4, cache_dir=cache)
    for p in chain[:6]:
        publish(store, p, options=opts)
    first = rsync(store, mirror)
    assert len(sent_files(first)) == 1 + 6 + 2 + 5  # marker, manifests, anchors, patches
    out = tmp_path / "worker.safetensors"
    assert pull(mirror, out).step == 5
    assert out.read_bytes() == chain[5].read_bytes()

    publish(store, chain[6], options=opts)
    second = rsync(store, mirror)
    sent = sent_files(second)
    assert len(sent) == 2
    assert sent[0].startswith("patches/00000006-") and sent[1] == "steps/00000006.json"
    stats = "\n".join(second)
    assert "Number of regular files transferred: 2" in stats
    assert not [line for line in second if line.startswith(("*deleting", ">f.", "cd"))]
    # Everything rsync sends comes before the manifest that names it (names sort that way).
    assert sent.index("steps/00000006.json") == len(sent) - 1
    summary = pull(mirror, out)
    assert summary.step == 6 and summary.start == "local copy of step 5"
    assert out.read_bytes() == chain[6].read_bytes()
