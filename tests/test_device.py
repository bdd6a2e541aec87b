"""--device: the torch change finder gives the same patch and statistics as the numpy path.

CI has no GPU, so the torch path runs on the CPU here; on a CUDA machine the same code runs
with device="cuda" (tests/test_cuda.py, benchmarks/gpu.py, benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from pulsectl.cli.app import main
from pulsectl.codecs.delta import find_changes
from pulsectl.device import find_changes as find_on_device
from pulsectl.device import resolve
from pulsectl.diff import DiffOptions, diff_checkpoints
from pulsectl.errors import UsageError
from pulsectl.stats import chain_stats, pair_stats
from pulsectl.synth import generate_chain


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> list[Path]:
    return generate_chain(tmp_path_factory.mktemp("dev"), shape="tiny", steps=2, lr=1e-5, seed=9)


@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_torch_finder_equals_numpy(word):
    rng = np.random.default_rng(word)
    old = rng.integers(0, 256, 4096 * word, dtype=np.uint8)
    new = old.copy()
    new[rng.random(new.size) < 0.02] ^= 1
    assert np.array_equal(find_on_device(old, new, word, "cpu"), find_changes(old, new, word))


@pytest.mark.parametrize("context", [False, True])
def test_patch_bytes_identical_across_devices(chain, context):
    a, b = chain[0], chain[2]
    outs = []
    for device in (None, "cpu"):
        buf = io.BytesIO()
        diff_checkpoints(a, b, buf, options=DiffOptions(workers=2, context=context, device=device))
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]


def test_stats_identical_across_devices(chain):
    assert (
        pair_stats(chain[0], chain[1]).to_json()
        == pair_stats(chain[0], chain[1], device="cpu").to_json()
    )
    assert (
        chain_stats(chain, (1, 2)).to_json() == chain_stats(chain, (1, 2), device="cpu").to_json()
    )


def test_resolve():
    assert resolve("cpu") is None
    assert resolve("auto") in (None, "cuda")
    with pytest.raises(UsageError):
        resolve("tpu")


def test_cli_device_flag(chain, tmp_path: Path):
    assert (
        main(
            [
                "diff",
                str(chain[0]),
                str(chain[1]),
                "--device",
                "cpu",
                "-o",
                str(tmp_path / "a.pulse"),
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "diff",
                str(chain[0]),
                str(chain[1]),
                "--device",
                "auto",
                "-o",
                str(tmp_path / "b.pulse"),
            ]
        )
        == 0
    )
    assert (tmp_path / "a.pulse").read_bytes() == (tmp_path / "b.pulse").read_bytes()
    assert (
        main(
            [
                "diff",
                str(chain[0]),
                str(chain[1]),
                "--device",
                "tpu",
                "-o",
                str(tmp_path / "c.pulse"),
            ]
        )
        == 2
    )


@pytest.mark.parametrize("context", [False, True])
def test_apply_scatter_on_a_device_gives_the_same_bytes(chain, tmp_path: Path, context):
    from pulsectl.apply import apply_patches
    from pulsectl.diff import diff_to_path

    patch = tmp_path / "p.pulse"
    diff_to_path(
        chain[0], chain[2], patch, options=DiffOptions(context=context, level=19 if context else 3)
    )
    for device in (None, "cpu"):
        out = tmp_path / f"out-{device}.safetensors"
        apply_patches(chain[0], [patch], out, device=device)
        assert out.read_bytes() == chain[2].read_bytes()
    assert (
        main(["apply", str(chain[0]), str(patch), "--device", "auto", "-o", str(tmp_path / "c.st")])
        == 0
    )
    assert (tmp_path / "c.st").read_bytes() == chain[2].read_bytes()


def test_resolve_checks_the_cuda_device_index(monkeypatch):
    """A CUDA index the machine lacks (or a malformed one) is a usage error up front, not a
    torch error from a worker thread in the middle of a diff."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve("cuda") == "cuda"
    assert resolve("CUDA:1") == "cuda:1"
    for spec in ("cuda:2", "cuda:x", "cuda:", "cuda:-1", "cudafoo"):
        with pytest.raises(UsageError):
            resolve(spec)


@pytest.fixture
def busy_device(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Torch's device (the CPU here, standing for a GPU) fails as a full GPU does: every move
    onto it raises torch's out-of-memory RuntimeError. Returns the list of failed moves."""
    import pulsectl.device as dev

    monkeypatch.setattr(dev, "_FAILED", set())
    tries: list[str] = []

    def full(x, device):
        tries.append(device)
        raise RuntimeError("CUDA out of memory. Tried to allocate 16.00 MiB\nmore detail")

    monkeypatch.setattr(dev, "_on", full)
    return tries


@pytest.mark.parametrize("context", [False, True])
def test_a_device_auto_chose_that_fails_falls_back_to_the_host(
    chain, tmp_path: Path, busy_device: list[str], capsys: pytest.CaptureFixture[str], context
):
    """`--device auto` picks the GPU that a training job may fill: out of memory there used to
    end the diff with an internal error. The device `auto` chose now hands the work to the host
    path (same bytes), says so once, and is not tried again."""
    from pulsectl.device import chosen

    a, b = chain[0], chain[2]
    want = io.BytesIO()
    diff_checkpoints(a, b, want, options=DiffOptions(workers=2, context=context))
    capsys.readouterr()
    got = io.BytesIO()
    device = chosen("cpu")
    diff_checkpoints(a, b, got, options=DiffOptions(workers=2, context=context, device=device))
    assert got.getvalue() == want.getvalue()
    err = capsys.readouterr().err
    assert err == (
        "pulsectl: warning: --device auto: cpu failed (CUDA out of memory. Tried to allocate "
        "16.00 MiB); finding changed words on the CPU instead (the same bytes)\n"
    )
    # Not tried again once a failure is known; with 2 workers, the other one's try may already
    # be under way when the first fails (seen once in a full run: two tries in apply).
    tried = len(busy_device)
    assert 1 <= tried <= 2
    assert pair_stats(a, b, device=device).to_json() == pair_stats(a, b).to_json()
    assert len(busy_device) == tried
    import pulsectl.device as dev
    from pulsectl.apply import apply_patches

    dev._FAILED.clear()  # apply in a process of its own: its scatter fails first
    patch = tmp_path / "p.pulse"
    patch.write_bytes(want.getvalue())
    apply_patches(a, [patch], tmp_path / "out.safetensors", device=device)
    assert (tmp_path / "out.safetensors").read_bytes() == b.read_bytes()
    assert 1 <= len(busy_device) - tried <= 2
    assert capsys.readouterr().err.count("scattering the changes on the CPU instead") == 1


def test_a_device_asked_for_by_name_that_fails_is_one_error(chain, busy_device: list[str]):
    """Asked for by name (`--device cuda`), a device that fails is a DeviceError naming it and
    the fix, not an internal error, and there is no quiet fallback."""
    from pulsectl.errors import DeviceError

    with pytest.raises(DeviceError) as caught:
        diff_checkpoints(chain[0], chain[1], io.BytesIO(), options=DiffOptions(device="cpu"))
    assert caught.value.message == (
        "--device cpu: finding changed words failed: CUDA out of memory. Tried to allocate "
        "16.00 MiB; use --device cpu (the same bytes) or free the device's memory"
    )


def test_one_calls_choice_does_not_make_a_named_device_fall_back(
    chain, busy_device: list[str], capsys: pytest.CaptureFixture[str]
):
    """The mark of a device pulsectl chose travels with the name, not in a process-wide set:
    after a chosen 'cpu' failed (and fell back), the same device named by a caller still
    fails with DeviceError, as documented."""
    from pulsectl.device import chosen
    from pulsectl.errors import DeviceError

    a, b = chain[0], chain[1]
    diff_checkpoints(a, b, io.BytesIO(), options=DiffOptions(workers=1, device=chosen("cpu")))
    assert "--device auto: cpu failed" in capsys.readouterr().err
    with pytest.raises(DeviceError, match="--device cpu: finding changed words failed"):
        diff_checkpoints(a, b, io.BytesIO(), options=DiffOptions(workers=1, device="cpu"))
