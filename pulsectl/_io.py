"""Low-level reads and the bounded ordered worker pool shared by diff and apply."""

from __future__ import annotations

import _thread
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from queue import Empty, SimpleQueue
from typing import Any, TypeVar

import numpy as np

from pulsectl.errors import InputError

T = TypeVar("T")


def pread_array(fd: int, offset: int, nbytes: int, path: str) -> np.ndarray:
    """Read exactly ``nbytes`` at ``offset`` into a new uint8 array."""
    return pread_into(fd, np.empty(nbytes, dtype=np.uint8), offset, path)


def pread_into(fd: int, buf: np.ndarray, offset: int, path: str) -> np.ndarray:
    """Fill ``buf`` (uint8) from ``offset``; returns it."""
    view = memoryview(buf)
    nbytes = buf.size
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


# Smaller reads are cheaper with pread than with a map and an unmap.
MIN_MAP_BYTES = 256 * 1024


def map_range(fd: int, offset: int, nbytes: int, path: str) -> np.ndarray | None:
    """``nbytes`` of the file from ``offset`` as a read-only uint8 array over a memory map of
    it (no copy is made), or None where no map is to be had: no compiled extension (see
    pulsectl/codecs/_fast.py), a small range, or a file system that cannot map. The map lives
    as long as the array. A file that gets shorter while it is mapped ends the process with
    the same error line as ``pread_into``, after removing the temp outputs of
    ``pulsectl._atomic.atomic_file`` (pulsectl/_speedups.c)."""
    from pulsectl.codecs._fast import native

    if native is None or nbytes < MIN_MAP_BYTES:
        return None
    try:
        mapped = native.map_file(fd, offset, nbytes, path)
    except EOFError:
        raise InputError(
            f"{path}: file is shorter than its header says (changed while reading?)", path=path
        ) from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}", path=path) from exc
    return None if mapped is None else np.frombuffer(mapped, dtype=np.uint8)


def pwrite_all(fd: int, data: np.ndarray | bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (raises OSError)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class BufferPool:
    """Reusable block buffers.

    A fresh 8 MiB array costs ~2,000 page faults on first touch, more than reading a block from
    the page cache into a warm one. ``take`` hands out a view of a buffer of the next power of
    two (so a tensor's odd-sized last block reuses one too); ``give`` takes it back once
    nothing refers to it any more. A buffer never given back is simply garbage collected.
    """

    _MIN = 64 * 1024

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: dict[int, list[np.ndarray]] = {}
        self._mine: dict[int, weakref.ref[np.ndarray]] = {}
        self._lock = threading.Lock()
        self._count = 0

    def take(self, nbytes: int) -> np.ndarray:
        size = max(self._MIN, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            stack = self._free.get(size)
            if stack:
                self._count -= 1
                return stack.pop()[:nbytes]
        buf = np.empty(size, dtype=np.uint8)
        key = id(buf)
        with self._lock:
            self._mine[key] = weakref.ref(buf, lambda _: self._mine.pop(key, None))
        return buf[:nbytes]

    def give(self, *views: object) -> None:
        """Return views from ``take`` (anything else is ignored)."""
        with self._lock:
            for view in views:
                if not isinstance(view, np.ndarray) or self._count >= self._keep:
                    continue
                buf = view.base if view.base is not None else view
                ref = self._mine.get(id(buf))
                if ref is None or ref() is not buf:
                    continue
                stack = self._free.setdefault(buf.size, [])
                if any(b is buf for b in stack):
                    continue
                stack.append(buf)
                self._count += 1


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 16))


IN_FLIGHT_BYTES = 512 * 1024 * 1024  # blocks queued or in work at once, across all workers


def window_for(workers: int, block_bytes: int) -> int:
    """Tasks in flight: enough to keep every worker busy, bounded in bytes.

    A task holds a few blocks' worth of memory (base, new, decoded), so 8 MiB blocks on 16
    workers stay well under a gigabyte, and 256 MiB blocks run two at a time.
    """
    return max(2, min(2 * workers + 2, IN_FLIGHT_BYTES // (3 * block_bytes)))


class _Slot:
    """Where a pool task leaves its result, and a C-level lock, held until it is there.

    The main thread waits on these rather than on ``Future.result``: an interrupt
    (KeyboardInterrupt, raised in the main thread by SIGINT and by pulsectl's SIGTERM handler)
    that lands inside ``threading.Condition``'s Python code can leave the condition's lock in a
    wrong state, and the next wait on it, in the clean-up, or a worker's, then hangs for good
    (seen: ``apply`` interrupted hung in one try in 1-9). A ``_thread.lock``'s acquire is one C
    call: an interrupt makes it raise without taking the lock, and leaves nothing half done.
    """

    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.value: Any = None
        self.error: BaseException | None = None


def _run_into(task: Callable[[], Any], slot: _Slot) -> None:
    try:
        slot.value = task()
    except BaseException as exc:  # handed to the waiting thread, as Future.result would
        slot.error = exc
    finally:
        slot.done.release()


def _result(slot: _Slot) -> Any:
    slot.done.acquire()
    slot.done.release()
    if slot.error is not None:
        error, slot.error = slot.error, None  # no reference cycle through the traceback
        raise error
    return slot.value


def ordered_map(
    tasks: Iterable[Callable[[], T]], workers: int, window: int | None = None
) -> Generator[T, None, None]:
    """Run ``tasks`` on a thread pool, yielding results in task order with a bounded window.

    At most ``window`` tasks are queued or running at once, so memory stays bounded by the
    window times one task's working set.
    """
    window = window or 2 * workers + 2
    if workers <= 1:
        for task in tasks:
            yield task()
        return
    pending: deque[tuple[Future[None], _Slot]] = deque()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pulsectl") as pool:
        try:
            for task in tasks:
                slot = _Slot()
                pending.append((pool.submit(_run_into, task, slot), slot))
                if len(pending) >= window:
                    yield _result(pending.popleft()[1])
            while pending:
                yield _result(pending.popleft()[1])
        finally:
            for future, _ in pending:
                future.cancel()


_END = object()
_PRODUCER_GRACE_S = 2.0


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def overlapped_map(
    tasks: Iterable[Callable[[], T]], workers: int, window: int | None = None
) -> Generator[T, None, None]:
    """Like ``ordered_map``, with ``tasks`` itself iterated on its own thread.

    For a task stream that does I/O (reading a patch from a pipe or a slow link): reading,
    decoding on the pool and the caller's writing all run at once, with at most ``window``
    tasks in flight. An error raised while producing tasks comes out in order, after the
    results of the tasks before it.

    The two threads meet only in ``SimpleQueue``s (C code: an interrupt cannot leave one half
    updated, see ``_Slot``): submitted tasks go one way, and room for the next (``window``
    tokens) comes back the other.
    """
    window = window or 2 * workers + 2
    submitted: SimpleQueue[Any] = SimpleQueue()
    room: SimpleQueue[None] = SimpleQueue()
    for _ in range(window):
        room.put(None)
    stopped: list[bool] = []  # non-empty once the consumer has stopped; read without a lock

    def produce(pool: ThreadPoolExecutor) -> None:
        try:
            for task in tasks:
                room.get()
                if stopped:
                    return
                slot = _Slot()
                submitted.put((pool.submit(_run_into, task, slot), slot))
        except BaseException as exc:  # handed to the consumer, in order
            submitted.put(_Failed(exc))
        finally:
            submitted.put(_END)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="pulsectl") as pool:
        producer = threading.Thread(
            target=produce, args=(pool,), name="pulsectl-reader", daemon=True
        )
        producer.start()
        try:
            while True:
                item = submitted.get()
                if item is _END:
                    break
                if isinstance(item, _Failed):
                    raise item.exc
                room.put(None)
                yield _result(item[1])
        finally:
            stopped.append(True)
            room.put(None)  # a producer waiting for room wakes up, and stops
            # Cancel what it had submitted. One blocked reading a stalled pipe is left behind
            # (a daemon): giving up after a moment keeps an error from waiting on the link.
            deadline = time.monotonic() + _PRODUCER_GRACE_S
            while producer.is_alive() and time.monotonic() < deadline:
                try:
                    item = submitted.get(timeout=0.05)
                except Empty:
                    continue
                if isinstance(item, tuple):
                    item[0].cancel()
            # Tasks not started are dropped; the caller's files stay open until those running
            # have finished (the pool's exit waits for them).
            pool.shutdown(wait=True, cancel_futures=True)
