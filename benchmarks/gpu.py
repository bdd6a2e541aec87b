"""Live-weights benchmark: state dict -> patch bytes, and patch -> applied to live tensors.

    python benchmarks/gpu.py [--shape qwen2.5-7b] [--density 0.01] [--level 3] [--json PATH]

Builds a BF16 state of the given model shape (Qwen2.5-7B, ~15 GB, on a machine with a CUDA
GPU) and a copy with ~``--density`` of its words moved by one unit (one RL step), once, then
holds the same bytes on the host. It checks and times:

- the reference: ``make_patch`` over the host copies (numpy, no torch device path), which is
  byte for byte ``pulsectl diff`` of the saved files; ``apply_patch`` into a host copy;
- publish: ``make_patch(old, new)`` from the live GPU tensors (changed words found on the GPU);
- publish with ``Publisher``'s default host snapshot: old on the host, new on the GPU;
- apply: ``apply_patch(state, patch)`` into live GPU tensors (verified, then scattered);

Every GPU patch must equal the reference byte for byte and every applied state must equal the
target bit for bit; the peak GPU memory each step allocates beyond the states is reported.
The exit status is 1 when any check fails. Without a GPU only the host rows run, on the
smaller default shape ("small"), so the harness itself is tested everywhere.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pulsectl.synth import shapes
from pulsectl.torch_api import apply_patch, make_patch, state_dict_fingerprint

State = dict[str, torch.Tensor]


def build(shape: str, density: float, device: str, seed: int = 0) -> tuple[State, State]:
    """A BF16 state on ``device`` and a copy with ~``density`` of its words moved by +-1."""
    g = torch.Generator(device=device).manual_seed(seed)
    old, new = {}, {}
    for name, shp in shapes(shape).items():
        if "norm" in name:
            w = torch.ones(shp, dtype=torch.bfloat16, device=device)
        else:
            w = (torch.randn(shp, generator=g, device=device) * 0.02).to(torch.bfloat16)
        moved = w.clone()
        bits = moved.view(torch.int16)
        mask = torch.rand(shp, generator=g, device=device) < density
        sign = torch.where(torch.rand(shp, generator=g, device=device) < 0.5, 1, -1)
        bits[mask] += sign.to(torch.int16)[mask]
        old[name], new[name] = w, moved
    return old, new


def to(state: State, device: str) -> State:
    return {k: v.to(device, copy=True) for k, v in state.items()}


def same(a: State, b: State) -> bool:
    """Bit for bit (compared as 16-bit words: BF16 NaNs and -0.0 count too)."""
    return a.keys() == b.keys() and all(
        a[k].device == b[k].device and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a
    )


def timed(fn: Callable[[], Any], cuda: bool) -> tuple[float, int | None, Any]:
    """Seconds, peak GPU bytes allocated beyond what was allocated before (None without a
    GPU), and the result."""
    peak = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    return time.perf_counter() - t0, peak, result


def run(shape: str, density: float, level: int | str, cuda: bool, cpu_apply: bool) -> dict:
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    old_d, new_d = build(shape, density, device)
    host_old, host_new = (to(old_d, "cpu"), to(new_d, "cpu")) if cuda else (old_d, new_d)
    built_s = time.perf_counter() - t0
    state_bytes = sum(t.numel() * t.element_size() for t in host_new.values())
    target_fp = state_dict_fingerprint(host_new)
    rows: list[dict] = []
    ok = True

    def row(what: str, seconds: float, peak: int | None, **checks: bool) -> None:
        nonlocal ok
        ok = ok and all(checks.values())
        rows.append({"what": what, "seconds": seconds, "peak_gpu_bytes": peak, **checks})

    # The reference, on the host: numpy's change finder, as `pulsectl diff` of the files.
    first = dict(list(host_old.items())[:3])
    make_patch(first, dict(list(host_new.items())[:3]), level=level)  # warm-up (thread pool)
    t, _, ref = timed(lambda: make_patch(host_old, host_new, level=level), False)
    row("host: state -> patch", t, None)
    if cpu_apply:
        state = to(host_old, "cpu")
        t, _, fp = timed(lambda: apply_patch(state, ref), False)
        row(
            "host: patch -> tensors",
            t,
            None,
            exact=same(state, host_new),
            fingerprint=fp == target_fp,
        )
        del state

    if cuda:
        first_d = dict(list(old_d.items())[:3])
        make_patch(first_d, dict(list(new_d.items())[:3]), level=level)  # warm-up (CUDA, pool)
        t, peak, patch = timed(lambda: make_patch(old_d, new_d, level=level), True)
        row("gpu: live state -> patch", t, peak, identical=patch == ref)
        # Publisher's default: the last published state is a host copy, the new one live.
        t, peak, patch = timed(lambda: make_patch(host_old, new_d, level=level), True)
        row("gpu: host snapshot + live state -> patch", t, peak, identical=patch == ref)
        state = to(old_d, "cuda")
        t, peak, fp = timed(lambda: apply_patch(state, ref), True)
        row(
            "gpu: patch -> live tensors",
            t,
            peak,
            exact=same(state, new_d),
            fingerprint=fp == target_fp,
        )
        del state

    return {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "shape": shape,
        "density": density,
        "level": level,
        "state_bytes": state_bytes,
        "patch_bytes": len(ref),
        "build_s": built_s,
        "rows": rows,
        "ok": ok,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--shape", default="qwen2.5-7b" if cuda else "small")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--level", default="3")
    parser.add_argument("--cpu", action="store_true", help="host rows only, even with a GPU")
    parser.add_argument(
        "--no-cpu-apply", action="store_true", help="skip timing apply_patch into host tensors"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    level = args.level if args.level == "max" else int(args.level)

    result = run(args.shape, args.density, level, cuda and not args.cpu, not args.no_cpu_apply)
    print(
        f"{result['shape']} on {result['gpu'] or result['machine']}: state "
        f"{result['state_bytes'] / 1e9:.2f} GB, patch {result['patch_bytes'] / 1e6:.1f} MB "
        f"(level {level}, density {args.density})"
    )
    for r in result["rows"]:
        checks = {k: v for k, v in r.items() if k not in ("what", "seconds", "peak_gpu_bytes")}
        peak = (
            "" if r["peak_gpu_bytes"] is None else f", peak GPU +{r['peak_gpu_bytes'] / 1e6:.0f} MB"
        )
        flags = "".join(f", {k} {v}" for k, v in checks.items())
        print(f"  {r['what']:<42} {r['seconds']:7.2f} s{peak}{flags}")
    print("all checks passed" if result["ok"] else "CHECK FAILED: see the rows above")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
