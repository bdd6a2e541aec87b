"""pull: rebuild a published step from the nearest verified starting point.

plan: walk back from the target step along its patches to a local copy of a step (the output
  itself when it is one) or an anchor, whichever costs the fewest bytes to fetch
  -> a fetch thread downloads (and checks the fingerprint of) object i+1 while patch i applies
  -> on a missing or damaged object: mark it broken, plan again from the furthest step reached
  -> the final fingerprint checked against the manifest -> renamed onto the output
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from pulsectl import _placed
from pulsectl._atomic import (
    TEMP_MARK,
    check_folder_target,
    check_target,
    file_path,
    install,
    interrupts_deferred,
    is_empty_folder,
    missing_folder,
    naming_output,
    os_error,
    remove,
    temp_prefix,
)
from pulsectl.apply import apply_patches
from pulsectl.checkpoint import Checkpoint, folder_files
from pulsectl.errors import InputError, IntegrityError, OutputError, UsageError, counted
from pulsectl.hashing import checkpoint_fingerprint
from pulsectl.inventory import fingerprint_of
from pulsectl.store.base import (
    MissingObjectError,
    StepUnreachableError,
    Store,
    fetch_verified,
    open_store,
)
from pulsectl.store.catalog import Catalog
from pulsectl.store.layout import StepManifest, StoredFile, manifest_key

Log = Callable[[str], None]

from pulsectl._names import DEFAULT_PREFETCH  # noqa: E402  (the CLI reads it without this module)


@dataclass(frozen=True)
class PullSummary:
    output: Path
    step: int
    fingerprint: str
    start: str  # where the rebuild started, in words
    patches: int  # patches applied
    fetched_bytes: int
    problems: tuple[str, ...]  # damaged or missing objects met and worked around


@dataclass(frozen=True)
class _Plan:
    start: StepManifest
    local: Path | None  # a local copy of ``start``, or None to fetch its anchor
    patches: list[StepManifest]  # steps whose patches apply in order after ``start``
    cost: int  # bytes to fetch


class _Broken(Exception):
    """An object failed; ``reached`` is a verified local copy of the furthest step so far."""

    def __init__(self, key: str, reason: str, reached: tuple[str, Path] | None = None) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason
        self.reached = reached


def pull(
    store: Store | str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    force: bool = False,
    workers: int | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    log: Log | None = None,
    durable: bool = False,
) -> PullSummary:
    """Write step ``step`` (default: the latest) of ``store`` to ``out``, verified, atomically.

    When ``out`` already holds a step of the store, the rebuild starts from it. An existing
    ``out`` that is not a step of the store is replaced only with ``force``.
    """
    say = log or (lambda _msg: None)
    # A folder store's own folder must not be inside the folder that the result replaces.
    inputs = [Path(store)] if isinstance(store, (str, Path)) and "://" not in str(store) else []
    store = store if isinstance(store, Store) else open_store(store)
    given, out = out, Path(out)  # 'runs/' with a trailing '/': a folder checkpoint only
    check_target(out, force=True)  # '-', a device or pipe, or a missing folder: refused
    check_folder_target(out, inputs)
    for root in inputs:  # a folder store's objects are never rewritten, by pull least of all
        if root.is_dir() and out.resolve().is_relative_to(root.resolve()):
            raise UsageError(
                f"{out}: is inside the store {root}, whose objects are never rewritten; write "
                "the checkpoint outside it"
            )
    if prefetch < 1:
        raise InputError(f"prefetch {prefetch}: give 1 or more")
    catalog = Catalog(store)
    catalog.require_store()
    target = _target(catalog, store, step)
    if target.layout == "file":
        file_path(given, "pulled checkpoint")
    if target.layout == "file" and out.is_dir():
        raise OutputError(
            f"{out}: is a folder, and step {target.step} of {store.url} is a single file; give "
            "the file's path (-o FOLDER/model.safetensors)",
            path=out,
        )
    skipped = [s for s in catalog.steps if s > target.step]
    if step is None and skipped:
        # The latest readable step is not the latest listed one: say so, never quietly.
        say(
            f"{store.where(manifest_key(skipped[-1]))}: the manifest of step {skipped[-1]} "
            f"is damaged ({catalog.damaged.get(skipped[-1], 'unreadable')}); step "
            f"{target.step} is the latest that can be pulled"
        )

    locals_: dict[str, Path] = {}
    local_fp: str | None = None
    # An empty folder is taken as OUT as if absent (as apply does).
    present = out.exists() and not (out.is_dir() and is_empty_folder(out))
    if present:
        try:
            local_fp = fingerprint_of(Checkpoint.open(out))
            locals_[local_fp] = out
        except InputError:
            if not force:
                raise OutputError(
                    f"{out}: exists and is not a checkpoint; pass -f to replace it", path=out
                ) from None
    if not out.parent.is_dir():
        raise missing_folder(out)
    if local_fp == target.target_fingerprint:
        say(f"{out} is already step {target.step}")
        return PullSummary(out, target.step, local_fp, f"already at step {target.step}", 0, 0, ())

    broken: dict[str, str] = {}
    plan, why = _plan(catalog, target, locals_, broken)
    if present and not force and (plan is None or plan.local != out):
        known = catalog.find_fingerprint(local_fp) if local_fp else None
        if known is None:
            damaged = sorted(catalog.damaged)
            maybe = (
                f" (or of a step whose manifest is damaged: {', '.join(map(str, damaged))})"
                if damaged
                else ""
            )
            raise OutputError(
                f"{out}: exists and is not a step of {store.url}{maybe} (fingerprint "
                f"{local_fp}: another checkpoint, or a step pruned since); pass -f to replace "
                "it",
                path=out,
            )

    work: Path | None = None
    fetched = [0]
    # A full disk while fetching or rebuilding names a temp of the work folder, removed by
    # then: OUT is what the user knows.
    with naming_output(out):
        try:
            # Made and known to the clean-up below before an interrupt can stop this function.
            with interrupts_deferred():
                try:
                    prefix = temp_prefix(out.name, f"{TEMP_MARK}pull-")
                    work = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
                except OSError as exc:
                    raise os_error(exc, out) from exc
            while True:
                if plan is None:
                    raise _unreachable(store, target, broken, why)
                say(_describe(plan, out))
                try:
                    with _placed.unrecorded():  # steps in the work folder: not the output
                        result, applied = _execute(
                            store, plan, target, work, workers, prefetch, fetched
                        )
                    break
                except _Broken as exc:
                    broken[exc.key] = exc.reason
                    say(f"{exc.reason}; looking for another way to step {target.step}")
                    if exc.reached is not None:
                        locals_[exc.reached[0]] = exc.reached[1]
                    locals_ = {fp: p for fp, p in locals_.items() if p.exists()}
                    plan, why = _plan(catalog, target, locals_, broken)
            if not result.is_relative_to(work):  # an anchor used in place (folder store)
                copy = work / ("result" + ("" if result.is_dir() else ".safetensors"))
                _copy(result, copy)
                result = copy
            actual = fingerprint_of(Checkpoint.open(result))
            if actual != target.target_fingerprint:
                raise IntegrityError(
                    f"{store.where(manifest_key(target.step))}: rebuilt step {target.step} has "
                    f"fingerprint {actual}, not {target.target_fingerprint}; nothing was written",
                    expected=target.target_fingerprint,
                    actual=actual,
                )
            try:
                if durable:  # --fsync: on disk before the rename, as apply --fsync does
                    _fsync_tree(result)
                install(result, out)
            except OSError as exc:
                raise os_error(exc, out) from exc
        finally:
            if work is not None:
                remove(work)
    start = (
        f"local copy of step {plan.start.step}"
        if plan.local
        else f"anchor of step {plan.start.step}"
    )
    return PullSummary(
        out,
        target.step,
        target.target_fingerprint,
        start,
        applied,
        fetched[0],
        tuple(broken.values()),
    )


def _target(catalog: Catalog, store: Store, step: int | None) -> StepManifest:
    if step is None:
        latest = catalog.latest()
        if latest is None:
            raise InputError(f"{store.url}: no published step (is it a pulsectl store?)")
        return latest
    manifest = catalog.get(step)
    if manifest is None:
        if step in catalog.damaged:
            raise IntegrityError(
                f"step {step}: {catalog.damaged[step]}", path=store.where(manifest_key(step))
            )
        held = ""
        if catalog.steps:
            steps = catalog.steps
            shown = ", ".join(map(str, steps))
            if len(steps) > 6:
                shown = f"{steps[0]}, {steps[1]} ... {steps[-2]}, {steps[-1]} ({len(steps)} steps)"
            held = f"; it holds steps {shown}"
        raise MissingObjectError(
            f"{store.url}: step {step} is not in the store (not published yet, or pruned){held}",
            path=store.where(manifest_key(step)),
        )
    return manifest


def _plan(
    catalog: Catalog, target: StepManifest, locals_: dict[str, Path], broken: dict[str, str]
) -> tuple[_Plan | None, str]:
    """The cheapest start (local copy or anchor) and the patches after it; else why not."""
    best: _Plan | None = None
    cost = 0
    chain: list[StepManifest] = []
    node = target
    while True:
        local = locals_.get(node.target_fingerprint)
        if local is not None and (best is None or cost < best.cost):
            return _Plan(node, local, chain[::-1], cost), ""
        if node.anchor is not None and not any(f.key in broken for f in node.anchor):
            anchor_cost = cost + node.anchor_bytes
            if best is None or anchor_cost < best.cost:
                best = _Plan(node, None, chain[::-1], anchor_cost)
        if best is not None and cost >= best.cost:
            return best, ""
        patch = node.patch
        if patch is None:
            return best, f"step {node.step} has no patch and its anchor is unusable"
        if patch.key in broken:
            return best, f"the patch of step {node.step} is unusable"
        prev = catalog.get(patch.base_step)
        if prev is None or prev.target_fingerprint != patch.base_fingerprint:
            return best, (
                f"the manifest of step {patch.base_step}, the base of step {node.step}, is "
                + ("missing or damaged" if prev is None else "for a different checkpoint")
            )
        cost += patch.size
        chain.append(node)
        node = prev


class _Prefetcher:
    """Fetch (and verify) objects in order on a thread, at most ``depth`` ahead of the reader."""

    def __init__(self, store: Store, jobs: list[list[tuple[StoredFile, Path]]], depth: int) -> None:
        self.store = store
        self.jobs = jobs
        self.queue: queue.Queue[tuple[list[Path] | None, BaseException | None]] = queue.Queue(depth)
        self.stop = threading.Event()
        self.fetched = 0
        self.thread = threading.Thread(target=self._run, name="pulsectl-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for job in self.jobs:
            if self.stop.is_set():
                return
            try:
                paths = [fetch_verified(self.store, f, dest) for f, dest in job]
                self.fetched += sum(f.size for f, _ in job)
                item: tuple[list[Path] | None, BaseException | None] = (paths, None)
            except BaseException as exc:  # handed to the reader, which decides
                item = (None, exc)
            while not self.stop.is_set():
                try:
                    self.queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return

    def get(self) -> tuple[list[Path] | None, BaseException | None]:
        while True:
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    raise RuntimeError("prefetch thread ended early") from None

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _execute(
    store: Store,
    plan: _Plan,
    target: StepManifest,
    work: Path,
    workers: int | None,
    prefetch: int,
    fetched: list[int],
) -> tuple[Path, int]:
    suffix = ".safetensors" if target.layout == "file" else ""
    jobs: list[list[tuple[StoredFile, Path]]] = []
    if plan.local is None:
        assert plan.start.anchor is not None
        folder = work / f"anchor-{plan.start.step}"
        jobs.append(
            [
                (
                    f,
                    folder / PurePosixPath(f.path)
                    if f.path
                    else folder.with_suffix(".safetensors"),
                )
                for f in plan.start.anchor
            ]
        )
    for m in plan.patches:
        assert m.patch is not None
        jobs.append([(m.patch.file, work / f"patch-{m.step}.pulse")])

    fetcher = _Prefetcher(store, jobs, prefetch)
    try:
        if plan.local is None:
            anchor = plan.start.anchor
            assert anchor is not None
            paths, err = fetcher.get()
            if err is not None:
                raise _broken(anchor[0].key, err)
            assert paths is not None
            listed = checkpoint_fingerprint(
                plan.start.layout, ((f.path, f.size, f.fingerprint) for f in anchor)
            )
            if listed != plan.start.target_fingerprint:
                raise _Broken(
                    anchor[0].key,
                    f"step {plan.start.step}: anchor files do not match the manifest's fingerprint",
                )
            first = anchor[0]
            current = (
                paths[0]
                if not first.path
                else paths[0].parents[len(PurePosixPath(first.path).parts) - 1]
            )
            if first.path:
                # A folder store's anchor folder is read in place: a file its manifest does not
                # list would become part of the checkpoint (and every patch after it would
                # refuse it as a base). Name the anchor, not the patches.
                in_manifest = {f.path for f in anchor}
                try:
                    extra = [rel for rel, _ in folder_files(current) if rel not in in_manifest]
                except InputError as exc:
                    raise _Broken(first.key, f"step {plan.start.step}: {exc.message}") from exc
                if extra:
                    raise _Broken(
                        first.key,
                        f"step {plan.start.step}: its anchor folder {current} holds "
                        f"{extra[0]!r}, which its manifest does not list",
                    )
        else:
            current = plan.local
        current_fp = plan.start.target_fingerprint
        for m in plan.patches:
            assert m.patch is not None
            paths, err = fetcher.get()
            if err is not None:
                raise _broken(m.patch.key, err, (current_fp, current))
            assert paths is not None
            nxt = work / f"step-{m.step}{suffix}"
            try:
                apply_patches(current, [paths[0]], nxt, force=True, workers=workers)
            except (IntegrityError, InputError) as exc:
                # A folder store's objects are read where they lie: one deleted since it was
                # checked (a prune, an `rsync --delete-after` of the mirror) is gone from the
                # store, as if it had never been there.
                anchor_in_place = plan.local is None and not current.is_relative_to(work)
                if anchor_in_place and plan.start.anchor:
                    gone = [
                        f.key
                        for f in plan.start.anchor
                        if not (current / PurePosixPath(f.path) if f.path else current).exists()
                    ]
                    if gone:
                        raise _Broken(gone[0], f"{store.where(gone[0])}: {_GONE}") from None
                if not paths[0].exists():
                    raise _Broken(
                        m.patch.key, f"{store.where(m.patch.key)}: {_GONE}", (current_fp, current)
                    ) from None
                if isinstance(exc, InputError):
                    raise
                raise _broken(m.patch.key, exc, (current_fp, current)) from None
            finally:
                if paths[0].is_relative_to(work):
                    remove(paths[0])
            if current.is_relative_to(work):
                remove(current)
            current, current_fp = nxt, m.target_fingerprint
        return current, len(plan.patches)
    finally:
        fetcher.close()
        fetched[0] += fetcher.fetched


_GONE = "deleted from the store while pull was reading it (a prune meanwhile?)"


def _broken(key: str, err: BaseException, reached: tuple[str, Path] | None = None) -> BaseException:
    """A damaged or missing object becomes ``_Broken`` (try another path); anything else
    (no credentials, no space, a bug) is raised as it is."""
    if isinstance(err, (IntegrityError, MissingObjectError)):
        return _Broken(key, str(err), reached)
    return err


def _unreachable(
    store: Store, target: StepManifest, broken: dict[str, str], why: str
) -> StepUnreachableError:
    problems = "; ".join(broken.values())
    return StepUnreachableError(
        f"{store.url}: step {target.step} is unreachable: "
        + (f"{problems}; " if problems else "")
        + f"{why or 'no usable anchor or patch chain'}, and no anchor after it up to step "
        f"{target.step}; pull another step (--step) or publish a new anchor (publish --anchor)",
        path=store.where(manifest_key(target.step)),
    )


def _describe(plan: _Plan, out: Path) -> str:
    last = plan.patches[-1].step if plan.patches else plan.start.step
    start = (
        f"{plan.local} (step {plan.start.step})"
        if plan.local
        else f"the anchor of step {plan.start.step}"
    )
    patches = counted(len(plan.patches), "patch", "patches")
    return f"step {last}: from {start}, {patches}, {plan.cost:,} bytes to fetch"


def _copy(src: Path, dst: Path) -> None:
    try:
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copyfile(src, dst)
    except OSError as exc:
        raise os_error(exc, dst) from exc


def _fsync_tree(path: Path) -> None:
    """fsync a file, or every file of a folder and the folders themselves."""
    paths = [path] if path.is_file() else [path, *sorted(path.rglob("*"))]
    for item in paths:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
