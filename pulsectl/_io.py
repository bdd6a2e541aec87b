"""Low-level reads and the bounded ordered worker pool shared by diff and apply."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from pulsectl.errors import InputError

T = TypeVar("T")


def pread_array(fd: int, offset: int, nbytes: int, path: str) -> np.ndarray:
    """Read exactly ``nbytes`` at ``offset`` into a new uint8 array."""
    buf = np.empty(nbytes, dtype=np.uint8)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            raise InputError(f"{path}: cannot read: {exc.strerror}", path=path) from exc
        if n == 0:
            raise InputError(
                f"{path}: file is shorter than its header says (changed while reading?)",
                path=path,
            )
        got += n
    return buf


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


def ordered_map(
    tasks: Iterable[Callable[[], T]], workers: int, window: int | None = None
) -> Iterator[T]:
    """Run ``tasks`` on a thread pool, yielding results in task order with a bounded window.

    At most ``window`` tasks are queued or running at once, so memory stays bounded by the
    window times one task's working set.
    """
    window = window or 2 * workers + 2
    if workers <= 1:
        for task in tasks:
            yield task()
        return
    pending: deque[Future[T]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pulsectl") as pool:
        try:
            for task in tasks:
                pending.append(pool.submit(task))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
