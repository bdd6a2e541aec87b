"""Benchmark pulsectl against the PULSESync v3.1 layout, generic delta tools and entropy bounds.

    python benchmarks/run.py [--preset small|qwen2.5-0.5b] [--out DIR] [--quick]

Builds (or reuses, from OUT/chains) one synthetic BF16 chain per learning rate with
pulsectl.synth, then for each (lr, k) diffs step_0 against step_k and measures, side by side:
pulsectl patch sizes (default level, and --level max when the CLI offers it), the v3.1 layout
(encoded, decoded and checked here), zstd --patch-from, xdelta3 and full-checkpoint zstd -3
(when installed), the empirical entropy of the change stream, and wall time and peak RSS of
`pulsectl diff` / `pulsectl apply` against a bare compare pass and `cp` measured the same way,
and beside them what those references leave out: the start-up of a Python that loads what
pulsectl loads, and hashing both files (xxh3-128, the fingerprints every patch records).
Writes docs/BENCHMARKS.md, and the raw results as JSON to OUT/benchmarks.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks import breakdown, entropy, extras, measure, report, v31  # noqa: E402
from benchmarks.chains import RUN_KS, RUN_LRS, ensure_chain, step_path  # noqa: E402
from benchmarks.tensors import data_region, largest_tensor_bytes, load_pairs  # noqa: E402

MB = 1_000_000


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# The start-up of a `diff` or `apply`: the interpreter and the modules they load (numpy,
# typer, the codecs), with no work after.
STARTUP_SCRIPT = (
    "import os; os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')\n"  # as the CLI does
    "import pulsectl.cli.app, pulsectl.apply, pulsectl.diff"
)


def pulsectl_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("pulsectl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pulsectl"]


def has_level_max(cli: list[str], scratch: Path) -> bool:
    """Whether `pulsectl diff` accepts --level max: try it on a tiny pair."""
    from pulsectl.synth import generate_chain

    probe = scratch / "level-max-probe"
    a, b = generate_chain(probe, shape="tiny", steps=1, lr=1e-3)
    r = subprocess.run(
        cli + ["-q", "diff", str(a), str(b), "-o", str(probe / "p.pulse"), "-f", "--level", "max"],
        capture_output=True,
        text=True,
    )
    return r.returncode == 0


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def tool_versions() -> dict[str, str | None]:
    import zstandard

    from pulsectl import __version__
    from pulsectl.codecs import _fast

    out: dict[str, str | None] = {
        "pulsectl": __version__,
        "python-zstandard": zstandard.__version__,
        # the compiled inner loops (pulsectl/_speedups.c), or the numpy fallback
        "speedups": "numpy fallback"
        if _fast.native is None
        else f"compiled ({_fast.native.simd(None)} loops)",
    }
    for tool, flag in (("zstd", "--version"), ("xdelta3", "-V")):
        path = measure.which(tool)
        if path is None:
            out[tool] = None
            continue
        r = subprocess.run([path, flag], capture_output=True, text=True)
        text = (r.stdout + r.stderr).strip()
        found = re.search(r"v?(\d+\.\d+(\.\d+)?)", text)
        out[tool] = found.group(1) if found else path
    return out


def file_size(p: Path) -> int:
    return p.stat().st_size


def git_rev() -> str | None:
    r = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (r.stdout.strip() + ("+dirty" if dirty else "")) if r.returncode == 0 else None


def same_bytes(a: Path, b: Path) -> bool:
    if file_size(a) != file_size(b):
        return False
    return bool(
        np.array_equal(
            np.memmap(a, dtype=np.uint8, mode="r"), np.memmap(b, dtype=np.uint8, mode="r")
        )
    )


def bench_pair(
    old: Path,
    new: Path,
    work: Path,
    args: argparse.Namespace,
    cli: list[str],
    level_max: bool,
    full_zstd_cache: dict[str, int],
    skip_max: dict[str, int],
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = {"old": str(old), "new": str(new), "target_bytes": file_size(new)}
    rec["loadavg_start"] = os.getloadavg()
    measure.warm(old, new)

    # Ground truth and the v3.1 / entropy references (in process).
    pairs = load_pairs(old, new)
    rec["words"] = sum(p.old.size for p in pairs.values())
    rec["largest_tensor_bytes"] = largest_tensor_bytes(new)
    t0 = time.perf_counter()
    rec["entropy"] = entropy.measure(pairs)
    rec["changed"] = rec["entropy"]["changed"]
    log(f"  changed {rec['changed']:,} of {rec['words']:,} words ({time.perf_counter() - t0:.1f}s)")
    rec["v31"] = v31.measure(pairs)
    if rec["v31"]["changed"] != rec["changed"]:
        raise AssertionError("v3.1 change count disagrees with the numpy count")
    log(f"  v3.1 {rec['v31']['bytes']:,} B, encode {rec['v31']['encode_s']:.2f}s, decode+check ok")
    try:
        rec["pulsectl_breakdown"] = breakdown.measure(pairs)
    except Exception as exc:  # internals may have moved; the breakdown is optional
        rec["pulsectl_breakdown"] = {"error": repr(exc)}
    del pairs

    # pulsectl diff / apply, each in a fresh child.
    levels = ["default"] + (["max"] if level_max else [])
    rec["pulsectl"] = {}
    for level in levels:
        patch = work / f"{level}.pulse"
        cmd = cli + ["-q", "diff", str(old), str(new), "-o", str(patch), "-f"]
        if level == "max":
            cmd += ["--level", "max"]
            too_slow = skip_max.get("changed")
            if too_slow is not None and rec["changed"] >= too_slow:
                rec["pulsectl"][level] = {
                    "skipped": f"timed out on a pair with {too_slow:,} changes"
                }
                continue
        measure.warm(old, new)
        # The default level is timed again below, in turns with its references.
        runs = 1 if level == "default" else args.repeats
        d = measure.best_of(runs, cmd, timeout=args.pulsectl_timeout)
        entry: dict[str, Any] = {"diff": d, "cmd": shlex.join(cmd)}
        if d["timed_out"]:
            entry["timeout_s"] = args.pulsectl_timeout
            if level == "max":
                skip_max["changed"] = min(rec["changed"], skip_max.get("changed", rec["changed"]))
        if d["returncode"] == 0:
            entry["bytes"] = file_size(patch)
            out = work / "applied.safetensors"
            out.unlink(missing_ok=True)
            acmd = cli + ["-q", "apply", str(old), str(patch), "-o", str(out), "-f"]
            measure.warm(old, patch)
            # Each run writes a fresh file, as cp does below (no old output to replace).
            a = measure.best_of(
                1 if level == "default" else args.repeats,
                acmd,
                timeout=args.pulsectl_timeout,
                before=functools.partial(out.unlink, missing_ok=True),
            )
            entry["apply"] = a
            entry["apply_cmd"] = shlex.join(acmd)
            entry["apply_exact"] = a["returncode"] == 0 and same_bytes(out, new)
            out.unlink(missing_ok=True)
            insp = subprocess.run(
                cli + ["inspect", "--json", str(patch)], capture_output=True, text=True
            )
            if insp.returncode == 0:
                doc = json.loads(insp.stdout)
                tensors = doc.get("tensors", [])
                entry["inspect"] = {
                    "changed_words": doc.get("changed_words"),
                    "encoded_bytes": sum(t.get("encoded_bytes", 0) for t in tensors),
                    "top": sorted(
                        (
                            {
                                "name": t["name"],
                                "changed": t.get("changed_words"),
                                "bytes": t.get("encoded_bytes"),
                            }
                            for t in tensors
                        ),
                        key=lambda t: -(t["bytes"] or 0),
                    )[:5],
                }
        rec["pulsectl"][level] = entry
        log(
            f"  pulsectl {level}: {entry.get('bytes')} B, diff {d['wall_s']:.2f}s "
            f"(cpu {d['cpu_s']:.2f}s){' TIMEOUT' if d['timed_out'] else ''}"
        )

    # The default level's diff and apply against their references (a bare compare pass, cp
    # of the target), in turns: diff, compare, apply, cp in every round.
    start, end = data_region(new)
    dest = work / "cp.safetensors"
    out = work / "applied.safetensors"
    default = rec["pulsectl"].get("default", {})
    commands: dict[str, tuple[list[str], Any]] = {}
    if default.get("diff", {}).get("returncode") == 0:
        commands["diff"] = (shlex.split(default["cmd"]), lambda: measure.warm(old, new))
    commands["compare"] = (
        measure.compare_cmd(old, new, start, end),
        lambda: measure.warm(old, new),
    )
    # apply and cp each write 1 GB: the other's output is removed before each runs (checked
    # first, for apply's), so that neither runs while the other's pages are written back.
    exact = [True]

    def clear_outputs() -> None:
        if out.exists():
            exact[0] = exact[0] and same_bytes(out, new)
            out.unlink()
        dest.unlink(missing_ok=True)

    if "apply" in default:
        commands["apply"] = (
            shlex.split(default["apply_cmd"]),
            lambda: (clear_outputs(), measure.warm(old, work / "default.pulse")),
        )
    commands["cp"] = (["cp", str(new), str(dest)], lambda: (clear_outputs(), measure.warm(new)))
    # What the two references leave out: the tool's start-up, and hashing both files.
    commands["startup"] = ([sys.executable, "-c", STARTUP_SCRIPT], None)
    commands["hash"] = (measure.hash_cmd(old, new), lambda: measure.warm(old, new))
    timed = measure.in_turn(args.rounds, commands, timeout=args.pulsectl_timeout)
    clear_outputs()
    if "apply" in timed:
        default["apply_exact"] = default["apply_exact"] and exact[0]
    for name in ("diff", "apply"):
        if name in timed:
            default[name] = timed[name]
    rec["compare"], rec["cp"] = timed["compare"], timed["cp"]
    rec["startup"], rec["hash"] = timed["startup"], timed["hash"]
    rec["timing"] = "in turn: diff, compare, apply, cp, startup, hash in each round"

    rec["loadavg_timed"] = os.getloadavg()  # right after the timed commands

    # Generic tools (skipped when absent).
    rec["generic"] = generic_tools(old, new, work, args, full_zstd_cache)
    return rec


def _sample(
    old: Path, new: Path, work: Path, total: int, pieces: int = 8
) -> tuple[Path, Path, int]:
    """Evenly spaced pieces of both data regions, concatenated: (old, new, changed words)."""
    start, end = data_region(new)
    piece = (total // pieces) & ~1
    span = (end - start - piece) & ~1
    offsets = [start + ((span * i // max(1, pieces - 1)) & ~1) for i in range(pieces)]
    mo = np.memmap(old, dtype=np.uint8, mode="r")
    mn = np.memmap(new, dtype=np.uint8, mode="r")
    so, sn = work / "sample-old.bin", work / "sample-new.bin"
    changed = 0
    with open(so, "wb") as fo, open(sn, "wb") as fn:
        for off in offsets:
            a, b = mo[off : off + piece], mn[off : off + piece]
            fo.write(a.tobytes())
            fn.write(b.tobytes())
            changed += int((a.view(np.uint16) != b.view(np.uint16)).sum())
    return so, sn, changed


def generic_tools(
    old: Path, new: Path, work: Path, args: argparse.Namespace, full_cache: dict[str, int]
) -> dict[str, Any]:
    """zstd --patch-from and xdelta3 (on a sample when the file is large), full zstd -3."""
    out: dict[str, Any] = {}
    zstd, xdelta = measure.which("zstd"), measure.which("xdelta3")
    limit = int(args.generic_sample_mb * MB)
    if file_size(new) > limit:
        src, dst, changed = _sample(old, new, work, limit)
        out["sample"] = {"bytes": file_size(dst), "pieces": 8, "changed": changed}
    else:
        src, dst = old, new
    if zstd and not args.no_patch_from:
        p = work / "zstd-patch-from.zst"
        cmd = [
            zstd,
            "-q",
            "-f",
            f"-{args.patch_from_level}",
            "--long=31",
            f"--patch-from={src}",
            str(dst),
            "-o",
            str(p),
        ]
        r = measure.best_of(1, cmd, timeout=args.tool_timeout)
        out["zstd_patch_from"] = {
            "cmd": shlex.join(cmd),
            **r,
            "bytes": file_size(p) if r["returncode"] == 0 else None,
        }
        p.unlink(missing_ok=True)
        log(f"  zstd --patch-from: {out['zstd_patch_from']['bytes']} B in {r['wall_s']:.1f}s")
    elif not zstd:
        out["zstd_patch_from"] = {"skipped": "zstd not installed"}
    if xdelta:
        p = work / "xdelta3.vcdiff"
        cmd = [xdelta, "-e", "-f", "-s", str(src), str(dst), str(p)]
        r = measure.best_of(1, cmd, timeout=args.tool_timeout)
        out["xdelta3"] = {
            "cmd": shlex.join(cmd),
            **r,
            "bytes": file_size(p) if r["returncode"] == 0 else None,
        }
        p.unlink(missing_ok=True)
        log(f"  xdelta3: {out['xdelta3']['bytes']} B in {r['wall_s']:.1f}s")
    else:
        out["xdelta3"] = {"skipped": "xdelta3 not installed"}
    if src != old:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
    key = str(new)
    if key not in full_cache:
        if zstd:
            p = work / "full.zst"
            measure.best_of(1, [zstd, "-q", "-f", "-3", str(new), "-o", str(p)])
            full_cache[key] = file_size(p)
            p.unlink(missing_ok=True)
        else:
            import zstandard

            cctx = zstandard.ZstdCompressor(level=3)
            with open(new, "rb") as f:
                full_cache[key] = sum(len(c) for c in cctx.read_to_iter(f, read_size=1 << 24))
    out["full_zstd3"] = {
        "bytes": full_cache[key],
        "tool": "zstd -3" if zstd else "python-zstandard level 3",
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset", default=None, help="model shape (default qwen2.5-0.5b; small with --quick)"
    )
    ap.add_argument(
        "--out", type=Path, default=Path("/tmp/pulsectl-bench"), help="chains and scratch"
    )
    ap.add_argument(
        "--quick", action="store_true", help="small preset, one timing run: a smoke test"
    )
    ap.add_argument("--lrs", type=float, nargs="+", default=list(RUN_LRS))
    ap.add_argument("--ks", type=int, nargs="+", default=list(RUN_KS))
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs of each `--level max` command (best kept; default: as many as "
        "--rounds, the tries its references get)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of default diff, compare, apply and cp in turn (best kept; default 5)",
    )
    ap.add_argument("--patch-from-level", type=int, default=19)
    ap.add_argument("--no-patch-from", action="store_true", help="skip zstd --patch-from (slow)")
    ap.add_argument(
        "--generic-sample-mb",
        type=float,
        default=16.0,
        help="run zstd --patch-from and xdelta3 on an evenly spaced sample of this many "
        "MB when the checkpoint is larger (they take minutes per 100 MB)",
    )
    ap.add_argument(
        "--pulsectl-timeout",
        type=float,
        default=600.0,
        help="seconds per pulsectl diff/apply run; a --level max timeout skips larger pairs",
    )
    ap.add_argument(
        "--tool-timeout", type=float, default=900.0, help="seconds per generic tool run"
    )
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "BENCHMARKS.md")
    ap.add_argument(
        "--json", type=Path, default=None, help="raw results (default OUT/benchmarks.json)"
    )
    ap.add_argument(
        "--render-only",
        type=Path,
        default=None,
        metavar="JSON",
        help="only rewrite --doc from the raw results of an earlier run",
    )
    args = ap.parse_args(argv)
    if args.render_only:
        args.doc.write_text(
            report.render(json.loads(args.render_only.read_text())) + extras.render(args.out)
        )
        log(f"wrote {args.doc} from {args.render_only}")
        return 0
    args.preset = args.preset or ("small" if args.quick else "qwen2.5-0.5b")
    args.rounds = args.rounds or (1 if args.quick else 5)
    # The `--level max` commands get as many tries as their references (the compare pass and
    # cp, best of --rounds): with fewer, a slow moment of the machine weighs on them alone.
    args.repeats = args.repeats or args.rounds
    args.json = args.json or args.out / "benchmarks.json"

    cli = pulsectl_cmd()
    no_write_bytecode = measure.byte_compile_pulsectl()
    level_max = has_level_max(cli, args.out)
    steps = max(args.ks)
    results: dict[str, Any] = {
        "schema": 1,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/run.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset,
        "git": git_rev(),
        "machine": machine(),
        "tools": tool_versions(),
        "level_max_available": level_max,
        "byte_compiled": {"pulsectl": True, "pythondontwritebytecode": no_write_bytecode},
        "repeats": args.repeats,
        "rounds": args.rounds,
        "json": str(args.json),
        "pairs": [],
    }
    log(f"preset {args.preset}, lrs {args.lrs}, ks {args.ks}, --level max: {level_max}")
    chains = args.out / "chains"
    full_cache: dict[str, int] = {}
    skip_max: dict[str, int] = {}  # once --level max times out, larger pairs are skipped
    t_start = time.perf_counter()
    for lr in args.lrs:
        d = ensure_chain(chains, args.preset, lr, steps, {0, *args.ks})
        for k in args.ks:
            log(f"lr {lr:g}, k {k}")
            work = args.out / "work" / args.preset / f"lr{lr:g}" / f"k{k}"
            rec = bench_pair(
                step_path(d, 0), step_path(d, k), work, args, cli, level_max, full_cache, skip_max
            )
            rec.update({"lr": lr, "k": k})
            results["pairs"].append(rec)
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    args.doc.write_text(report.render(results) + extras.render(args.out))
    log(f"wrote {args.doc} and {args.json} ({results['total_s']}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
