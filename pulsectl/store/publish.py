"""publish: diff a checkpoint against the previously published step and add it to a store.

The publisher keeps its own copy of the last published step in a local cache folder, so
publishing never downloads anything: the patch is the diff of that copy against the new
checkpoint. Objects go up first (anchor files, patch), the step manifest last: a reader that
lists manifests never sees a half-published step. Nothing is ever rewritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pulsectl import __version__, _placed
from pulsectl._atomic import (
    atomic_file,
    install,
    interrupts_deferred,
    missing_folder,
    os_error,
    remove,
)
from pulsectl.checkpoint import Checkpoint
from pulsectl.diff import DiffOptions, diff_to_path
from pulsectl.errors import FormatError, InputError, OutputError, PulseError, UsageError
from pulsectl.hashing import fingerprint_file
from pulsectl.inventory import file_refs, fingerprint_of
from pulsectl.store.base import ObjectExistsError, Store, open_store
from pulsectl.store.catalog import Catalog
from pulsectl.store.layout import (
    MARKER_KEY,
    STEPS_PREFIX,
    STORE_SCHEMA,
    PatchRef,
    StepManifest,
    StoredFile,
    anchor_key,
    canonical_json,
    manifest_key,
    patch_key,
    step_of_manifest_key,
)

Log = Callable[[str], None]

from pulsectl._names import (  # noqa: E402  (constants the CLI reads without this module)
    CACHE_ENV,
    DEFAULT_ANCHOR_EVERY,
    DEFAULT_MAX_PATCH_FRACTION,
)

HEAD_STATE = "head.json"


@dataclass(frozen=True)
class PublishOptions:
    anchor_every: int = DEFAULT_ANCHOR_EVERY  # 0: anchors only when forced or patches get big
    max_patch_fraction: float = DEFAULT_MAX_PATCH_FRACTION
    cast: str | None = None  # "bf16": publish the cast (pulsectl.cast), as `diff --as` does
    anchor: bool = False  # force a full anchor at this step
    cache_dir: Path | None = None  # default: default_cache_dir(store)
    diff: DiffOptions = field(default_factory=DiffOptions)


@dataclass(frozen=True)
class PublishSummary:
    manifest: StepManifest
    reason: str  # why this step is an anchor, or "patch"
    uploaded_bytes: int
    cache_dir: Path
    # Set when the step was published but the cache's copy of it could not be kept (a full
    # disk): the next publish then uploads a full anchor.
    cache_problem: str | None = None
    # The step was there already, holding these weights (`publish --step N` run again after
    # a publish that was killed once its manifest was up): nothing was uploaded.
    already: bool = False


def default_cache_dir(store: Store) -> Path:
    """$PULSECTL_CACHE_DIR, else $XDG_CACHE_HOME/pulsectl, else ~/.cache/pulsectl; one folder
    per store under ``publish/``, named from the store's URL (absolute path for a folder)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "pulsectl"
    return base / "publish" / hashlib.sha256(os.fsencode(store.ident)).hexdigest()[:16]


def publish(
    store: Store | str | Path,
    checkpoint: str | Path,
    *,
    step: int | None = None,
    options: PublishOptions | None = None,
    log: Log | None = None,
) -> PublishSummary:
    """Publish ``checkpoint`` as ``step`` (default: the last published step + 1, or 0)."""
    options = options or PublishOptions()
    say = log or (lambda _msg: None)
    store = store if isinstance(store, Store) else open_store(store)
    if options.anchor_every < 0:
        raise UsageError(
            f"--anchor-every {options.anchor_every}: give 0 or more", option="--anchor-every"
        )
    if not 0 < options.max_patch_fraction <= 1:
        raise UsageError(
            f"--max-patch-fraction {options.max_patch_fraction}: give a value in (0, 1]",
            option="--max-patch-fraction",
        )
    if options.cast is not None:
        from pulsectl.cast import target_dtype

        target_dtype(options.cast, option="--as")
        # One spelling in the manifests: `--as BF16` and `--as bf16` are the same cast.
        options = dataclasses.replace(options, cast=options.cast.lower())
    source = Checkpoint.open(checkpoint)  # before the store folder is made: a bad input
    made = isinstance(store, _folder_type()) and _make_store_folder(Path(store.url))
    try:
        return _publish(store, checkpoint, step, options, say, source)
    except BaseException:
        if made:  # a first publish that failed before the store's marker: no empty folder left
            with contextlib.suppress(OSError):
                Path(store.url).rmdir()
        raise


def _publish(
    store: Store,
    checkpoint: str | Path,
    step: int | None,
    options: PublishOptions,
    say: Log,
    source: Checkpoint,
) -> PublishSummary:
    catalog = Catalog(store)
    last = catalog.latest()
    latest = catalog.latest_step
    damaged_last = latest is not None and (last is None or last.step != latest)
    if latest is not None and damaged_last and (step is None or step <= latest):
        # Removing it would let its number come back with other weights, which workers that
        # pulled it would take for the same step: the next number goes on past it instead.
        raise InputError(
            f"{store.where(manifest_key(latest))}: the last step's manifest is damaged "
            f"({catalog.damaged.get(latest)}); restore it from a copy, or publish with --step "
            f"{latest + 1} to go on past it (its number stays taken)"
        )
    if step is None:
        step = 0 if last is None else last.step + 1
    if step < 0:
        raise UsageError(f"--step {step}: give 0 or more", option="--step")
    again = False  # the same step again: fine only with the same weights (a retried publish)
    if last is not None:
        if step == last.step:
            again = True
        elif step < last.step:
            raise _immutable(step, last)
        if last.layout != source.layout:
            raise UsageError(
                f"{checkpoint} is a {_word(source.layout)}, but {store.url} holds "
                f"{_word(last.layout)}s"
            )
        if (last.cast or "").lower() != (options.cast or ""):
            want = f"--as {last.cast}" if last.cast else "no --as"
            raise UsageError(
                f"{store.url} holds {last.cast or 'uncast'} checkpoints; publish with {want}",
                option="--as",
            )

    cache = options.cache_dir or default_cache_dir(store)
    if isinstance(store, _folder_type()) and cache.resolve().is_relative_to(
        Path(store.url).resolve()
    ):
        raise UsageError(
            f"--cache {cache}: is inside the store {store.url}, whose objects are never "
            "rewritten (the cache is, at every publish): give a folder outside it",
            option="--cache",
        )
    work: Path | None = None
    try:
        # Made and known to the clean-up below before an interrupt can stop this function.
        with interrupts_deferred():
            try:
                cache.mkdir(parents=True, exist_ok=True)
                work = Path(tempfile.mkdtemp(prefix=".work-", dir=cache))
            except OSError as exc:
                raise os_error(exc, cache) from exc
        target = _snapshot(Path(checkpoint), source, work, options.cast)
        if again:
            assert last is not None
            held = fingerprint_of(Checkpoint.open(target))
            if held != last.target_fingerprint:
                raise _immutable(step, last, f" (it holds other weights: {held})")
            say(
                f"step {step} of {store.url} already holds {checkpoint} (fingerprint {held}); "
                "nothing was uploaded"
            )
            problem = None
            try:  # as after a publish: the next patch is made against this copy
                with interrupts_deferred():
                    _update_head(cache, store, last, target, work)
            except PulseError as exc:
                problem = (
                    f"the publish cache was not updated ({exc.message}); the next publish to "
                    f"{store.url} will upload a full anchor"
                )
            return PublishSummary(last, "already published", 0, cache, problem, already=True)
        manifest, reason, uploaded = _publish_step(
            store, catalog, last, step, target, work, cache, options, say
        )
        cache_problem = None
        try:
            with interrupts_deferred():  # a few renames: the cache names the step just made
                _update_head(cache, store, manifest, target, work)
        except PulseError as exc:  # the step is published all the same
            cache_problem = (
                f"the publish cache was not updated ({exc.message}); the next publish to "
                f"{store.url} will upload a full anchor"
            )
    finally:
        if work is not None:
            remove(work)
    return PublishSummary(manifest, reason, uploaded, cache, cache_problem)


def _immutable(step: int, last: StepManifest, why: str = "") -> UsageError:
    return UsageError(
        f"--step {step}: the store's last step is {last.step}{why}; steps are immutable, "
        f"publish a later step (default {last.step + 1})",
        option="--step",
    )


def _snapshot(checkpoint: Path, source: Checkpoint, work: Path, cast: str | None) -> Path:
    """A private copy of CKPT (or of its cast) in the work folder. The diff, the
    fingerprints, the upload and the cache's copy of the step all read it, so they agree even
    when a trainer rewrites CKPT meanwhile; and a cache without room for it fails the publish
    before anything is uploaded. The cache keeps this copy as the next patch's base (a rename
    at the end), so it costs no more than copying the step into the cache would."""
    before = _identity(source)
    target = work / (
        ("cast" if cast else "step") + (".safetensors" if source.layout == "file" else "")
    )
    if cast is not None:
        from pulsectl.cast import cast_checkpoint

        cast_checkpoint(checkpoint, target, to=cast)
    else:
        for entry in source.files:
            dest = target / entry.relpath if entry.relpath else target
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(entry.path, dest)
            except OSError as exc:
                cache = work.parent
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise OutputError(
                        f"{cache}: no space left for a copy of {checkpoint} (the publish cache "
                        "keeps one, the base of the next patch); nothing was published: free "
                        "some space, or give --cache a folder on another disk",
                        path=cache,
                    ) from exc
                if exc.errno == errno.EFBIG:  # the copy's write, whichever file it names
                    raise OutputError(
                        f"{cache}: cannot write a copy of {checkpoint} there: {exc.strerror} (a "
                        "file size limit?); nothing was published",
                        path=cache,
                    ) from exc
                if exc.errno != errno.EROFS and exc.filename == str(entry.path):
                    raise InputError(
                        f"{entry.path}: cannot read: {exc.strerror}", path=entry.path
                    ) from exc
                raise os_error(exc, cache) from exc
    try:
        after = _identity(Checkpoint.open(checkpoint))
    except InputError:
        after = None
    if after != before:
        raise InputError(
            f"{checkpoint}: changed while publish was reading it (is a trainer still writing "
            "it?); nothing was published: publish it again once it is written",
            path=checkpoint,
        )
    return target


def _identity(source: Checkpoint) -> list[tuple[str, int, int, int, int, int]]:
    """Each file's name, device, inode, size and modification and change times: a rewrite in
    place or a file renamed over it changes one of them."""
    found = []
    for entry in source.files:
        try:
            st = os.stat(entry.path)
        except OSError:
            return []
        found.append(
            (entry.relpath, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        )
    return found


def _publish_step(
    store: Store,
    catalog: Catalog,
    last: StepManifest | None,
    step: int,
    target: Path,
    work: Path,
    cache: Path,
    options: PublishOptions,
    say: Log,
) -> tuple[StepManifest, str, int]:
    layout = Checkpoint.open(target).layout
    head = _load_head(cache, store)
    k = options.anchor_every

    anchor_reason: str | None = None
    if last is None:
        anchor_reason = "the first step of the store"
    elif options.anchor:
        anchor_reason = "an anchor was asked for"
    elif head is None or head[0] != last.step or head[1] != last.target_fingerprint:
        anchor_reason = (
            f"the publish cache {cache} does not hold step {last.step} (publishing never "
            "downloads), so this step is a full anchor"
        )
    elif k and step // k > last.anchor_step // k:
        anchor_reason = f"--anchor-every {k}"
    elif k and last.chain_length + 1 > k:
        anchor_reason = f"the chain since anchor {last.anchor_step} would be longer than {k}"

    patch: PatchRef | None = None
    patch_file = work / "step.pulse"
    target_fp: str | None = None
    target_bytes = 0
    if last is not None and head is not None and head[:2] == (last.step, last.target_fingerprint):
        summary = None
        try:
            with _placed.unrecorded():  # a work file, uploaded below
                summary = diff_to_path(
                    head[2], target, patch_file, force=True, options=options.diff
                )
        except (InputError, FormatError) as exc:
            if exc.path is None or not Path(exc.path).resolve().is_relative_to(cache.resolve()):
                raise  # CKPT's own problem
            # The cache's copy is damaged (cut short, say): an anchor, which also replaces it;
            # every publish would fail on it otherwise.
            anchor_reason = (
                f"the publish cache's copy of step {last.step} cannot be read "
                f"({exc.message.removeprefix(f'{exc.path}: ')})"
            )
        fraction = (
            summary.patch_bytes / summary.target_bytes if summary and summary.target_bytes else 0
        )
        if summary is None:
            pass
        elif summary.base_fingerprint != last.target_fingerprint:
            anchor_reason = anchor_reason or (
                f"the publish cache's copy of step {last.step} has fingerprint "
                f"{summary.base_fingerprint}, not {last.target_fingerprint}"
            )
        elif fraction > options.max_patch_fraction:
            anchor_reason = (
                f"the patch ({summary.patch_bytes:,} bytes) is {fraction:.1%} of the checkpoint, "
                f"over --max-patch-fraction {options.max_patch_fraction}"
            )
        else:
            target_fp, target_bytes = summary.target_fingerprint, summary.target_bytes
            own = fingerprint_file(patch_file)
            patch = PatchRef(
                StoredFile(patch_key(step, target_fp, own), "", summary.patch_bytes, own),
                last.step,
                last.target_fingerprint,
                summary.changed_words,
                summary.total_words,
            )

    anchor: tuple[StoredFile, ...] | None = None
    if anchor_reason is not None:
        ckpt = Checkpoint.open(target)
        refs = file_refs(ckpt)
        target_fp = fingerprint_of(ckpt, refs)
        target_bytes = sum(r.size for r in refs)
        anchor = tuple(
            StoredFile(anchor_key(step, target_fp, layout, r.path), r.path, r.size, r.fingerprint)
            for r in refs
        )
    assert target_fp is not None
    if patch is not None and patch.key != patch_key(step, target_fp, patch.file.fingerprint):
        raise AssertionError("patch target differs from anchor target")

    manifest = StepManifest(
        step=step,
        layout=layout,
        target_fingerprint=target_fp,
        target_bytes=target_bytes,
        anchor=anchor,
        patch=patch,
        anchor_step=step if anchor is not None else (last.anchor_step if last else step),
        chain_length=0 if anchor is not None else (last.chain_length + 1 if last else 0),
        cast=options.cast,
        writer=f"pulsectl {__version__}",
        published=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )

    uploaded = 0
    # An interrupt from here on may leave objects in the store, but no step: say so.
    _placed.done(
        f"before step {step} was published to {store.url} (objects uploaded so far are left "
        "for prune)"
    )
    if not catalog.steps and not store.exists(MARKER_KEY):
        store.write(
            MARKER_KEY, canonical_json({"format": "pulsectl-store", "schema": STORE_SCHEMA})
        )
    if anchor is not None:
        entries = {e.relpath: e.path for e in Checkpoint.open(target).files}
        for f in anchor:
            store.upload(entries[f.path], f.key)
            uploaded += f.size
    if patch is not None:
        store.upload(patch_file, patch.key)
        uploaded += patch.size
    data = manifest.to_bytes()
    # Another publisher that made a later step meanwhile (one publisher per store is the rule):
    # this step would come after it, its objects counted as orphans by a prune, which may be
    # deleting them already. Its objects are left for prune; the store is as the other made it.
    later = [
        n
        for n in (step_of_manifest_key(k) for k in store.list(STEPS_PREFIX))
        if n is not None and n > step
    ]
    if later:
        raise ObjectExistsError(
            f"{store.where(manifest_key(max(later)))}: step {max(later)} was published by "
            f"another publisher meanwhile (one publisher per store); step {step} would come "
            "after it: not published, its objects are left for prune",
            path=store.where(manifest_key(max(later))),
        )
    # An interrupt can come while the manifest is on its way: whether it landed, only the
    # store knows.
    _placed.done(
        f"while step {step} was being published to {store.url}; `pulsectl log {store.url}` "
        "shows whether it was"
    )
    try:
        store.create(manifest_key(step), data)  # last: the step exists from here on
    except ObjectExistsError:
        # The manifest there may be this run's own: an S3 client retries a PUT whose reply
        # was lost, and the retry finds the object the first attempt made. The manifest names
        # the time and the writer, so another publisher's manifest is not these bytes.
        try:
            ours = store.read(manifest_key(step)) == data
        except PulseError:
            ours = False
        if not ours:
            raise ObjectExistsError(
                f"{store.where(manifest_key(step))}: step {step} was published by another "
                "publisher meanwhile (one publisher per store); this step is not published: its "
                "objects are left for prune",
                path=store.where(manifest_key(step)),
            ) from None
    _placed.done(f"after step {step} was published to {store.url}")
    say(
        f"published step {step} to {store.url}: "
        + (
            f"anchor ({anchor_reason})"
            if anchor is not None
            else f"patch {patch.size:,} bytes"
            if patch
            else ""
        )
        + (
            f" and patch from step {patch.base_step}"
            if anchor is not None and patch is not None
            else ""
        )
    )
    return manifest, anchor_reason or "patch", uploaded + len(data)


def _make_store_folder(root: Path) -> bool:
    """The store folder, made by the first publish as ``mkdir`` would (its parent must exist:
    a mistyped path is not made). An existing folder must be a store already, or empty: a
    folder of other files (the checkpoints' own folder, say) is most likely a mistyped STORE."""
    if root.exists():
        if not root.is_dir():
            raise InputError(
                f"{root}: is a file, not a store folder; give a folder path", path=root
            )
        if (root / MARKER_KEY).exists() or (root / STEPS_PREFIX).is_dir():
            return False
        try:
            names = sorted(n for n in os.listdir(root) if not n.startswith("."))
        except OSError as exc:
            raise InputError(f"{root}: cannot list: {exc.strerror}", path=root) from None
        if names:
            raise InputError(
                f"{root}: is not a pulsectl store (no {MARKER_KEY}) and holds other files "
                f"({names[0]!r}...); publish to a new or empty folder",
                path=root,
            )
        return False
    if not root.parent.is_dir():
        raise missing_folder(root)
    try:
        root.mkdir()
    except OSError as exc:
        raise os_error(exc, root) from exc
    return True


def _load_head(cache: Path, store: Store) -> tuple[int, str, Path] | None:
    """(step, fingerprint, path) of the cached copy of the last published step, if any."""
    try:
        state = json.loads((cache / HEAD_STATE).read_text())
        path = cache / state["path"]
        if state["store"] != store.ident or not path.exists():
            return None
        return int(state["step"]), str(state["fingerprint"]), path
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def _update_head(
    cache: Path, store: Store, manifest: StepManifest, target: Path, work: Path
) -> None:
    """Keep a copy of what was just published: the base of the next patch."""
    name = "head.safetensors" if manifest.layout == "file" else "head"
    fresh = work / ("head-new" + (".safetensors" if manifest.layout == "file" else ""))
    try:
        os.replace(target, fresh)  # the snapshot (see _snapshot), in the same folder
        (cache / HEAD_STATE).unlink(missing_ok=True)  # no state names a half-replaced copy
        for stale in ("head.safetensors", "head"):
            if stale != name:
                remove(cache / stale)
        with _placed.unrecorded():  # the cache is pulsectl's, not an output the user named
            install(fresh, cache / name)
        state = {
            "store": store.ident,
            "step": manifest.step,
            "fingerprint": manifest.target_fingerprint,
            "path": name,
        }
        with _placed.unrecorded(), atomic_file(cache / HEAD_STATE, force=True) as f:
            f.write(canonical_json(state))
    except OSError as exc:
        raise os_error(exc, cache / name) from exc


def _word(layout: str) -> str:
    return "single file" if layout == "file" else "checkpoint folder"


def _folder_type() -> type:
    from pulsectl.store.folder import FolderStore

    return FolderStore
