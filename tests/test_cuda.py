"""The torch API and --device on a real CUDA GPU: byte-identical to the CPU path.

CI has no GPU: the tests marked ``cuda`` skip there, and the device-generic ones run with
``device="cpu"`` (which checks the harness itself). On a CUDA machine run this file first:

    python -m pytest -q tests/test_cuda.py
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from pulsectl.torch_api import apply_patch, make_patch, state_dict_fingerprint

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
]


def _pair(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two host states, every dtype pulsectl knows: ``new`` has some bytes flipped and its BF16
    words moved by one unit (the delta codecs), some tensors unchanged, one 2-D pair meant to
    be transposed."""
    g = torch.Generator().manual_seed(seed)
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(_DTYPES):
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (4096 * size,), generator=g, dtype=torch.uint8)
        moved = raw.clone()
        flip = torch.rand(raw.shape, generator=g) < 0.01
        moved[flip] ^= 0x10
        old[f"t{i}"] = raw.view(dtype).reshape(64, -1)
        new[f"t{i}"] = moved.view(dtype).reshape(64, -1)
    w = (torch.randn(384, 256, generator=g) * 0.02).to(torch.bfloat16)
    step = w.clone()
    bits = step.view(torch.int16)
    mask = torch.rand(bits.shape, generator=g) < 0.05
    bits[mask] += torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)[
        mask
    ]
    old["w"], new["w"] = w, step
    old["same"] = new["same"] = torch.arange(1000, dtype=torch.float32)
    old["mask"] = torch.tensor([True, False, True])
    new["mask"] = torch.tensor([True, True, True])
    old["scalar"], new["scalar"] = torch.tensor(3, dtype=torch.int64), torch.tensor(4)
    old["empty"] = new["empty"] = torch.zeros(0, 5, dtype=torch.bfloat16)
    return old, new


def _on(state: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """``state`` on ``device``, with "w" as the transpose of a contiguous tensor there (a
    non-contiguous tensor, patched through its strides)."""
    out = {k: v.to(device) for k, v in state.items()}
    out["w"] = state["w"].t().contiguous().to(device).t()
    assert not out["w"].is_contiguous()
    return out


def _bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _assert_state(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert state.keys() == want.keys()
    for k in want:
        assert state[k].dtype == want[k].dtype and state[k].shape == want[k].shape, k
        assert _bytes(state[k]) == _bytes(want[k]), k


@pytest.mark.parametrize("level", [3, "max"])
@pytest.mark.parametrize("device", DEVICES)
def test_patch_from_device_tensors_is_the_host_patch(device: str, level) -> None:
    old, new = _pair(1)
    want = make_patch(old, new, level=level, workers=4)
    assert make_patch(_on(old, device), _on(new, device), level=level, workers=4) == want
    assert make_patch(_on(old, device), _on(new, device), level=level, workers=1) == want
    assert state_dict_fingerprint(_on(new, device)) == state_dict_fingerprint(new)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_into_device_tensors_gives_the_target(device: str) -> None:
    old, new = _pair(2)
    patch = make_patch(old, new, workers=4)
    state = _on(old, device)
    ptrs = {k: v.data_ptr() for k, v in state.items()}
    assert apply_patch(state, patch, workers=4) == state_dict_fingerprint(new)
    _assert_state(state, new)
    assert all(state[k].device.type == device for k in state)
    assert state["w"].stride() == (1, 384)  # the transpose, patched through its strides
    assert all(state[k].data_ptr() == ptrs[k] for k in state if state[k].numel())


@cuda
def test_a_mixed_cpu_and_cuda_state_dict() -> None:
    old, new = _pair(3)
    mixed_old = {k: v.to("cuda" if i % 2 else "cpu") for i, (k, v) in enumerate(old.items())}
    mixed_new = {k: v.to("cuda" if i % 3 else "cpu") for i, (k, v) in enumerate(new.items())}
    want = make_patch(old, new)
    assert make_patch(mixed_old, mixed_new) == want
    apply_patch(mixed_old, want)
    _assert_state(mixed_old, new)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_state_dict_over_two_gpus() -> None:
    old, new = _pair(4)
    spread_old = {k: v.to(f"cuda:{i % 2}") for i, (k, v) in enumerate(old.items())}
    spread_new = {k: v.to(f"cuda:{i % 2}") for i, (k, v) in enumerate(new.items())}
    on1_old = {k: v.to("cuda:1") for k, v in old.items()}
    on1_new = {k: v.to("cuda:1") for k, v in new.items()}
    want = make_patch(old, new)
    assert make_patch(spread_old, spread_new) == want
    assert make_patch(on1_old, on1_new) == want  # compared on cuda:1, not the current device
    apply_patch(spread_old, want)
    _assert_state(spread_old, new)
    assert all(v.device == torch.device(f"cuda:{i % 2}") for i, v in enumerate(spread_old.values()))


@cuda
@pytest.mark.parametrize("workers", [1, 4])
def test_make_patch_waits_for_work_queued_on_the_callers_stream(workers: int) -> None:
    """A trainer that overlaps work runs its step on a stream of its own and publishes from
    there. pulsectl reads the tensors on worker threads, whose current stream is the default
    one: they must not read before the step's kernels have written them. With one worker
    the blocks are encoded on the calling thread, but the base is still hashed on another."""
    old = {"w": torch.zeros(1 << 22, dtype=torch.bfloat16, device="cuda")}
    new = {"w": torch.zeros(1 << 22, dtype=torch.bfloat16, device="cuda")}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 29)  # about a quarter of a second before the writes below
        old["w"].view(torch.int16)[::2] += 2
        new["w"].view(torch.int16)[::3] += 1
        patch = make_patch(old, new, workers=workers)
    torch.cuda.synchronize()
    assert patch == make_patch({"w": old["w"].cpu()}, {"w": new["w"].cpu()})


@cuda
def test_apply_patch_after_work_queued_on_the_callers_stream() -> None:
    old, new = _pair(5)
    patch = make_patch(old, new)
    state = {k: torch.zeros_like(v, device="cuda") for k, v in old.items()}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 29)
        for k, v in old.items():
            state[k].copy_(v.to("cuda"))  # the base lands after the sleep
        apply_patch(state, patch, workers=4)
    torch.cuda.synchronize()
    _assert_state(state, new)


@cuda
@pytest.mark.parametrize("context", [False, True])
def test_file_diff_and_apply_with_device_cuda(tmp_path: Path, context: bool) -> None:
    from pulsectl.apply import apply_patches
    from pulsectl.diff import DiffOptions, diff_checkpoints, diff_to_path
    from pulsectl.synth import generate_chain

    chain = generate_chain(tmp_path / "c", shape="tiny", steps=2, lr=1e-5, seed=9)
    level = 19 if context else 3
    outs = []
    for device in (None, "cuda"):
        buf = io.BytesIO()
        options = DiffOptions(workers=4, context=context, level=level, device=device)
        diff_checkpoints(chain[0], chain[2], buf, options=options)
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    patch = tmp_path / "p.pulse"
    diff_to_path(chain[0], chain[2], patch, options=DiffOptions(context=context, level=level))
    out = tmp_path / "out.safetensors"
    apply_patches(chain[0], [patch], out, device="cuda")
    assert out.read_bytes() == chain[2].read_bytes()


@cuda
def test_apply_patch_device_memory_stays_bounded() -> None:
    """Every word of a 128 MiB BF16 tensor changes: its int64 index alone is 512 MiB. The
    writes go in slices, so the device needs far less than the tensor besides it."""
    base = torch.zeros(1 << 26, dtype=torch.bfloat16)
    target = base.clone()
    target.view(torch.int16)[:] += 1
    patch = make_patch({"w": base}, {"w": target})
    state = {"w": base.to("cuda")}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    apply_patch(state, patch)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 128 << 20
    assert _bytes(state["w"]) == _bytes(target)
