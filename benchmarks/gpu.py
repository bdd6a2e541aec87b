"""Live-weights benchmark: state dict -> patch bytes, and patch -> applied to live tensors.

    python benchmarks/gpu.py [--shape qwen2.5-7b] [--density 0.01] [--level 3]

On a machine with a CUDA GPU it builds a Qwen2.5-7B-shaped BF16 state on the GPU (~15 GB),
moves ~1% of its words by one unit (one RL step), and times:

- publish: ``make_patch(old, new)`` from the live GPU tensors (changed words found on the GPU);
- apply: ``apply_patch(state, patch)`` into live GPU tensors (verified, then scattered);

and the same on the CPU, checking the patches are byte-identical. Without a GPU it runs the
same code on the CPU with the smaller ``--shape`` (default "small"), so the harness itself is
tested everywhere. Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from pulsectl.synth import shapes
from pulsectl.torch_api import apply_patch, make_patch


def build(shape: str, density: float, device: str, seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    old, new = {}, {}
    for name, shp in shapes(shape).items():
        scale = 1.0 if "norm" in name else 0.02
        w = (torch.randn(shp, generator=g, device=device) * scale).to(torch.bfloat16)
        if "norm" in name:
            w = w * 0 + 1
        moved = w.clone()
        bits = moved.view(torch.int16)
        mask = torch.rand(shp, generator=g, device=device) < density
        sign = torch.where(torch.rand(shp, generator=g, device=device) < 0.5, 1, -1)
        bits[mask] += sign.to(torch.int16)[mask]
        old[name], new[name] = w, moved
    return old, new


def timed(fn, sync: bool) -> tuple[float, object]:
    if sync:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, result


def measure(shape: str, density: float, level: int | str, device: str) -> tuple[dict, bytes]:
    old, new = build(shape, density, device)
    sync = device == "cuda"
    make_patch(old, new, level=level)  # warm-up (allocator, thread pool)
    t_patch, patch = timed(lambda: make_patch(old, new, level=level), sync)
    state = {k: v.clone() for k, v in old.items()}
    t_apply, _ = timed(lambda: apply_patch(state, patch), sync)
    exact = all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    row = {
        "device": device,
        "gpu": torch.cuda.get_device_name() if sync else None,
        "shape": shape,
        "state_bytes": sum(t.numel() * t.element_size() for t in new.values()),
        "patch_bytes": len(patch),
        "publish_s": t_patch,
        "apply_s": t_apply,
        "exact": exact,
    }
    return row, patch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--shape", default="qwen2.5-7b" if cuda else "small")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--level", default="3")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    level = args.level if args.level == "max" else int(args.level)

    devices = ["cuda", "cpu"] if cuda else ["cpu"]
    measured = [measure(args.shape, args.density, level, device) for device in devices]
    rows = [row for row, _ in measured]
    patches = {row["device"]: patch for row, patch in measured}
    result = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "rows": rows,
        "identical_across_devices": len(set(patches.values())) == 1,
    }
    for r in rows:
        print(
            f"{r['device']:>5} {r['shape']}: state {r['state_bytes'] / 1e9:.2f} GB, patch "
            f"{r['patch_bytes'] / 1e6:.1f} MB, live state -> patch {r['publish_s']:.2f} s, "
            f"patch -> live tensors {r['apply_s']:.2f} s, exact {r['exact']}"
        )
    print(f"patches identical across devices: {result['identical_across_devices']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
