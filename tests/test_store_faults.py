"""Stores when things go wrong: a full cache, a checkpoint rewritten while it is published, a
lost reply to the manifest's upload, an interrupt after the step exists, mistyped store paths,
and the temp folders a kill -9 leaves."""

from __future__ import annotations

import errno
import fnmatch
import importlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from _faultkit import tmpfs
from conftest import TEMP_GLOB

from pulsectl.cli.app import main
from pulsectl.diff import DiffOptions
from pulsectl.errors import InputError, OutputError
from pulsectl.store import PublishOptions, publish, pull, read_log
from pulsectl.store.base import ObjectExistsError
from pulsectl.store.folder import FolderStore
from pulsectl.store.layout import manifest_key
from pulsectl.store.prune import prune as prune_store
from pulsectl.synth import generate_chain

# The package's `publish` is the function; the module is patched in some tests.
publish_module = importlib.import_module("pulsectl.store.publish")


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return generate_chain(tmp_path_factory.mktemp("faults"), "tiny", steps=4, lr=3e-6, seed=7)


def steps_of(store: Path) -> list[tuple[int, str, str]]:
    return [(s["step"], s["kind"], s["target_fingerprint"]) for s in read_log(store)["steps"]]


def test_a_full_cache_fails_the_publish_before_anything_is_uploaded(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cache needs a copy of the checkpoint. That copy is made first, so a cache without
    room for it fails the run while nothing is published, and a retry cannot publish the same
    weights twice."""
    store = tmp_path / "store"
    size = chain[0].stat().st_size
    with tmpfs(tmp_path / "cache", f"{size * 3 // 2 // 1024}k") as cache:
        assert main(["publish", str(store), str(chain[0]), "--cache", str(cache)]) == 0
        capsys.readouterr()
        for _ in range(2):  # the trainer retries
            assert main(["publish", str(store), str(chain[1]), "--cache", str(cache)]) == 1
            out, err = capsys.readouterr()
            assert out == ""
            assert err.startswith(f"pulsectl: error: {cache}: no space left for a copy of")
            assert "nothing was published" in err
            assert [s[0] for s in steps_of(store)] == [0]
            assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
        # The cache still holds step 0: the next publish with room is a patch against it.
        head = publish_module._load_head(cache, FolderStore(store))
        assert head is not None and head[0] == 0


def test_a_checkpoint_rewritten_while_publishing_is_refused(
    chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer that writes the checkpoint in place while publish copies it: the copy may
    mix two versions, so nothing is published; every published step stays pullable."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    ckpt = tmp_path / "ckpt.safetensors"
    shutil.copyfile(chain[0], ckpt)
    publish(store, ckpt, options=PublishOptions(cache_dir=cache))
    real = shutil.copyfile

    def copy_then_rewrite(src: object, dst: object, **kw: object) -> object:
        done = real(src, dst, **kw)  # type: ignore[arg-type]
        with open(ckpt, "r+b") as f:  # the trainer's next write lands in place
            f.seek(-2, os.SEEK_END)
            f.write(b"\x01\x02")
        return done

    shutil.copyfile(chain[1], ckpt)
    monkeypatch.setattr(publish_module.shutil, "copyfile", copy_then_rewrite)
    with pytest.raises(InputError, match="changed while publish was reading it"):
        publish(store, ckpt, options=PublishOptions(cache_dir=cache))
    monkeypatch.setattr(publish_module.shutil, "copyfile", real)
    assert [s[0] for s in steps_of(store)] == [0]
    assert not list(store.rglob("*.pulse"))  # no patch went up either
    # Once written, it publishes, as a patch against the cached step 0, and pulls exactly.
    summary = publish(store, ckpt, options=PublishOptions(cache_dir=cache))
    assert summary.manifest.kind == "patch"
    out = tmp_path / "w.safetensors"
    pull(store, out)
    assert out.read_bytes() == ckpt.read_bytes()


def test_a_lost_reply_to_the_manifest_upload_is_not_a_lost_race(
    chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that retries a create whose reply was lost finds its own manifest there: the
    step is published, and said to be. Another publisher's manifest is still refused."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    real = FolderStore.create

    def create_then_lose_the_reply(self: FolderStore, key: str, data: bytes) -> None:
        real(self, key, data)
        real(self, key, data)  # the retry: refused, as the object is there

    monkeypatch.setattr(FolderStore, "create", create_then_lose_the_reply)
    summary = publish(store, chain[0], options=PublishOptions(cache_dir=cache))
    assert steps_of(store) == [(0, "anchor", summary.manifest.target_fingerprint)]
    summary = publish(store, chain[1], options=PublishOptions(cache_dir=cache))
    assert summary.manifest.kind == "patch"  # the cache was kept: step 0 counted as done

    def someone_else_was_first(self: FolderStore, key: str, data: bytes) -> None:
        real(self, key, data.replace(b'"writer"', b'"writer" ', 1))  # other bytes
        real(self, key, data)

    monkeypatch.setattr(FolderStore, "create", someone_else_was_first)
    with pytest.raises(ObjectExistsError, match="published by another publisher"):
        publish(store, chain[2], options=PublishOptions(cache_dir=cache))


def test_a_cache_that_cannot_be_updated_after_the_step_is_a_warning(
    chain: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Once the manifest is up, the step exists: a failure to keep the cache's copy is a
    warning (the next publish is an anchor), not an error that invites publishing again."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    args = ["--cache", str(cache)]
    assert main(["publish", str(store), str(chain[0]), *args]) == 0

    def full(tmp: Path, path: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(publish_module, "install", full)
    capsys.readouterr()
    assert main(["publish", str(store), str(chain[1]), *args]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("1 patch ")
    assert "pulsectl: warning: the publish cache was not updated (" in err
    assert "no space left on device" in err and "will upload a full anchor" in err
    monkeypatch.undo()
    assert main(["publish", str(store), str(chain[2]), *args]) == 0
    assert [s[1] for s in steps_of(store)] == ["anchor", "patch", "anchor"]
    assert not [p for p in cache.iterdir() if p.name.startswith(".work-")]


def test_an_interrupt_after_the_step_exists_says_so(
    chain: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGINT while the cache is being updated waits for the update to end; the message says
    that the step was published, and the cache holds it."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    args = ["--cache", str(cache)]
    assert main(["publish", str(store), str(chain[0]), *args]) == 0
    real = publish_module._update_head

    def interrupted(*a: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(publish_module, "_update_head", interrupted)
    capsys.readouterr()
    assert main(["publish", str(store), str(chain[1]), *args]) == 130
    err = capsys.readouterr().err
    assert err.endswith(f"\npulsectl: error: interrupted after step 1 was published to {store}\n")
    monkeypatch.undo()
    assert main(["publish", str(store), str(chain[2]), *args]) == 0
    assert [s[1] for s in steps_of(store)] == ["anchor", "patch", "patch"]

    def interrupted_create(self: FolderStore, key: str, data: bytes) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(FolderStore, "create", interrupted_create)
    capsys.readouterr()
    assert main(["publish", str(store), str(chain[3]), *args]) == 130
    assert capsys.readouterr().err == (
        f"pulsectl: error: interrupted while step 3 was being published to {store}; "
        f"`pulsectl log {store}` shows whether it was\n"
    )
    # While the objects go up: it said "no output was written", with an anchor in the store.
    real_upload = FolderStore.upload

    def interrupted_upload(self: FolderStore, source: Path, key: str) -> None:
        real_upload(self, source, key)
        raise KeyboardInterrupt

    monkeypatch.undo()
    monkeypatch.setattr(FolderStore, "upload", interrupted_upload)
    assert main(["publish", str(store), str(chain[3]), *args, "--anchor"]) == 130
    assert capsys.readouterr().err == (
        f"pulsectl: error: interrupted before step 3 was published to {store} (objects "
        "uploaded so far are left for prune)\n"
    )
    assert [s[0] for s in steps_of(store)] == [0, 1, 2]


def test_publish_makes_only_the_store_folder_and_only_of_a_store(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first publish makes the store folder, not its parents (a mistyped path stays an
    error), and refuses a folder of other files (the checkpoints' own folder, say)."""
    cache = ["--cache", str(tmp_path / "cache")]
    deep = tmp_path / "no" / "such" / "store"
    assert main(["publish", str(deep), str(chain[0]), *cache]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pulsectl: error: {deep}: folder {deep.parent} does not exist")
    assert not (tmp_path / "no").exists()
    assert main(["publish", str(chain[0].parent), str(chain[0]), *cache]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pulsectl: error: {chain[0].parent}: is not a pulsectl store")
    assert not (chain[0].parent / "pulse-store.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["publish", str(empty), str(chain[0]), *cache]) == 0
    assert main(["publish", str(empty), str(chain[1]), *cache]) == 0
    assert [s[0] for s in steps_of(empty)] == [0, 1]


def test_log_and_prune_of_something_that_is_not_a_store(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped store path is an error for log and prune, as it is for pull, not an empty
    store that a monitoring script would take for a healthy one."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, chain[0].parent):
        for args in (
            ["log"],
            ["prune", "--keep-anchors", "1", "--keep-steps", "1"],
            ["pull", "-o", "x"],
        ):
            assert main([*args[:1], str(folder), *args[1:]]) == 1
            err = capsys.readouterr().err
            assert err == (
                f"pulsectl: error: {folder}: not a pulsectl store (no pulse-store.json and no "
                "published step); check the path\n"
            )
    # A store whose first publish failed before step 0 has the marker: empty, not an error.
    (empty / "pulse-store.json").write_text("{}")
    assert main(["log", str(empty), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == []


def test_a_mistyped_cast_in_a_manifest_is_a_damaged_step(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, cache = tmp_path / "store", tmp_path / "cache"
    publish(store, chain[0], options=PublishOptions(cache_dir=cache))
    path = store / manifest_key(0)
    doc = json.loads(path.read_text())
    doc["cast"] = 1
    path.write_text(json.dumps(doc))
    assert read_log(store)["steps"][0]["error"].endswith("cast is 1, not a dtype name or null")
    assert main(["publish", str(store), str(chain[1]), "--cache", str(cache)]) == 1
    err = capsys.readouterr().err
    assert "the last step's manifest is damaged (" in err
    assert err.endswith(
        "restore it from a copy, or publish with --step 1 to go on past it (its number stays "
        "taken)\n"
    )


def test_a_damaged_last_manifest_keeps_its_number(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """publish said to remove a damaged last manifest; its number could then come back with
    other weights, and a worker that had pulled that step took them for it. Publishing goes on
    past it, at the number the error gives."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    for p in chain[:3]:
        publish(store, p, options=PublishOptions(cache_dir=cache))
    (store / manifest_key(2)).write_bytes(b"{")
    assert main(["-q", "publish", str(store), str(chain[3]), "--cache", str(cache)]) == 1
    assert "publish with --step 3 to go on past it" in capsys.readouterr().err
    assert main(["-q", "publish", str(store), str(chain[3]), "--step", "2"]) == 1
    capsys.readouterr()
    assert (
        main(["-q", "publish", str(store), str(chain[3]), "--step", "3", "--cache", str(cache)])
        == 0
    )
    # The cache holds step 2, whose manifest cannot vouch for it: a full anchor.
    assert capsys.readouterr().out.startswith("3 anchor ")
    out = tmp_path / "w.safetensors"
    assert pull(store, out).step == 3 and out.read_bytes() == chain[3].read_bytes()


def test_publish_run_again_for_a_step_it_made_is_done(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trainer restarted after a publish killed once its manifest was up runs the same
    `publish --step N` again: that was exit 2, a usage error it could not tell from a real
    one. The step holds these weights: exit 0, the same stdout line, nothing uploaded; other
    weights for it are still refused."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    for i in (0, 1):
        assert (
            main(
                [
                    "-q",
                    "publish",
                    str(store),
                    str(chain[i]),
                    "--step",
                    str(i),
                    "--cache",
                    str(cache),
                ]
            )
            == 0
        )
    line = capsys.readouterr().out
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    assert main(["publish", str(store), str(chain[1]), "--step", "1", "--cache", str(cache)]) == 0
    got = capsys.readouterr()
    assert got.out == line.splitlines(keepends=True)[1]
    assert "already holds" in got.err and "nothing was uploaded" in got.err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    assert (
        main(["-q", "publish", str(store), str(chain[2]), "--step", "1", "--cache", str(cache)])
        == 2
    )
    assert "the store's last step is 1 (it holds other weights: " in capsys.readouterr().err
    assert (
        main(["-q", "publish", str(store), str(chain[0]), "--step", "0", "--cache", str(cache)])
        == 2
    )
    # Killed once the manifest was up, the publish left its cache without the step (a fresh
    # cache here): the run that finds it done keeps the copy, so the next step is a patch.
    fresh = ["--cache", str(tmp_path / "fresh-cache")]
    assert main(["-q", "publish", str(store), str(chain[1]), "--step", "1", *fresh]) == 0
    capsys.readouterr()
    assert main(["-q", "publish", str(store), str(chain[2]), *fresh]) == 0
    assert capsys.readouterr().out.startswith("2 patch ")


def test_pull_takes_an_empty_folder_as_its_output(tmp_path: Path) -> None:
    chain = generate_chain(tmp_path / "hf", "tiny", steps=1, lr=3e-6, seed=8, shards=2)
    store = tmp_path / "store"
    publish(store, chain[0], options=PublishOptions(cache_dir=tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    pull(store, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in chain[0].iterdir())


def test_work_folders_beside_an_output_are_named_as_its_temps(
    chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a kill -9 of pull, squash or a cast leaves beside the output matches the clean-up
    docs/GUARANTEES.md gives (rm -rf DIR/.*.pulsectl-tmp-*)."""
    import pulsectl.diff as diff_module
    from pulsectl.cast import cast_temporaries
    from pulsectl.squash import squash_patches

    pull_module = importlib.import_module("pulsectl.store.pull")

    store, out = tmp_path / "store", tmp_path / "out"
    for p in chain[:3]:
        publish(store, p, options=PublishOptions(cache_dir=tmp_path / "cache"))
    patches = [tmp_path / f"p{i}.pulse" for i in (1, 2)]
    for i, p in enumerate(patches):
        diff_module.diff_to_path(chain[i], chain[i + 1], p)
    out.mkdir()
    seen: list[str] = []

    def look(*a: object, **kw: object) -> None:
        seen.extend(p.name for p in out.iterdir())
        raise OutputError("stop here")

    monkeypatch.setattr(pull_module, "_execute", look)
    with pytest.raises(OutputError, match="stop here"):
        pull(store, out / "w.safetensors")
    monkeypatch.setattr(diff_module, "diff_to_path", look)
    with pytest.raises(OutputError, match="stop here"):
        squash_patches(patches, out / "s.pulse", base=chain[0])
    with cast_temporaries([chain[0]], to="f16", near=out / "c.pulse"):
        seen.extend(p.name for p in out.iterdir())
    assert len(seen) == 3 and all(fnmatch.fnmatch(name, TEMP_GLOB) for name in seen), seen
    assert list(out.iterdir()) == []


def test_pull_fsync_syncs_every_file_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pull --fsync, as apply --fsync: the worker's checkpoint is on disk before it is named."""
    chain = generate_chain(tmp_path / "hf", "tiny", steps=1, lr=3e-6, seed=8, shards=2)
    store = tmp_path / "store"
    for p in chain:
        publish(store, p, options=PublishOptions(cache_dir=tmp_path / "cache"))
    pull_module = importlib.import_module("pulsectl.store.pull")
    synced: list[str] = []
    real_fsync, real_install = os.fsync, pull_module.install

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def install(tmp: Path, path: Path) -> None:
        synced.append("<rename>")
        real_install(tmp, path)

    monkeypatch.setattr(pull_module.os, "fsync", fsync)
    monkeypatch.setattr(pull_module, "install", install)
    out = tmp_path / "w"
    assert main(["pull", str(store), "-o", str(out), "--fsync", "-q"]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert synced[-1] == "<rename>"
    assert {Path(s).name for s in synced[:-1]} >= set(files)
    synced.clear()
    shutil.rmtree(out)
    assert main(["pull", str(store), "-o", str(out), "-q"]) == 0
    assert synced == ["<rename>"]  # without --fsync: no sync


def test_a_refused_publisher_cannot_replace_the_patch_the_winner_published(
    chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two publishers of one step at different levels: the one that read the store first but
    uploads last is refused at its manifest, but its patch went up first, and under the same
    name (step and target fingerprint) it replaced the winner's: step 1 then no longer pulled
    (a review's repro, folder and S3). A patch's name now holds its own fingerprint too."""
    store = tmp_path / "store"
    first = PublishOptions(cache_dir=tmp_path / "cache-a")
    publish(store, chain[0], options=first)
    shutil.copytree(tmp_path / "cache-a", tmp_path / "cache-b")
    real = FolderStore.upload
    winner: list[object] = []

    def the_other_publisher_finishes_first(self: FolderStore, source: Path, key: str) -> None:
        if key.startswith("patches/") and not winner:
            monkeypatch.setattr(FolderStore, "upload", real)
            fast = PublishOptions(cache_dir=tmp_path / "cache-b", diff=DiffOptions(level=1))
            winner.append(publish(store, chain[1], step=1, options=fast))
            monkeypatch.setattr(FolderStore, "upload", the_other_publisher_finishes_first)
        real(self, source, key)

    monkeypatch.setattr(FolderStore, "upload", the_other_publisher_finishes_first)
    slow = PublishOptions(cache_dir=tmp_path / "cache-a", diff=DiffOptions(level=19))
    with pytest.raises(ObjectExistsError, match="published by another publisher"):
        publish(store, chain[1], step=1, options=slow)
    assert winner
    pulled = tmp_path / "pulled.safetensors"
    pull(store, pulled, step=1)
    assert pulled.read_bytes() == chain[1].read_bytes()
    assert len(list((store / "patches").iterdir())) == 2  # the loser's is left for prune


def test_a_prune_stopped_part_way_leaves_only_steps_that_pull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune deleted the dropped steps' manifests oldest first: stopped after two, the steps
    after them were listed as healthy and could not be rebuilt (their base was gone). It now
    deletes them newest first, so what is left of them is always a chain back to an anchor."""
    chain = generate_chain(tmp_path / "c", "tiny", steps=7, lr=3e-6, seed=8)
    store = tmp_path / "store"
    options = PublishOptions(cache_dir=tmp_path / "cache", anchor_every=4)
    for ckpt in chain:
        publish(store, ckpt, options=options)
    real = FolderStore.delete

    def stopped_after_two(self: FolderStore, keys: object) -> None:
        real(self, list(keys)[:2])  # type: ignore[call-overload]
        raise KeyboardInterrupt

    monkeypatch.setattr(FolderStore, "delete", stopped_after_two)
    with pytest.raises(KeyboardInterrupt):
        prune_store(store, keep_anchors=1, keep_steps=1)
    monkeypatch.undo()
    listed = [s[0] for s in steps_of(store)]
    assert listed == [0, 1, 4, 5, 6, 7]  # 3 and 2 went first
    for step in listed:
        out = tmp_path / f"s{step}.safetensors"
        pull(store, out, step=step)
        assert out.read_bytes() == chain[step].read_bytes()


def test_a_cache_copy_cut_short_gives_an_anchor_not_a_failure_at_every_publish(
    chain: list[Path], tmp_path: Path
) -> None:
    """The cache's copy of the last step, truncated: every publish failed on it ('run past the
    end of the data section'), retries too. Now the step is a full anchor that says why, and
    the next one a patch again."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    options = PublishOptions(cache_dir=cache)
    publish(store, chain[0], options=options)
    head = cache / "head.safetensors"
    assert head.exists()
    with head.open("r+b") as f:
        f.truncate(head.stat().st_size // 2)
    summary = publish(store, chain[1], options=options)
    assert summary.manifest.kind == "anchor"
    assert "publish cache's copy of step 0 cannot be read" in summary.reason
    assert publish(store, chain[2], options=options).manifest.kind == "patch"
    for step in (1, 2):
        out = tmp_path / f"s{step}.safetensors"
        pull(store, out, step=step)
        assert out.read_bytes() == chain[step].read_bytes()


def test_a_step_below_one_published_meanwhile_is_refused(
    chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publisher A at --step 2, publisher B at --step 3 finishing first: A's step 2 came after
    step 3, its objects (older than the last step, unreferenced until its manifest) open to a
    prune running meanwhile, which deleted them; A said 'published step 2', and step 2 could
    not be pulled. A now checks for a later step before it writes its manifest."""
    store = tmp_path / "store"
    publish(store, chain[0], options=PublishOptions(cache_dir=tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    real = FolderStore.upload

    def b_finishes_first(self: FolderStore, source: Path, key: str) -> None:
        monkeypatch.setattr(FolderStore, "upload", real)
        publish(store, chain[2], step=3, options=PublishOptions(cache_dir=tmp_path / "b"))
        real(self, source, key)

    monkeypatch.setattr(FolderStore, "upload", b_finishes_first)
    with pytest.raises(ObjectExistsError, match="step 3 was published by another publisher"):
        publish(store, chain[1], step=2, options=PublishOptions(cache_dir=tmp_path / "a"))
    assert [s[0] for s in steps_of(store)] == [0, 3]


def test_log_flags_steps_cut_off_from_every_anchor(
    chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step whose own objects are all there but whose base's manifest is gone (deleted by
    hand, or by a prune of before newest-first) cannot be pulled: log said nothing of it."""
    store = tmp_path / "store"
    for ckpt in chain:
        publish(store, ckpt, options=PublishOptions(cache_dir=tmp_path / "cache"))
    assert all(s["reachable"] for s in read_log(store)["steps"])
    (store / manifest_key(1)).unlink()
    doc = read_log(store)
    assert [(s["step"], s["reachable"]) for s in doc["steps"]] == [
        (0, True),
        (2, False),
        (3, False),
        (4, False),
    ]
    capsys.readouterr()
    assert main(["log", str(store)]) == 0
    lines = capsys.readouterr().out.splitlines()
    flagged = [line.split()[0] for line in lines if "UNREACHABLE" in line]
    assert flagged == ["2", "3", "4"]
