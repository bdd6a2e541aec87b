"""Folder stores: publish, pull (with fallbacks), log, prune; a trainer and a late, lossy worker."""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import TEMP_GLOB, tree_bytes

from pulsectl.cli.app import main
from pulsectl.errors import FormatError, OutputError, UsageError
from pulsectl.store import (
    PublishOptions,
    StepUnreachableError,
    open_store,
    plan_prune,
    prune,
    publish,
    pull,
    read_log,
)
from pulsectl.store.folder import FolderStore
from pulsectl.store.layout import manifest_from_bytes, manifest_key
from pulsectl.synth import generate_chain

STEPS = 30  # the trainer publishes steps 0..STEPS


@pytest.fixture(scope="module")
def trainer_chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return generate_chain(tmp_path_factory.mktemp("trainer"), "tiny", steps=STEPS, lr=3e-6, seed=3)


def publish_all(
    store: Path, chain: list[Path], cache: Path, k: int = 10, upto: int = STEPS
) -> None:
    for path in chain[: upto + 1]:
        publish(store, path, options=PublishOptions(anchor_every=k, cache_dir=cache))


@pytest.fixture(scope="module")
def published(trainer_chain: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store holding all 31 steps, anchors every 10 (read-only use: copy before damaging)."""
    root = tmp_path_factory.mktemp("published")
    publish_all(root / "store", trainer_chain, root / "cache")
    return root / "store"


def manifest(store: Path, step: int) -> dict:
    return json.loads((store / manifest_key(step)).read_text())


def test_layout_and_anchor_policy(published: Path) -> None:
    doc = read_log(published)
    kinds = {s["step"]: s["kind"] for s in doc["steps"]}
    assert [s for s, k in kinds.items() if k == "anchor"] == [0, 10, 20, 30]
    assert len(kinds) == STEPS + 1
    for s in doc["steps"]:
        assert s["chain_length"] == s["step"] % 10
        assert s["anchor_step"] == s["step"] - s["step"] % 10
        assert s["missing"] == []
    # Anchors after the first also carry the one-step patch, for workers one step behind.
    assert manifest(published, 10)["patch"]["base_step"] == 9
    assert manifest(published, 0)["patch"] is None
    # Plain files with immutable, step-prefixed names; manifests are canonical JSON.
    names = sorted(p.relative_to(published).as_posix() for p in published.rglob("*") if p.is_file())
    assert (
        names[:4]
        == [
            "anchors/00000000-"
            + manifest(published, 0)["target"]["fingerprint"][:16]
            + ".safetensors",
            *[n for n in names if n.startswith("anchors/")][1:4],
        ][:4]
    )
    assert "pulse-store.json" in names
    assert {n.split("/")[0] for n in names} == {"anchors", "patches", "steps", "pulse-store.json"}
    raw = (published / "steps/00000007.json").read_bytes()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert manifest_from_bytes(raw, "x").step == 7


@pytest.mark.parametrize(
    ("layout", "paths", "problem"),
    [
        ("file", ["../../../escaped.safetensors"], "exactly one empty path"),
        ("file", ["", ""], "exactly one empty path"),
        ("dir", ["../x.safetensors"], "unsafe file path '../x.safetensors'"),
        ("dir", ["a/../../x.safetensors"], "unsafe file path"),
        ("dir", ["/etc/x.safetensors"], "unsafe file path"),
        ("dir", [".hidden"], "unsafe file path"),
        ("dir", ["a\\..\\x"], "unsafe file path"),
        ("dir", [""], "unsafe file path"),
        ("dir", ["b.json", "a.json"], "not sorted"),
        ("dir", ["a", "a/b.json"], "'a' is both a file and a folder"),
    ],
)
def test_manifest_anchor_paths_stay_inside(
    published: Path, layout: str, paths: list[str], problem: str
) -> None:
    """pull writes an anchor's files at the paths its manifest names: a manifest whose paths
    would climb out of pull's folder (damaged, or written by someone else) is refused."""
    doc = manifest(published, 10)
    template = doc["anchor"]["files"][0]
    doc["layout"] = layout
    doc["anchor"]["files"] = [{**template, "path": p} for p in paths]
    raw = json.dumps(doc).encode()
    with pytest.raises(
        FormatError, match="not a valid step manifest: anchor files: .*" + re.escape(problem)
    ):
        manifest_from_bytes(raw, "steps/00000010.json")
    # The same manifest with the store's own paths is read.
    assert manifest_from_bytes(json.dumps(manifest(published, 10)).encode(), "x").step == 10


def test_pull_refuses_an_anchor_path_out_of_its_folder(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    """Before the check, this manifest made pull write the anchor outside its work folder and
    then copy the folder it had landed in (here tmp_path) into the result, recursively."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    doc = manifest(store, 0)
    doc["anchor"]["files"][0]["path"] = "../../../escaped.safetensors"
    (store / manifest_key(0)).write_text(json.dumps(doc))
    (tmp_path / "worker").mkdir()
    out = tmp_path / "worker" / "w.safetensors"
    with pytest.raises(
        StepUnreachableError, match="the manifest of step 0, .* is missing or damaged"
    ):
        pull(store, out, step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "worker"]
    assert list((tmp_path / "worker").iterdir()) == []
    assert read_log(store)["steps"][0]["kind"] == "damaged"
    # Steps with an anchor of their own are still reachable.
    pull(store, out, step=12)
    assert out.read_bytes() == trainer_chain[12].read_bytes()


def test_pull_any_step_bit_exact(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "w.safetensors"
    for step in (0, 9, 10, 13, 30, 4):
        summary = pull(published, out, step=step)
        assert out.read_bytes() == trainer_chain[step].read_bytes()
        assert summary.step == step
    assert not list(tmp_path.glob(TEMP_GLOB)) and not list(tmp_path.glob(".*pull*"))


def test_pull_starts_from_local_step(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    out = tmp_path / "w.safetensors"
    shutil.copy(trainer_chain[21], out)
    summary = pull(published, out, step=24)
    assert summary.start == "local copy of step 21" and summary.patches == 3
    assert out.read_bytes() == trainer_chain[24].read_bytes()
    again = pull(published, out, step=24)
    assert again.patches == 0 and again.fetched_bytes == 0
    # Nine steps behind an anchor: three patches from step 29 are cheaper than anchor 30.
    shutil.copy(trainer_chain[29], out)
    assert pull(published, out).start == "local copy of step 29"
    # Far behind: the anchor is cheaper than 25 patches.
    shutil.copy(trainer_chain[1], out)
    summary = pull(published, out, step=30)
    assert summary.start == "anchor of step 30" and summary.patches == 0
    assert out.read_bytes() == trainer_chain[30].read_bytes()


def test_pull_refuses_foreign_output_without_force(published: Path, tmp_path: Path) -> None:
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"not a checkpoint")
    with pytest.raises(OutputError, match="pass -f"):
        pull(published, out, step=3)
    assert out.read_bytes() == b"not a checkpoint"
    pull(published, out, step=3, force=True)


def test_pull_into_a_missing_folder_says_to_create_it(published: Path, tmp_path: Path) -> None:
    out = tmp_path / "worker" / "model.safetensors"
    with pytest.raises(OutputError) as err:
        pull(published, out, step=3)
    assert str(err.value) == (
        f"{out}: folder {out.parent} does not exist; create it first (mkdir -p {out.parent})"
    )
    assert not out.parent.exists()


def test_half_published_step_is_invisible(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(published, store)
    # A publish that died after uploading its patch, before its manifest:
    (store / "patches/00000031-0123456789abcdef.pulse").write_bytes(b"partial")
    out = tmp_path / "w.safetensors"
    assert pull(store, out).step == STEPS
    assert out.read_bytes() == trainer_chain[STEPS].read_bytes()
    # prune removes the orphan only because it is not newer than the last manifest... it is
    # newer (31 > 30): a publish may still be writing it, so it stays.
    assert "patches/00000031-0123456789abcdef.pulse" not in [
        k for k, _ in plan_prune(open_store(store), 1, 1).deletions
    ]


def test_corrupted_patch_falls_back_to_a_later_anchor(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(published, store)
    key = manifest(store, 13)["patch"]["key"]
    data = bytearray((store / key).read_bytes())
    data[len(data) // 2] ^= 0x01
    (store / key).write_bytes(bytes(data))
    out = tmp_path / "w.safetensors"
    shutil.copy(trainer_chain[11], out)
    before = out.read_bytes()
    with pytest.raises(
        StepUnreachableError, match=r"step 15 is unreachable: .*00000013-.*fingerprint"
    ):
        pull(store, out, step=15)
    assert out.read_bytes() == before  # nothing half-updated, nothing wrong
    assert not list(tmp_path.glob(".*pull*"))
    # Step 20 has an anchor after the broken patch: the pull gets there anyway.
    summary = pull(store, out, step=20)
    assert summary.problems and "00000013-" in summary.problems[0]
    assert summary.start == "anchor of step 20"
    assert out.read_bytes() == trainer_chain[20].read_bytes()


def test_missing_patch_mid_chain_keeps_progress(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(published, store)
    (store / manifest(store, 26)["patch"]["key"]).unlink()
    out = tmp_path / "w.safetensors"
    shutil.copy(trainer_chain[22], out)
    with pytest.raises(StepUnreachableError, match="not in the store"):
        pull(store, out, step=28)
    assert out.read_bytes() == trainer_chain[22].read_bytes()
    assert pull(store, out, step=25).patches == 3
    assert out.read_bytes() == trainer_chain[25].read_bytes()
    summary = pull(store, out, step=30)
    assert summary.start == "anchor of step 30"
    assert out.read_bytes() == trainer_chain[30].read_bytes()


def test_damaged_anchor_and_manifest(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(published, store)
    anchor = store / manifest(store, 10)["anchor"]["files"][0]["key"]
    anchor.write_bytes(anchor.read_bytes()[:-7])
    out = tmp_path / "w.safetensors"
    # The anchor of 10 is truncated: step 12 is rebuilt from anchor 0 and twelve patches.
    summary = pull(store, out, step=12)
    assert summary.start == "anchor of step 0" and summary.patches == 12
    assert out.read_bytes() == trainer_chain[12].read_bytes()
    (store / manifest_key(5)).write_text("{not json")
    with pytest.raises(StepUnreachableError, match="step 5"):
        pull(store, tmp_path / "x.safetensors", step=8, force=True)
    assert not (tmp_path / "x.safetensors").exists()
    assert read_log(store)["steps"][5]["kind"] == "damaged"


def test_trainer_and_late_lossy_worker(trainer_chain: list[Path], tmp_path: Path) -> None:
    """The trainer publishes 31 steps; a worker joins late, pulls at random, misses steps, and
    meets a corrupted and a missing patch. Every checkpoint it ends with is exactly the
    trainer's; when it cannot get one, it keeps what it had."""
    store, cache = tmp_path / "store", tmp_path / "cache"
    rng = random.Random(1234)
    out = tmp_path / "worker" / "model.safetensors"
    out.parent.mkdir()
    have: int | None = None
    damaged: set[int] = set()
    pulls = fallbacks = refusals = 0
    for step, path in enumerate(trainer_chain):
        publish(store, path, options=PublishOptions(anchor_every=10, cache_dir=cache))
        if step == 14:  # bit rot in a published patch
            key = manifest(store, 14)["patch"]["key"]
            data = bytearray((store / key).read_bytes())
            data[-40] ^= 0xFF
            (store / key).write_bytes(bytes(data))
            damaged.add(14)
        if step == 23:  # a patch lost on the way
            (store / manifest(store, 23)["patch"]["key"]).unlink()
            damaged.add(23)
        if step < 6 or rng.random() < 0.5:
            continue  # not joined yet, or busy: misses this step
        want = rng.choice([step, step, rng.randint(max(0, step - 8), step)])
        if have is not None and want < have:
            want = step
        reachable_by_anchor = not any(a < d <= want for d in damaged for a in [want - want % 10])
        try:
            summary = pull(store, out, step=want)
        except StepUnreachableError:
            refusals += 1
            assert not reachable_by_anchor
            if have is None:
                assert not out.exists()
            else:
                assert out.read_bytes() == trainer_chain[have].read_bytes()
            continue
        pulls += 1
        fallbacks += bool(summary.problems)
        have = want
        assert out.read_bytes() == trainer_chain[want].read_bytes()
        assert not list(out.parent.glob(".*"))
    final = pull(store, out)
    assert final.step == STEPS and out.read_bytes() == trainer_chain[STEPS].read_bytes()
    assert pulls >= 5


def test_publish_rules(trainer_chain: list[Path], tmp_path: Path) -> None:
    store, cache = tmp_path / "store", tmp_path / "cache"
    opts = PublishOptions(anchor_every=0, cache_dir=cache)
    assert publish(store, trainer_chain[0], step=100, options=opts).manifest.kind == "anchor"
    with pytest.raises(UsageError, match="steps are immutable"):
        publish(store, trainer_chain[1], step=100, options=opts)
    assert publish(store, trainer_chain[1], options=opts).manifest.step == 101
    # A patch over the fraction of the checkpoint becomes an anchor.
    tiny = PublishOptions(anchor_every=0, cache_dir=cache, max_patch_fraction=0.001)
    s = publish(store, trainer_chain[2], options=tiny)
    assert s.manifest.kind == "anchor" and "max-patch-fraction" in s.reason
    # Without the local copy of the last step, publish never downloads: it writes an anchor.
    shutil.rmtree(cache)
    s = publish(store, trainer_chain[3], options=opts)
    assert s.manifest.kind == "anchor" and "does not hold step 102" in s.reason
    assert publish(store, trainer_chain[4], options=opts).manifest.kind == "patch"
    # The chain since the last anchor never gets longer than K, whatever the step numbers.
    k3 = PublishOptions(anchor_every=3, cache_dir=cache)
    kinds = [publish(store, p, options=k3).manifest for p in trainer_chain[5:10]]
    assert max(m.chain_length for m in kinds) <= 3
    for m in read_log(store)["steps"]:
        assert m["chain_length"] <= 3 or m["step"] < 105


def test_folder_checkpoints(tmp_path: Path) -> None:
    chain = generate_chain(tmp_path / "hf", "tiny", steps=4, lr=3e-6, seed=5, shards=2)
    store, cache = tmp_path / "store", tmp_path / "cache"
    for p in chain:
        publish(store, p, options=PublishOptions(anchor_every=3, cache_dir=cache))
    out = tmp_path / "model"
    pull(store, out, step=1)
    assert tree_bytes(out) == tree_bytes(chain[1])
    assert pull(store, out).start == "local copy of step 1"
    assert tree_bytes(out) == tree_bytes(chain[4])
    # Anchor from step 3 (a folder of objects) plus one patch:
    summary = pull(store, tmp_path / "fresh", step=4)
    assert summary.start == "anchor of step 3" and tree_bytes(tmp_path / "fresh") == tree_bytes(
        chain[4]
    )


def test_publish_as_bf16(tmp_path: Path) -> None:
    pytest.importorskip("pulsectl.cast")
    from pulsectl.cast import cast_checkpoint

    generate_chain(tmp_path / "c", "tiny", steps=2, lr=3e-6, seed=9, save_fp32=True)
    masters = sorted((tmp_path / "c").glob("step_*.f32.safetensors"))
    store, cache = tmp_path / "store", tmp_path / "cache"
    for p in masters:
        publish(store, p, options=PublishOptions(cast="bf16", cache_dir=cache))
    with pytest.raises(UsageError, match="--as bf16"):
        publish(store, masters[0], options=PublishOptions(cache_dir=cache))
    out = tmp_path / "w.safetensors"
    pull(store, out)
    cast_checkpoint(masters[-1], tmp_path / "expected.safetensors", to="bf16")
    assert out.read_bytes() == (tmp_path / "expected.safetensors").read_bytes()
    assert read_log(store)["steps"][1]["cast"] == "bf16"


def test_prune_keeps_what_kept_steps_need(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(published, store)
    before = sorted(p for p in store.rglob("*") if p.is_file())
    dry = prune(store, keep_anchors=2, keep_steps=5, dry_run=True)
    assert sorted(p for p in store.rglob("*") if p.is_file()) == before
    # The last 5 steps are 26..30; 26 needs anchor 20 and patches 21..26; anchors 20 and 30 kept.
    assert dry.kept_steps == tuple(range(20, 31))
    assert dry.deleted_steps == tuple(range(0, 20))
    plan = prune(store, keep_anchors=2, keep_steps=5)
    assert plan.deletions == dry.deletions
    assert [k for k, _ in plan.deletions[:20]] == [manifest_key(s) for s in range(20)]
    assert not (
        store / "anchors" / Path(manifest(published, 0)["anchor"]["files"][0]["key"]).name
    ).exists()
    out = tmp_path / "w.safetensors"
    for step in range(20, 31):
        pull(store, out, step=step, force=True)
        assert out.read_bytes() == trainer_chain[step].read_bytes()
    assert all(not s["missing"] for s in read_log(store)["steps"])
    # Keeping 3 anchors keeps step 10's anchor too, but not the patches 11..19.
    store2 = tmp_path / "store2"
    shutil.copytree(published, store2)
    assert prune(store2, keep_anchors=3, keep_steps=1).kept_steps == (10, 20, 30)
    pull(store2, out, step=10, force=True)
    assert out.read_bytes() == trainer_chain[10].read_bytes()
    # Keeping nothing keeps the latest step all the same, with its chain back to its anchor
    # (found in review: 0 and 0 were refused as "would delete every step", which they do not).
    assert prune(store2, keep_anchors=0, keep_steps=0).kept_steps == (30,)
    pull(store2, out, step=30, force=True)
    assert out.read_bytes() == trainer_chain[30].read_bytes()


def test_prune_keeps_the_route_around_an_anchor_cut_short(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    """Step 30's anchor cut short (log says MISSING): pull goes round it, from anchor 20 and
    patches 21..30. prune --keep-steps 1 kept 30 alone and deleted that route, leaving 30
    unreachable; an anchor whose objects are not all there, at their sizes, ends no route."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    key = manifest(published, 30)["anchor"]["files"][0]["key"]
    with open(store / key, "r+b") as f:
        f.truncate(1000)
    out = tmp_path / "w.safetensors"
    pull(store, out, step=30)
    assert out.read_bytes() == trainer_chain[30].read_bytes()
    for anchors in (1, 0):
        assert prune(store, keep_anchors=anchors, keep_steps=1).kept_steps == tuple(range(20, 31))
    pull(store, out, step=30, force=True)
    assert out.read_bytes() == trainer_chain[30].read_bytes()
    assert [s["step"] for s in read_log(store)["steps"] if s["reachable"]] == list(range(20, 31))


def test_a_patch_pruned_during_a_pull_is_gone_and_pull_goes_round_it(
    published: Path, trainer_chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder store's patch, checked by the prefetch, then deleted (a prune) before apply
    opened it: pull failed with exit 1 ("cannot open patch: No such file or directory")
    instead of planning again; anchor 30 was a route all along."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    out = tmp_path / "w.safetensors"
    pull(store, out, step=21)
    pull_mod = importlib.import_module("pulsectl.store.pull")
    real_apply, real_fetch = pull_mod.apply_patches, pull_mod.fetch_verified
    doomed_key = manifest(published, 23)["patch"]["key"]
    checked = threading.Event()

    def fetch(store_: object, stored: object, dest: Path) -> Path:
        path = real_fetch(store_, stored, dest)
        if stored.key == doomed_key:  # type: ignore[attr-defined]
            checked.set()
        return path

    def apply_then_prune(base, patches, dest, **kw):  # type: ignore[no-untyped-def]
        if Path(patches[0]) == store / manifest(published, 22)["patch"]["key"]:
            assert checked.wait(10)  # patch 23 checked, waiting in the prefetch queue
            (store / doomed_key).unlink()
        return real_apply(base, patches, dest, **kw)

    monkeypatch.setattr(pull_mod, "fetch_verified", fetch)
    monkeypatch.setattr(pull_mod, "apply_patches", apply_then_prune)
    summary = pull(store, out, step=30)
    assert out.read_bytes() == trainer_chain[30].read_bytes()
    assert any("deleted from the store while pull was reading it" in b for b in summary.problems)


def test_a_folder_anchor_losing_a_file_during_a_pull_is_the_one_gone(
    trainer_chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder anchor read in place lost its config.json (a prune deleting its files in turn)
    before the first patch applied to it: pull blamed the patch and, with no way left round
    it, said the step was unreachable, though anchor 0 and its patches were a route."""
    folders = []
    for i, f in enumerate(trainer_chain[:4]):
        d = tmp_path / f"ck{i}"
        d.mkdir()
        shutil.copy(f, d / "model.safetensors")
        (d / "config.json").write_text('{"a": 1}')
        folders.append(d)
    store = tmp_path / "store"
    for d in folders:
        publish(store, d, options=PublishOptions(anchor_every=2, cache_dir=tmp_path / "cache"))
    pull_mod = importlib.import_module("pulsectl.store.pull")
    real_apply = pull_mod.apply_patches

    pruned: list[Path] = []

    def apply_after_a_prune(base, patches, dest, **kw):  # type: ignore[no-untyped-def]
        if Path(base).is_relative_to(store) and not pruned:
            pruned.append(Path(base) / "config.json")
            pruned[0].unlink()
        return real_apply(base, patches, dest, **kw)

    monkeypatch.setattr(pull_mod, "apply_patches", apply_after_a_prune)
    summary = pull(store, tmp_path / "out", step=3)
    assert summary.start == "anchor of step 0"
    assert tree_bytes(tmp_path / "out") == tree_bytes(folders[3])
    assert any("config.json: deleted from the store" in p for p in summary.problems)


def test_a_worker_on_a_pruned_step_is_told_it_may_be_one(
    published: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It read as if the file were foreign: 'is not a step of STORE'."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    out = tmp_path / "w.safetensors"
    pull(store, out, step=3)
    prune(store, keep_anchors=1, keep_steps=1)
    assert main(["pull", str(store), "-o", str(out)]) == 1
    assert capsys.readouterr().err.endswith(
        ": another checkpoint, or a step pruned since); pass -f to replace it\n"
    )
    assert main(["-q", "pull", str(store), "-o", str(out), "-f"]) == 0


def test_prefetch_overlaps_fetch_and_apply(
    published: Path, trainer_chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patch i+1 is being fetched while patch i applies (a slow store makes it visible)."""
    events: list[tuple[str, int, float, float]] = []
    lock = threading.Lock()

    class SlowStore(FolderStore):
        def fetch(self, key: str, dest: Path) -> Path:
            step, t0 = int(key.split("/")[1][:8]), time.monotonic()
            time.sleep(0.05)
            result = super().fetch(key, dest)
            with lock:
                events.append(("fetch", step, t0, time.monotonic()))
            return result

    pull_mod = importlib.import_module("pulsectl.store.pull")  # the package exports pull()

    real_apply = pull_mod.apply_patches

    def slow_apply(base, patches, out, **kw):  # type: ignore[no-untyped-def]
        step, t0 = int(Path(out).name.split("-")[1].split(".")[0]), time.monotonic()
        time.sleep(0.05)
        result = real_apply(base, patches, out, **kw)
        with lock:
            events.append(("apply", step, t0, time.monotonic()))
        return result

    monkeypatch.setattr(pull_mod, "apply_patches", slow_apply)
    out = tmp_path / "w.safetensors"
    shutil.copy(trainer_chain[21], out)
    pull(SlowStore(published), out, step=25, prefetch=1)
    assert out.read_bytes() == trainer_chain[25].read_bytes()
    fetches = [(s, t0, t1) for k, s, t0, t1 in events if k == "fetch"]
    applies = [(s, t0, t1) for k, s, t0, t1 in events if k == "apply"]
    assert [s for s, _, _ in applies] == [22, 23, 24, 25]
    # A later patch was being fetched while an earlier one applied.
    overlapped = sum(
        1 for fs, f0, f1 in fetches for a_s, a0, a1 in applies if fs > a_s and f0 < a1 and a0 < f1
    )
    assert overlapped >= 2, events


def test_cli_publish_pull_log_prune(
    trainer_chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store, cache = str(tmp_path / "store"), str(tmp_path / "cache")
    for path in trainer_chain[:6]:
        assert main(["publish", store, str(path), "-k", "4", "--cache", cache]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [
        ["0", "anchor"],
        *[[str(i), "patch"] for i in (1, 2, 3)],
        ["4", "anchor"],
        ["5", "patch"],
    ]
    w = tmp_path / "w.safetensors"
    assert main(["-q", "pull", store, "-o", str(w), "--step", "2"]) == 0
    assert w.read_bytes() == trainer_chain[2].read_bytes()
    assert capsys.readouterr().out.split()[0] == "2"
    assert main(["pull", store, "-o", str(w), "--step", "latest"]) == 0
    captured = capsys.readouterr()
    assert "from the local copy of step 2 and 3 patches" in captured.err
    assert main(["log", store, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["kind"] for s in doc["steps"]] == [
        "anchor",
        "patch",
        "patch",
        "patch",
        "anchor",
        "patch",
    ]
    assert main(["log", store]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:3] == ["step", "kind", "anchor"] and "72,920" in text
    assert main(["prune", store, "--keep-anchors", "1", "--keep-steps", "1", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert manifest_key(0) in captured.out and "would delete 4 steps" in captured.err
    assert (tmp_path / "store" / manifest_key(0)).exists()
    assert main(["pull", store, "-o", str(w), "--step", "9"]) == 1
    assert capsys.readouterr().err == (
        f"pulsectl: error: {store}: step 9 is not in the store (not published yet, or pruned); "
        "it holds steps 0, 1, 2, 3, 4, 5\n"
    )
    assert main(["pull", store, "-o", str(w), "--step", "x"]) == 2
    assert main(["publish", "ftp://x/y", str(trainer_chain[0])]) == 2


def test_a_manifest_under_another_step_number_is_damaged(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    """A manifest copied to another step's name (a hand-made "fix", a bad mirror) must not
    serve its own step as the other: it is refused as damaged, never pulled as that step."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    shutil.copyfile(store / manifest_key(3), store / manifest_key(STEPS + 1))
    said: list[str] = []
    out = tmp_path / "w.safetensors"
    summary = pull(store, out, log=said.append)
    assert summary.step == STEPS and out.read_bytes() == trainer_chain[STEPS].read_bytes()
    assert f"the manifest of step {STEPS + 1} is damaged" in said[0]
    assert "it describes step 3" in said[0]
    with pytest.raises(Exception, match=f"step {STEPS + 1}: .*it describes step 3"):
        pull(store, tmp_path / "x.safetensors", step=STEPS + 1)
    assert read_log(store)["steps"][-1]["kind"] == "damaged"


def test_a_damaged_latest_manifest_is_said_not_skipped_quietly(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    shutil.copytree(published, store)
    latest = store / manifest_key(STEPS)
    latest.write_bytes(latest.read_bytes()[:100])
    said: list[str] = []
    out = tmp_path / "w.safetensors"
    shutil.copyfile(trainer_chain[STEPS - 3], out)
    assert pull(store, out, log=said.append).step == STEPS - 1
    assert said[0].startswith(f"{store / manifest_key(STEPS)}: the manifest of step {STEPS} is ")
    assert said[0].endswith(f"step {STEPS - 1} is the latest that can be pulled")
    # A worker already on the damaged step is told that it may be that step.
    on_latest = tmp_path / "latest.safetensors"
    shutil.copyfile(trainer_chain[STEPS], on_latest)
    with pytest.raises(OutputError, match=rf"damaged: {STEPS}\) \(fingerprint"):
        pull(store, on_latest)
    assert on_latest.read_bytes() == trainer_chain[STEPS].read_bytes()


def test_prune_always_keeps_the_latest_step(published: Path, tmp_path: Path) -> None:
    """--keep-steps 0 keeps the latest step all the same: workers are on it, and a pruned
    latest step would let publish number a new step as it, with other content."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    # Step 30 is an anchor; with its manifest gone the latest is 29, a patch step whose
    # chain goes back to anchor 20.
    (store / manifest_key(STEPS)).unlink()
    plan = prune(store, keep_anchors=1, keep_steps=0)
    assert plan.kept_steps == tuple(range(20, STEPS))  # 29 and its chain back to anchor 20
    assert read_log(store)["steps"][-1]["step"] == STEPS - 1


def test_two_publishers_of_one_step_one_wins(trainer_chain: list[Path], tmp_path: Path) -> None:
    """The manifest is created, not renamed into place: a second publisher of the same step
    (a restarted trainer racing its old process) is refused and the first step stands."""
    from pulsectl.store.base import ObjectExistsError

    store = tmp_path / "store"
    publish(store, trainer_chain[0], options=PublishOptions(cache_dir=tmp_path / "a"))
    first = publish(store, trainer_chain[1], options=PublishOptions(cache_dir=tmp_path / "a"))
    before = (store / manifest_key(1)).read_bytes()
    folder = FolderStore(store)
    # Only the create itself may refuse: a check before it would race (it is told nothing).
    folder.exists = lambda key: False  # type: ignore[method-assign]
    with pytest.raises(ObjectExistsError, match="already in the store"):
        folder.create(manifest_key(1), b"{}")
    # The loser's whole publish, as it would run had it read the catalog before the winner
    # wrote: its manifest is refused, nothing of it is listed.
    with pytest.raises(ObjectExistsError, match="step 1 was published by another publisher"):
        _publish_racing(store, trainer_chain[5], tmp_path / "b")
    assert (store / manifest_key(1)).read_bytes() == before
    assert read_log(store)["steps"][-1]["target_fingerprint"] == first.manifest.target_fingerprint
    assert not list(store.rglob(".*pulsectl-tmp*"))


def _publish_racing(store: Path, checkpoint: Path, cache: Path) -> None:
    """publish, with the catalog it reads taken before step 1 was published."""
    from pulsectl.store.catalog import Catalog

    pub = importlib.import_module(
        "pulsectl.store.publish"
    )  # the package's `publish` is the function

    real = Catalog

    class Stale(real):  # type: ignore[misc, valid-type]
        def __init__(self, s: object) -> None:
            super().__init__(s)  # type: ignore[arg-type]
            self.steps = [x for x in self.steps if x < 1]
            self._listed = set(self.steps)

    pub.Catalog = Stale  # type: ignore[misc]
    try:
        publish(store, checkpoint, options=PublishOptions(cache_dir=cache))
    finally:
        pub.Catalog = real  # type: ignore[misc]


def test_publish_refuses_a_file_as_store_and_checks_its_input_first(
    trainer_chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["publish", str(afile), str(trainer_chain[0])]) == 1
    line = f"pulsectl: error: {afile}: is a file, not a store folder"
    assert capsys.readouterr().err == f"{line}; give a folder path\n"
    assert main(["log", str(afile)]) == 1
    assert capsys.readouterr().err == f"{line}\n"
    assert afile.read_text() == "x"
    fresh = tmp_path / "fresh"
    assert main(["publish", str(fresh), str(tmp_path / "missing.safetensors")]) == 1
    assert "missing.safetensors" in capsys.readouterr().err
    assert not fresh.exists()  # a bad input makes no store folder


def test_pull_of_a_single_file_store_into_a_folder_is_refused_first(
    published: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(OutputError, match="is a folder, and step 30 of .* is a single file"):
        pull(published, folder, force=True)
    assert not any(folder.iterdir()) and not list(tmp_path.glob(".*pulsectl*"))


def test_publish_as_is_one_spelling(tmp_path: Path) -> None:
    generate_chain(tmp_path / "c", "tiny", steps=1, lr=3e-6, seed=9, save_fp32=True)
    masters = sorted((tmp_path / "c").glob("step_*.f32.safetensors"))
    store = tmp_path / "store"
    publish(store, masters[0], options=PublishOptions(cast="BF16", cache_dir=tmp_path / "c1"))
    assert manifest(store, 0)["cast"] == "bf16"
    publish(store, masters[1], options=PublishOptions(cast="bf16", cache_dir=tmp_path / "c1"))
    assert manifest(store, 1)["cast"] == "bf16"


def test_a_stray_file_in_an_anchor_folder_is_named(tmp_path: Path) -> None:
    """A folder store's anchor folder is read in place: a file its manifest does not list is
    named as the anchor's problem, and another anchor is used where there is one."""
    chain = generate_chain(tmp_path / "hf", "tiny", steps=4, lr=3e-6, seed=5, shards=2)
    store, cache = tmp_path / "store", tmp_path / "cache"
    for p in chain:
        publish(store, p, options=PublishOptions(anchor_every=3, cache_dir=cache))
    anchor3 = next((store / "anchors").glob("00000003-*"))
    (anchor3 / "stray.txt").write_text("dropped here by hand")
    said: list[str] = []
    summary = pull(store, tmp_path / "w", step=4, log=said.append)
    assert summary.start == "anchor of step 0"  # around the spoiled anchor
    assert tree_bytes(tmp_path / "w") == tree_bytes(chain[4])
    assert any("holds 'stray.txt', which its manifest does not list" in m for m in said), said
    summary = pull(store, tmp_path / "x", step=3)  # the anchor's own step too
    assert summary.start == "anchor of step 0" and summary.patches == 3
    assert tree_bytes(tmp_path / "x") == tree_bytes(chain[3])


def test_pull_and_the_publish_cache_stay_out_of_the_store(
    published: Path, trainer_chain: list[Path], tmp_path: Path
) -> None:
    """A folder store's objects are never rewritten: pull's output and publish's cache (which
    is rewritten at every publish) may not lie inside it."""
    store = tmp_path / "store"
    shutil.copytree(published, store)
    anchor = next((store / "anchors").glob("00000000-*"))
    before = anchor.read_bytes()
    with pytest.raises(UsageError, match="is inside the store"):
        pull(store, anchor, step=1)  # it holds a step of the store: no -f would be asked
    assert anchor.read_bytes() == before
    with pytest.raises(UsageError, match="--cache .* is inside the store"):
        publish(store, trainer_chain[0], options=PublishOptions(cache_dir=store / "steps"))
    assert not (store / "steps" / "head.json").exists()


def test_a_folder_with_a_non_utf8_name_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chain = generate_chain(tmp_path / "hf", "tiny", steps=1, lr=3e-6, seed=5, shards=2)
    bad = tmp_path / "bad"
    shutil.copytree(chain[1], bad)
    name = os.fsdecode(b"tok\xff.txt")
    (bad / name).write_bytes(b"x")
    for argv in (["hash", str(bad)], ["diff", str(chain[0]), str(bad), "-o", str(tmp_path / "p")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "file name is not valid UTF-8" in err, err
