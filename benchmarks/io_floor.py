"""apply's I/O floor: what writing a checkpoint by pread and pwrite costs, beside cp and apply.

    python benchmarks/io_floor.py [--out DIR] [--lr 1e-6] [--k 1] [--rounds 7]

#3 asks `pulsectl apply` for at most 1.5x `cp` of the target. `apply` must read every base
byte into memory, patch it and write it; `cp` copies in the kernel (copy_file_range). This
script times, on one pair of the benchmark chains (built or reused in OUT/chains, as
benchmarks/run.py builds them), in turn in each round and as child processes:

- `cp` of the target;
- `pulsectl apply` of the default patch;
- start-up: the interpreter with the modules apply imports, and nothing else;
- copy: the target copied the way apply writes it, with no patch: 2 threads, each
  step read (pread) into a reused buffer, hashed, written (pwrite) under a lock per file, and
  hashed again in order by the main thread; the steps are apply's for a full patch (the
  header, then each tensor in blocks of 8 MiB, at the tensors' own offsets). apply hashes each
  tensor's base blocks in order; here each step is hashed on its own, which never waits: a
  floor, not a model of apply.

It prints the best and median wall time of each and their ratios to `cp`, and, for the copy,
the loop alone (without the interpreter's start-up, as the child measures it). Before every
command all outputs are removed, so that no command runs with another's gigabyte of dirty
pages still waiting (a precaution: the kernel starts writing back at 10% of memory here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pulsectl.format import DEFAULT_BLOCK_BYTES  # noqa: E402 - after the path is set

BLOCK = DEFAULT_BLOCK_BYTES  # diff's, so apply's steps
WORKERS = 2
WINDOW = 2 * WORKERS + 4  # steps in flight, each with a buffer of its own
STARTUP = "import pulsectl.cli.app, pulsectl.apply"


def steps(path: Path) -> list[tuple[int, int]]:
    """(offset, size) of each write: apply's steps for a full patch."""
    size = path.stat().st_size
    from pulsectl.checkpoint import Checkpoint

    header = Checkpoint.open(path).files[0].header
    assert header is not None
    tensors = sorted(header.tensors, key=lambda t: t.start)
    out = [(0, tensors[0].start if tensors else size)]
    for t in tensors:
        out += [(t.start + at, min(BLOCK, t.nbytes - at)) for at in range(0, t.nbytes, BLOCK)]
    return [s for s in out if s[1] > 0]


def copy(src: Path, dst: Path, times: Path) -> None:
    """The copy measured as a child: appends the loop's own wall time and the fingerprint of
    what it wrote (hashed in order, as apply does) to ``times``."""
    import numpy as np
    import xxhash

    plan = steps(src)
    fi = os.open(src, os.O_RDONLY)
    fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    lock = threading.Lock()
    out_h = xxhash.xxh3_128()
    # Each step gets its buffer when it is submitted, at most WINDOW at once: a worker waiting
    # for a buffer while the ones ahead of it hold them all, waiting to be taken in order,
    # would never get one.
    free = [np.empty(BLOCK, np.uint8) for _ in range(WINDOW)]

    def step(index: int, buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at, n = plan[index]
        view = buf[:n]
        got = 0
        while got < n:
            got += os.preadv(fi, [view[got:]], at + got)
        xxhash.xxh3_128(view).digest()  # every base byte hashed, in no order: a floor
        with lock:
            os.pwrite(fo, view, at)
        return buf, view

    t0 = time.perf_counter()
    with ThreadPoolExecutor(WORKERS) as pool:
        pending: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
        for index in range(len(plan)):
            if not free:
                buf, view = pending.popleft().result()
                out_h.update(view)
                free.append(buf)
            pending.append(pool.submit(step, index, free.pop()))
        while pending:
            buf, view = pending.popleft().result()
            out_h.update(view)
    loop = time.perf_counter() - t0
    os.close(fi)
    os.close(fo)
    with times.open("a") as f:
        f.write(f"{loop!r} {out_h.hexdigest()}\n")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--copy":
        copy(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/pulsectl-bench"))
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    from benchmarks import measure
    from benchmarks.chains import RUN_KS, ensure_chain, step_path
    from pulsectl.checkpoint import Checkpoint
    from pulsectl.inventory import fingerprint_of

    measure.byte_compile_pulsectl()
    chain = ensure_chain(
        args.out / "chains", args.preset, args.lr, max(args.k, *RUN_KS), {0, args.k}
    )
    old, new = step_path(chain, 0), step_path(chain, args.k)
    pulsectl = str(Path(sys.executable).with_name("pulsectl"))
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        work = Path(tmp)
        patch, out, dest = work / "p.pulse", work / "out.safetensors", work / "cp.safetensors"
        made = measure.timed([pulsectl, "-q", "diff", str(old), str(new), "-o", str(patch)])
        if made.returncode != 0:
            sys.exit("pulsectl diff failed")
        times = work / "copy.times"

        def fresh(*inputs: Path) -> Callable[[], None]:
            """Every output removed (none of the command before's dirty pages left), inputs
            warm."""

            def before() -> None:
                out.unlink(missing_ok=True)
                dest.unlink(missing_ok=True)
                measure.warm(*inputs)

            return before

        script = str(Path(__file__).resolve())
        commands: dict[str, tuple[list[str], Callable[[], None] | None]] = {
            "cp": (["cp", str(new), str(dest)], fresh(new)),
            "apply": (
                [pulsectl, "apply", str(old), str(patch), "-o", str(out), "-q"],
                fresh(old, patch),
            ),
            "start-up": ([sys.executable, "-c", STARTUP], fresh()),
            "copy": (
                [sys.executable, script, "--copy", str(new), str(dest), str(times)],
                fresh(new),
            ),
        }
        timed = measure.in_turn(args.rounds, commands)
        runs = [line.split() for line in times.read_text().splitlines()]
        loops = [float(loop) for loop, _ in runs]
        want = fingerprint_of(Checkpoint.open(new))
        if timed["apply"]["returncode"] != 0 or any(fp != want for _, fp in runs):
            sys.exit("apply failed, or the copy did not write the target's bytes in order")

    cp_best = timed["cp"]["wall_s"]
    cp_median = statistics.median(timed["cp"]["walls_s"])
    print(f"{args.preset} lr {args.lr:g} k {args.k}: {new.stat().st_size:,} bytes, ", end="")
    print(f"{args.rounds} rounds in turn, wall seconds (ratio to cp)")
    print(f"{'':16s} {'best':>15s} {'median':>15s}")
    for name, got in timed.items():
        best, median = got["wall_s"], statistics.median(got["walls_s"])
        print(
            f"{name:16s} {best:7.3f} ({best / cp_best:4.2f}x) "
            f"{median:7.3f} ({median / cp_median:4.2f}x)"
        )
    print(f"copy, the loop alone: best {min(loops):.3f}, median {statistics.median(loops):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
