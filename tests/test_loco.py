"""PULSELoCo (pulsectl.loco): encode, reduce and step against independent torch references."""

from __future__ import annotations

import io
import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pulsectl import loco
from pulsectl.apply import apply_patches
from pulsectl.checkpoint import save_safetensors
from pulsectl.cli.app import main
from pulsectl.errors import CorruptPatchError, InputError, OutputError, UsageError
from pulsectl.info import read_patch_info

torch = pytest.importorskip("torch")

TEMP_GLOB = ".*.pulsectl-tmp-*"
TORCH_VISIBLE = {"bf16": torch.bfloat16, "f16": torch.float16, "f8_e4m3": torch.float8_e4m3fn}


def _model(seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    """FP32 weights with awkward values mixed in: zeros of both signs, subnormals, big ones."""
    rng = np.random.default_rng(seed)
    w = {
        "layer.0.weight": (rng.standard_normal((48, 40)) * scale).astype(np.float32),
        "layer.0.bias": np.zeros(40, np.float32),
        "norm.weight": np.ones(40, np.float32),
        "empty": np.zeros((0, 7), np.float32),
        "big": (rng.standard_normal(300) * 400).astype(np.float32),
    }
    flat = w["layer.0.weight"].reshape(-1)
    flat[:6] = np.array([0.0, -0.0, 1e-40, -1e-41, 3e38, -448.0], np.float32)
    return w


def _step(w: dict[str, np.ndarray], seed: int, size: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (v + rng.standard_normal(v.shape) * size).astype(np.float32) for k, v in w.items()}


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(-1).copy())


def _tbits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy().view(np.uint32)


def _save(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_safetensors(path, {k: ("F32", v.shape, v) for k, v in tensors.items()})
    return path


def _torch_encode(g: np.ndarray, lo: np.ndarray, r: np.ndarray, visible: str):
    """The reference: torch elementwise ops (each one IEEE-rounded) and torch's own casts."""
    tg, tl, tr = _t(g), _t(lo), _t(r)
    s = tr + (tg - tl)
    w = tg - s
    dt = TORCH_VISIBLE[visible]
    size = torch.tensor([], dtype=dt).element_size()
    view = {1: torch.uint8, 2: torch.int16}[size]
    mask = (tg.to(dt).view(view) != w.to(dt).view(view)).numpy()
    residual = s.clone()
    residual[torch.from_numpy(mask)] = 0.0
    return np.flatnonzero(mask), _tbits(s)[mask], _tbits(residual)


# ---------------------------------------------------------------------------------------------
# encode


@pytest.mark.parametrize("visible", list(loco.VISIBLE))
def test_encode_matches_torch_reference(visible: str) -> None:
    g = _model(0)
    lo = _step(g, 1, 2e-3)
    r = _step({k: np.zeros_like(v) for k, v in g.items()}, 2, 1e-4)
    update, residual = loco.encode(g, lo, r, visible=visible)
    assert update.visible == visible and update.kind == loco.KIND_PSEUDO_GRADIENT
    for name in g:
        pos, vals, res = _torch_encode(g[name], lo[name], r[name], visible)
        np.testing.assert_array_equal(update.positions[name], pos)
        np.testing.assert_array_equal(_bits(update.values[name]), vals)
        np.testing.assert_array_equal(_bits(residual[name]), res)
        assert residual[name].shape == g[name].shape


def test_encode_is_sparse_for_small_moves_and_sends_every_crossing() -> None:
    g = _model(3)
    lo = _step(g, 4, 1e-6)
    update, _ = loco.encode(g, lo)
    assert 0 < update.density < 0.2
    none, _ = loco.encode(g, g)
    assert none.sent == 0


@pytest.mark.parametrize("missing", [True, False])
def test_error_feedback_invariant_bitwise(missing: bool) -> None:
    g, lo = _model(5), _step(_model(5), 6, 5e-4)
    r = None if missing else _step({k: np.zeros_like(v) for k, v in g.items()}, 7, 3e-4)
    update, residual = loco.encode(g, lo, r)
    sent = update.dense()
    for name in g:
        rr = np.zeros_like(g[name]) if r is None else r[name]
        s = np.add(rr, np.subtract(g[name], lo[name]))  # R + (G - L) in FP32
        mask = np.zeros(s.size, bool)
        mask[update.positions[name]] = True
        # Each element is either sent or kept: together they are s, bit for bit.
        together = np.where(mask, _bits(sent[name]), _bits(residual[name]))
        np.testing.assert_array_equal(together, _bits(s))
        assert not _bits(residual[name])[mask].any()  # sent entries are +0.0 in R
        assert not _bits(sent[name])[~mask].any()
        np.testing.assert_array_equal(sent[name] + residual[name], s)


def test_error_feedback_accumulates_until_visible() -> None:
    # A move far below the BF16 step is held back, and sent once the residual has grown.
    g = {"w": np.full(1000, 1.0, np.float32)}
    lo = {"w": np.full(1000, 1.0 - 2.0**-12, np.float32)}  # a sixteenth of the BF16 step at 1.0
    r = None
    sent_at = None
    for k in range(1, 40):
        update, r = loco.encode(g, lo, r)
        if update.sent:
            sent_at = k
            break
    assert sent_at is not None and 3 <= sent_at <= 16
    assert update.sent == 1000
    np.testing.assert_array_equal(update.values["w"], np.float32(sent_at * 2.0**-12))


# ---------------------------------------------------------------------------------------------
# reduce and step


def test_reduce_matches_dense_torch_average() -> None:
    g = _model(8)
    updates = [loco.encode(g, _step(g, 10 + k, 1e-3))[0] for k in range(3)]
    avg = loco.reduce(updates)
    assert avg.kind == loco.KIND_AVERAGE and avg.trainers == 3
    dense = avg.dense()
    for name in g:
        acc = torch.zeros(g[name].size)
        for u in updates:
            acc = acc + _t(u.dense()[name])
        want = acc / 3.0
        np.testing.assert_array_equal(_bits(dense[name]), _tbits(want))


def test_reduce_rejects_other_models_and_averages() -> None:
    g = _model(8)
    u = loco.encode(g, _step(g, 1, 1e-3))[0]
    other = dict(g)
    other["extra"] = np.ones(3, np.float32)
    v = loco.encode(other, other)[0]
    with pytest.raises(UsageError, match="'extra' is extra"):
        loco.reduce([u, v])
    with pytest.raises(UsageError, match="not a pseudo-gradient"):
        loco.reduce([loco.reduce([u])])
    with pytest.raises(UsageError):
        loco.reduce([])


@pytest.mark.parametrize("with_momentum", [False, True])
def test_outer_step_matches_torch_ops_bitwise(with_momentum: bool) -> None:
    g = _model(11)
    u = {
        k: v.astype(np.float32)
        for k, v in _step({k: v * 0 for k, v in g.items()}, 12, 1e-3).items()
    }
    m = _step({k: v * 0 for k, v in g.items()}, 13, 1e-3) if with_momentum else None
    new_g, new_m = loco.outer_step(g, u, m, lr=0.7, beta=0.9)
    assert new_m is not None
    lr, beta = torch.tensor(0.7, dtype=torch.float32), torch.tensor(0.9, dtype=torch.float32)
    for name in g:
        tu = _t(u[name])
        tm = tu.clone() if m is None else beta * _t(m[name]) + tu
        d = tu + beta * tm
        want = _t(g[name]) - lr * d
        np.testing.assert_array_equal(_bits(new_g[name]), _tbits(want))
        np.testing.assert_array_equal(_bits(new_m[name]), _tbits(tm))


def test_outer_step_agrees_with_torch_sgd_nesterov() -> None:
    g = _model(14)
    del g["big"]
    m = None
    params = {k: torch.nn.Parameter(_t(v)) for k, v in g.items()}
    opt = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    for k in range(3):
        u = _step({n: v * 0 for n, v in g.items()}, 20 + k, 1e-3)
        g, m = loco.outer_step(g, u, m)
        for name, p in params.items():
            p.grad = _t(u[name])
        opt.step()
    for name, p in params.items():
        np.testing.assert_allclose(g[name].reshape(-1), p.detach().numpy(), rtol=1e-6, atol=1e-9)


def test_plain_step_is_global_minus_update() -> None:
    g = _model(15)
    u = loco.encode(g, _step(g, 16, 1e-3))[0]
    new_g, new_m = loco.outer_step(g, u, plain=True)
    assert new_m is None
    dense = u.dense()
    for name in g:
        np.testing.assert_array_equal(_bits(new_g[name]), _tbits(_t(g[name]) - _t(dense[name])))


# ---------------------------------------------------------------------------------------------
# the patch


def test_patch_roundtrip_multiblock_and_deterministic() -> None:
    g = _model(17)
    update = loco.encode(g, _step(g, 18, 1e-3))[0]
    buf = io.BytesIO()
    loco.write_update(update, buf, block_bytes=4096)  # several blocks per tensor
    back = loco.loads(buf.getvalue())
    assert back.shapes == update.shapes and back.visible == "bf16" and back.trainers == 1
    for name in update.shapes:
        np.testing.assert_array_equal(back.positions[name], update.positions[name])
        np.testing.assert_array_equal(_bits(back.values[name]), _bits(update.values[name]))
    # Same update, same bytes, whatever the order of the tensors.
    shuffled = loco.SparseUpdate(
        dict(reversed(update.shapes.items())), update.positions, update.values
    )
    assert loco.dumps(shuffled) == loco.dumps(update)


def test_patch_is_an_ordinary_pulse_patch_from_zeros(tmp_path: Path) -> None:
    g = _model(19)
    update = loco.encode(g, _step(g, 20, 1e-3))[0]
    patch = tmp_path / "pg.pulse"
    patch.write_bytes(loco.dumps(update))
    info = read_patch_info(patch, check=True)
    assert info.changed_words == update.sent
    assert info.total_words == update.total
    zeros = _save(tmp_path / "zeros.safetensors", {k: np.zeros_like(v) for k, v in g.items()})
    out = tmp_path / "dense.safetensors"
    apply_patches(zeros, [patch], out, workers=1)
    dense = _save(tmp_path / "want.safetensors", update.dense())
    assert out.read_bytes() == dense.read_bytes()


def test_read_rejects_a_plain_patch_and_damage(tmp_path: Path) -> None:
    from pulsectl.diff import diff_checkpoints

    g = _model(21)
    a = _save(tmp_path / "a.safetensors", g)
    b = _save(tmp_path / "b.safetensors", _step(g, 22, 1e-3))
    buf = io.BytesIO()
    diff_checkpoints(a, b, buf)
    with pytest.raises(InputError, match="not a PULSELoCo patch"):
        loco.loads(buf.getvalue())
    data = bytearray(loco.dumps(loco.encode(g, _step(g, 23, 1e-3))[0]))
    data[len(data) // 2] ^= 0x40
    with pytest.raises(CorruptPatchError, match="checksum mismatch"):
        loco.loads(bytes(data))


# ---------------------------------------------------------------------------------------------
# files: atomic updates


@pytest.fixture
def trainer(tmp_path: Path) -> tuple[Path, Path, Path]:
    g = _model(30)
    return (
        _save(tmp_path / "g.safetensors", g),
        _save(tmp_path / "l.safetensors", _step(g, 31, 1e-3)),
        tmp_path / "r.safetensors",
    )


def test_encode_files_creates_then_updates_residual(trainer: tuple[Path, Path, Path]) -> None:
    g, lo, r = trainer
    first = loco.encode_files(g, lo, r, g.parent / "pg1.pulse")
    assert first.residual_created and r.exists()
    second = loco.encode_files(g, lo, r, g.parent / "pg2.pulse")
    assert not second.residual_created
    want_u, want_r = loco.encode(
        loco.load_tensors(g)[0],
        loco.load_tensors(lo)[0],
        loco.encode(loco.load_tensors(g)[0], loco.load_tensors(lo)[0])[1],
    )
    got = loco.read_update(g.parent / "pg2.pulse")
    assert loco.dumps(got) == loco.dumps(want_u)
    for name, arr in loco.load_tensors(r)[0].items():
        np.testing.assert_array_equal(_bits(arr), _bits(want_r[name]))


def test_failed_encode_leaves_the_old_residual(
    trainer: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    g, lo, r = trainer
    loco.encode_files(g, lo, r, g.parent / "pg1.pulse")
    before = r.read_bytes()

    def broken(*args: object, **kwargs: object) -> None:
        raise OutputError("disk full (simulated)")

    # The residual fails as it is closed: by then the patch's temp is written in full.
    monkeypatch.setattr(loco._F32Sink, "close", broken)
    with pytest.raises(OutputError, match="simulated"):
        loco.encode_files(g, lo, r, g.parent / "pg2.pulse")
    assert r.read_bytes() == before
    assert not (g.parent / "pg2.pulse").exists()
    assert not list(g.parent.glob(TEMP_GLOB))
    monkeypatch.undo()
    # An existing output without force: refused before anything is touched.
    with pytest.raises(OutputError, match="exists"):
        loco.encode_files(g, lo, r, g.parent / "pg1.pulse")
    assert r.read_bytes() == before


def test_step_files_requires_momentum_or_plain(trainer: tuple[Path, Path, Path]) -> None:
    g, lo, r = trainer
    pg = g.parent / "pg.pulse"
    loco.encode_files(g, lo, r, pg)
    with pytest.raises(UsageError, match="--momentum"):
        loco.step_files(g, pg, g.parent / "g2.safetensors")
    with pytest.raises(UsageError, match="--plain"):
        loco.step_files(g, pg, g.parent / "g2.safetensors", momentum_path=r, plain=True)


def test_non_f32_input_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    save_safetensors(bad, {"w": ("BF16", [2], np.zeros(2, np.uint16))})
    with pytest.raises(InputError, match="tensor 'w' is BF16"):
        loco.load_tensors(bad)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_encode_reduce_step_matches_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g = _model(40)
    gp = _save(tmp_path / "g.safetensors", g)
    locals_ = [_step(g, 41 + k, 1e-3) for k in range(3)]
    pgs = []
    for k, lo in enumerate(locals_):
        lp = _save(tmp_path / f"l{k}.safetensors", lo)
        pg = tmp_path / f"pg{k}.pulse"
        args = ["-q", "loco", "encode", "--global", str(gp), "--local", str(lp)]
        assert main([*args, "--residual", str(tmp_path / f"r{k}.safetensors"), "-o", str(pg)]) == 0
        pgs.append(pg)
    avg = tmp_path / "avg.pulse"
    assert main(["loco", "reduce", *map(str, pgs), "-o", str(avg), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trainers"] == 3
    dense = tmp_path / "avg.safetensors"
    assert main(["-q", "loco", "reduce", *map(str, pgs), "-o", str(dense), "--dense"]) == 0
    want_avg = loco.reduce([loco.encode(g, lo)[0] for lo in locals_])
    for name, arr in loco.load_tensors(dense)[0].items():
        np.testing.assert_array_equal(_bits(arr), _bits(want_avg.dense()[name]))

    g2, g2_dense, mom = tmp_path / "g2.safetensors", tmp_path / "g2d.safetensors", tmp_path / "m"
    mom = tmp_path / "m.safetensors"
    step = ["-q", "loco", "step", "--global", str(gp)]
    assert main([*step, "--update", str(avg), "--momentum", str(mom), "-o", str(g2)]) == 0
    assert mom.exists()
    mom2 = tmp_path / "m2.safetensors"
    assert main([*step, "-u", str(dense), "-m", str(mom2), "-o", str(g2_dense)]) == 0
    assert g2.read_bytes() == g2_dense.read_bytes()  # sparse or dense update: same result
    want_g, _ = loco.outer_step(g, want_avg)
    for name, arr in loco.load_tensors(g2)[0].items():
        np.testing.assert_array_equal(_bits(arr), _bits(want_g[name]))
    plain = tmp_path / "plain.safetensors"
    assert main([*step, "-u", str(avg), "--plain", "-o", str(plain)]) == 0
    assert main(["inspect", str(avg), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["changed_words"] == want_avg.sent


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = _model(50)
    gp = _save(tmp_path / "g.safetensors", g)
    lp = _save(tmp_path / "l.safetensors", {k: v for k, v in g.items() if k != "big"})
    r = tmp_path / "r.safetensors"
    args = ["loco", "encode", "-g", str(gp), "-l", str(lp), "-r", str(r), "-o", str(tmp_path / "p")]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "pulsectl: error: local does not match global: tensor 'big' is missing; "
        "both must hold the same tensors with the same shapes"
    )
    assert not r.exists()
    assert main([*args[:-2], "-o", str(tmp_path / "p"), "--visible", "f7"]) == 2
    assert "--visible 'f7': choose one of bf16, f16, f8_e4m3;" in capsys.readouterr().err
    assert main(["loco", "reduce", str(gp), "-o", str(tmp_path / "avg")]) == 1
    assert "not a .pulse patch" in capsys.readouterr().err


def test_a_header_claiming_a_huge_tensor_is_refused_without_hashing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A damaged loco header can claim any tensor size; checking that the base is all zeros
    means hashing that many zeros, so it waits until the frames have shown they hold that many
    blocks. Here the header claims 256 GiB and the patch holds one block: refused at the
    frames, with no zeros hashed."""
    from _faultkit import build_patch, parse_patch

    update = loco.SparseUpdate.from_dense({"w": np.array([0, 1.5, 0, 2.0], np.float32)})
    parsed = parse_patch(loco.dumps(update))
    header = parsed.header
    nbytes = 4 * 2**36
    stored = json.dumps(
        {"w": {"dtype": "F32", "shape": [2**36], "data_offsets": [0, nbytes]}},
        separators=(",", ":"),
    )
    stored += " " * (-len(stored) % 8)
    header["files"][0]["header"] = stored
    header["items"][0]["nbytes"] = nbytes
    header["base"]["files"][0]["size"] = 8 + len(stored) + nbytes

    def no_hashing(hasher: object, n: int) -> None:
        raise AssertionError(f"hashed {n:,} zeros")

    monkeypatch.setattr(loco, "_hash_zeros", no_hashing)
    with pytest.raises(CorruptPatchError, match="expected item 0 with 32768 blocks"):
        loco.loads(build_patch(header, parsed.frames, parsed.trailer))


@pytest.mark.parametrize(
    "edit",
    [
        lambda f: f.pop("visible"),  # every loco patch has it (null for mixed gates)
        lambda f: f.update(visible="f32"),
        lambda f: f.update(trainers=0),
        lambda f: f.update(trainers=True),
        lambda f: f.update(kind="sum"),
        lambda f: f.update(version=2),
    ],
)
def test_an_invalid_loco_field_is_a_corrupt_patch(edit: Any) -> None:
    """Found by tests/test_fuzz.py: a 'loco' field without 'visible' passed the check and then
    ended loco.loads in a KeyError (an internal error)."""
    from _faultkit import build_patch, parse_patch

    update = loco.SparseUpdate.from_dense({"w": np.array([0, 1.5, 0, 2.0], np.float32)})
    parsed = parse_patch(loco.dumps(update))
    edit(parsed.header["loco"])
    with pytest.raises(CorruptPatchError, match="the 'loco' header field is not valid"):
        loco.loads(build_patch(parsed.header, parsed.frames, parsed.trailer))


# ---------------------------------------------------------------------------------------------
# CLI: outputs that are inputs, options out of range


@pytest.fixture
def round_files(tmp_path: Path) -> dict[str, Path]:
    """One round's files: G, a trainer's L, its residual R and momentum M (both existing, as
    from an earlier round), its patch PG and the average AVG."""
    g = _model(60)
    files = {
        "G": _save(tmp_path / "G.safetensors", g),
        "L": _save(tmp_path / "L.safetensors", _step(g, 61, 1e-3)),
        "L1": _save(tmp_path / "L1.safetensors", _step(g, 62, 1e-3)),
    }
    files["R"] = tmp_path / "R.safetensors"
    files["PG"] = tmp_path / "PG.pulse"
    common = ["-q", "loco", "encode", "-g", str(files["G"])]
    r0, pg0 = str(files["R"]), str(files["PG"])
    assert main([*common, "-l", str(files["L"]), "-r", r0, "-o", pg0]) == 0
    files["PG1"] = tmp_path / "PG1.pulse"
    r1 = str(tmp_path / "R1.safetensors")
    assert main([*common, "-l", str(files["L1"]), "-r", r1, "-o", str(files["PG1"])]) == 0
    files["AVG"] = tmp_path / "AVG.pulse"
    pgs = [str(files["PG"]), str(files["PG1"])]
    assert main(["-q", "loco", "reduce", *pgs, "-o", str(files["AVG"])]) == 0
    files["M"] = tmp_path / "M.safetensors"
    step = ["-q", "loco", "step", "-g", str(files["G"]), "-u", str(files["AVG"])]
    assert main([*step, "-m", str(files["M"]), "-o", str(tmp_path / "G2.safetensors")]) == 0
    (tmp_path / "G2.safetensors").unlink()
    return files


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _link(kind: str, target: Path, name: str) -> Path:
    """``target`` under another name: the same path spelled otherwise, a symlink or a hard link."""
    if kind == "path":
        return target.parent / "." / target.name
    path = target.parent / name
    if kind == "symlink":
        path.symlink_to(target)
    else:
        path.hardlink_to(target)
    return path


# (command line with {ROLE} for the files, the role written twice, "new" for a path that does
# not exist yet, the two option names the error must give)
COLLISIONS = [
    # encode: the residual is read and rewritten, so it must not be G, L or -o
    ("encode -g {G} -l {L} -r {G} -o {new}", "--residual", "--global"),
    ("encode -g {G} -l {L} -r {L} -o {new}", "--residual", "--local"),
    ("encode -g {G} -l {L} -r {new} -o {new} -f", "-o", "--residual"),
    ("encode -g {G} -l {L} -r {R} -o {R} -f", "-o", "--residual"),
    ("encode -g {G} -l {L} -r {R} -o {G} -f", "-o", "--global"),
    ("encode -g {G} -l {L} -r {R} -o {L} -f", "-o", "--local"),
    # reduce: -o must not be one of the patches
    ("reduce {PG} {PG1} -o {PG1} -f", "-o", "patch 2"),
    ("reduce {PG} {PG1} -o {PG} -f --dense", "-o", "patch 1"),
    # step: the momentum is read and rewritten, so it must not be G, the update or -o
    ("step -g {G} -u {AVG} -m {G} -o {new}", "--momentum", "--global"),
    ("step -g {G} -u {AVG} -m {AVG} -o {new}", "--momentum", "--update"),
    ("step -g {G} -u {AVG} -m {M} -o {M} -f", "-o", "--momentum"),
    ("step -g {G} -u {AVG} -m {new} -o {new}", "-o", "--momentum"),
    ("step -g {G} -u {AVG} -m {M} -o {G} -f", "-o", "--global"),
    ("step -g {G} -u {AVG} -m {M} -o {AVG} -f", "-o", "--update"),
    ("step -g {G} -u {AVG} --plain -o {AVG} -f", "-o", "--update"),
]


@pytest.mark.parametrize(
    ("line", "written", "other", "kind"),
    [
        (*case, kind)
        for case in COLLISIONS
        # a link needs an existing target
        for kind in (["path"] if case[0].count("{new}") > 1 else ["path", "symlink", "hardlink"])
    ],
)
def test_an_output_that_is_another_input_or_output_is_refused(
    round_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    line: str,
    written: str,
    other: str,
    kind: str,
) -> None:
    """Found in review: `loco encode --residual G` replaced the global weights with the
    residual, `-o R` with `--residual R` kept the residual and lost the patch (the sent values:
    error feedback broken), and `loco step -o M --momentum M` dropped the new weights; all
    exit 0. Each role's file must be its own (the same path, a symlink or a hard link to it is
    the same file); nothing is read or written."""
    folder = round_files["G"].parent
    written_role = None  # the second occurrence of a role's file is given as a link to it
    seen: set[str] = set()
    args: list[str] = []
    for word in line.split():
        if word.startswith("{"):
            role = word[1:-1]
            path = folder / "new.out" if role == "new" else round_files[role]
            if role in seen:
                written_role = role
                path = _link(kind, path, f"link-{role}")
            seen.add(role)
            word = str(path)
        args.append(word)
    assert written_role is not None
    before = _snapshot(folder)
    assert main(["loco", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pulsectl: error: "), err
    assert f"{written} " in err and f"is the same file as {other} " in err, err
    assert _snapshot(folder) == before  # nothing written, nothing replaced
    assert not list(folder.glob(TEMP_GLOB))


def test_the_residual_and_momentum_are_read_and_rewritten_round_after_round(
    round_files: dict[str, Path],
) -> None:
    """The error-feedback residual and the momentum buffer are state carried across rounds:
    the same file is their input and their output, by design (also through a link)."""
    f = round_files
    folder = f["G"].parent
    r_before, m_before = f["R"].read_bytes(), f["M"].read_bytes()
    r_link = _link("symlink", f["R"], "R-link.safetensors")
    args = ["-q", "loco", "encode", "-g", str(f["G"]), "-l", str(f["L"]), "-r", str(r_link)]
    assert main([*args, "-o", str(folder / "PG2.pulse")]) == 0
    assert f["R"].read_bytes() != r_before or r_link.read_bytes() != r_before
    step = ["-q", "loco", "step", "-g", str(f["G"]), "-u", str(f["AVG"]), "-m", str(f["M"])]
    assert main([*step, "-o", str(folder / "G3.safetensors")]) == 0
    assert f["M"].read_bytes() != m_before


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--lr", "nan", "--lr nan: the outer learning rate must be finite and > 0"),
        ("--lr", "inf", "--lr inf: the outer learning rate must be finite and > 0"),
        ("--lr", "-5", "--lr -5: the outer learning rate must be finite and > 0"),
        ("--lr", "0", "--lr 0: the outer learning rate must be finite and > 0"),
        ("--lr", "1e-50", "--lr 1e-50: the outer learning rate must be finite and > 0 (it is 0"),
        ("--lr", "1e39", "--lr 1e+39: the outer learning rate must be finite and > 0 (it is inf"),
        ("--beta", "nan", "--beta nan: the outer momentum must be in [0, 1)"),
        ("--beta", "7", "--beta 7: the outer momentum must be in [0, 1)"),
        ("--beta", "1", "--beta 1: the outer momentum must be in [0, 1)"),
        ("--beta", "-0.1", "--beta -0.1: the outer momentum must be in [0, 1)"),
        ("--beta", "-inf", "--beta -inf: the outer momentum must be in [0, 1)"),
        ("--beta", "0.99999999999", "must be in [0, 1) (it is 1 in FP32"),
    ],
)
@pytest.mark.parametrize("state", ["momentum", "plain", "neither", "both"])
def test_step_refuses_a_learning_rate_or_momentum_out_of_range(
    round_files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    option: str,
    value: str,
    message: str,
    state: str,
) -> None:
    """Found in review: `loco step --lr nan` made every weight NaN, and `--lr -5 --beta 7` was
    taken, all with exit 0. The outer step is Nesterov SGD (docs/LOCO.md): lr > 0, momentum in
    [0, 1), both finite as the FP32 values they are rounded to. Refused before any read, also
    with --plain (which does not use them: a bad value is still a mistake), and before
    anything else, as docs/LOCO.md says: `--lr 1e-50` without --momentum or --plain (or with
    both) used to be told about those instead. The line ends with the -h hint."""
    f = round_files
    folder = f["G"].parent
    before = _snapshot(folder)
    given = {
        "momentum": ["-m", str(f["M"])],
        "plain": ["--plain"],
        "neither": [],
        "both": ["--plain", "-m", str(f["M"])],
    }[state]
    args = ["loco", "step", "-g", str(f["G"]), "-u", str(f["AVG"]), *given]
    assert main([*args, "-o", str(folder / "G2.safetensors"), option, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert err.startswith("pulsectl: error: ") and err.endswith(
        "; try 'pulsectl loco step -h' for help\n"
    ), err
    assert _snapshot(folder) == before
    with pytest.raises(UsageError, match=option):
        loco.outer_step({}, {}, **{option[2:]: float(value)})  # type: ignore[arg-type]


@pytest.mark.parametrize(("lr", "beta"), [("1e-30", "0"), ("5", "0.999"), ("0.7", "-0")])
def test_step_takes_any_finite_learning_rate_and_momentum_in_range(
    round_files: dict[str, Path], lr: str, beta: str
) -> None:
    f = round_files
    out = f["G"].parent / "G2.safetensors"
    args = ["-q", "loco", "step", "-g", str(f["G"]), "-u", str(f["AVG"]), "-m", str(f["M"])]
    assert main([*args, "-o", str(out), "--lr", lr, "--beta", beta]) == 0
    assert all(np.isfinite(a).all() for a in loco.load_tensors(out)[0].values())


@pytest.mark.parametrize("kind", ["same", "path", "symlink", "hardlink"])
def test_reduce_refuses_the_same_patch_twice(
    round_files: dict[str, Path], capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Found in review: `loco reduce pg0 pg1 pg0` averaged pg0 twice (one trainer counted
    twice, K = 3). The same file given twice (by path, or through a symlink or hard link) is
    refused before any patch is read. Equal bytes in two different files are not looked for."""
    f = round_files
    folder = f["G"].parent
    again = f["PG"] if kind == "same" else _link(kind, f["PG"], "PG-again.pulse")
    before = _snapshot(folder)
    out = folder / "avg2.pulse"
    assert main(["loco", "reduce", str(f["PG"]), str(f["PG1"]), str(again), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"patch 3 {again} is the same file as patch 1 {f['PG']}" in err, err
    assert "the same update twice would count one trainer twice" in err, err
    assert _snapshot(folder) == before
    # A copy is another file: taken (two trainers may send the same values).
    copy = folder / "PG-copy.pulse"
    copy.write_bytes(f["PG"].read_bytes())
    assert main(["-q", "loco", "reduce", str(f["PG"]), str(copy), "-o", str(out)]) == 0


def test_a_replaced_residual_keeps_its_mode(trainer: tuple[Path, Path, Path]) -> None:
    """Like every replaced output (GUARANTEES.md): a private residual stays private."""
    g, lo, r = trainer
    loco.encode_files(g, lo, r, g.parent / "pg1.pulse")
    r.chmod(0o600)
    loco.encode_files(g, lo, r, g.parent / "pg2.pulse")
    assert stat.S_IMODE(r.stat().st_mode) == 0o600


def test_a_full_disk_names_the_output_not_its_temp(
    trainer: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The residual is written to a temp beside it, removed on failure: the error names R."""
    from _faultkit import tmpfs

    from pulsectl.cli.app import main

    g, lo, _ = trainer
    with tmpfs(tmp_path / "small", "8k") as small:
        r = small / "R.safetensors"
        args = ["loco", "encode", "-g", str(g), "-l", str(lo), "-r", str(r)]
        assert main([*args, "-o", str(tmp_path / "pg.pulse")]) == 1
        assert capsys.readouterr().err == (
            f"pulsectl: error: {r}: no space left on device; free some space or write the "
            "output elsewhere\n"
        )
        assert list(small.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# files: worked through in runs of elements, never whole checkpoints


@pytest.mark.parametrize("run", [7, 64, 1 << 22])
def test_file_commands_in_runs_match_the_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: int
) -> None:
    """encode_files, reduce_files and step_files read and write a run of elements at a time;
    runs that split tensors (7 elements: never aligned to a row or a block) give the bytes of
    the in-memory functions on whole tensors."""
    monkeypatch.setattr(loco, "_RUN", run)
    g = _model(40)
    files = {"G": _save(tmp_path / "g.safetensors", g)}
    updates, residuals = [], []
    for k in range(3):
        local = _step(g, 41 + k, 2e-3)
        files[f"L{k}"] = _save(tmp_path / f"l{k}.safetensors", local)
        r_path = tmp_path / f"r{k}.safetensors"
        prior = None
        if k == 2:  # an existing residual is read in runs too
            prior = _step(_model(49, scale=1e-3), 50, 1e-3)
            _save(r_path, prior)
        summary = loco.encode_files(files["G"], files[f"L{k}"], r_path, tmp_path / f"pg{k}.pulse")
        want_u, want_r = loco.encode(g, local, prior)
        assert (tmp_path / f"pg{k}.pulse").read_bytes() == loco.dumps(want_u)
        assert r_path.read_bytes() == _save(tmp_path / "want_r.safetensors", want_r).read_bytes()
        assert (summary.sent, summary.total) == (want_u.sent, want_u.total)
        updates.append(want_u)
        residuals.append(want_r)
    pgs = [tmp_path / f"pg{k}.pulse" for k in range(3)]
    avg = loco.reduce(updates)
    got = loco.reduce_files(pgs, tmp_path / "avg.pulse")
    assert (tmp_path / "avg.pulse").read_bytes() == loco.dumps(avg)
    assert (got.sent, got.total) == (avg.sent, avg.total)
    got = loco.reduce_files(pgs, tmp_path / "avg.safetensors", dense=True)
    want_dense = _save(tmp_path / "want_avg.safetensors", avg.dense()).read_bytes()
    assert (tmp_path / "avg.safetensors").read_bytes() == want_dense
    assert got.sent == avg.sent
    momentum = _step(_model(51, scale=1e-3), 52, 1e-3)
    for update_path in (tmp_path / "avg.pulse", tmp_path / "avg.safetensors"):
        for case in ("new momentum", "old momentum", "plain"):
            m_path = tmp_path / "m.safetensors"
            m_path.unlink(missing_ok=True)
            if case == "old momentum":
                _save(m_path, momentum)
            out = tmp_path / "g2.safetensors"
            loco.step_files(
                files["G"],
                update_path,
                out,
                momentum_path=None if case == "plain" else m_path,
                plain=case == "plain",
                force=True,
            )
            old_m = momentum if case == "old momentum" else None
            want_g, want_m = loco.outer_step(g, avg, old_m, plain=case == "plain")
            assert out.read_bytes() == _save(tmp_path / "want_g.safetensors", want_g).read_bytes()
            if want_m is not None:
                want = _save(tmp_path / "want_m.safetensors", want_m).read_bytes()
                assert m_path.read_bytes() == want, case


def _file_command_peaks(folder: Path, tensors: int) -> tuple[list[int], int]:
    """Python's peak allocation (numpy's buffers included) in each loco file command on F32
    checkpoints of ``tensors`` tensors of 4 MiB, and the size of one checkpoint."""
    import tracemalloc

    folder.mkdir()
    rng = np.random.default_rng(60)
    g = {f"layer.{i}.weight": (rng.standard_normal((1024, 1024)) * 0.02) for i in range(tensors)}
    g = {n: v.astype(np.float32) for n, v in g.items()}
    local = {n: (v - rng.standard_normal(v.shape) * 3e-4 * abs(v)) for n, v in g.items()}
    gp = _save(folder / "g.safetensors", g)
    lp = _save(folder / "l.safetensors", {n: v.astype(np.float32) for n, v in local.items()})
    del g, local
    pgs = [folder / "pg0.pulse", folder / "pg1.pulse"]
    m = folder / "m.safetensors"
    commands = [
        lambda: loco.encode_files(gp, lp, folder / "r.safetensors", pgs[0]),  # a new residual
        lambda: loco.encode_files(gp, lp, folder / "r.safetensors", pgs[1]),  # an old one
        lambda: loco.reduce_files(pgs, folder / "a.pulse"),
        lambda: loco.reduce_files(pgs, folder / "a.safetensors", dense=True),
        lambda: loco.step_files(gp, folder / "a.pulse", folder / "g2.safetensors", momentum_path=m),
        lambda: loco.step_files(
            gp, folder / "a.safetensors", folder / "g3.safetensors", momentum_path=m
        ),
    ]
    peaks = []
    for command in commands:
        tracemalloc.start()
        try:
            command()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert loco.read_update(pgs[1]).density > 0.02  # not a trivial update
    return peaks, gp.stat().st_size


def test_file_commands_hold_runs_not_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loco commands work a run of elements at a time (here 1 MiB: 4 runs a tensor): their
    peak memory does not grow with the checkpoint. Before, encode held G, L and R whole and
    more (about 7x one checkpoint), so 4x the tensors took about 4x the memory."""
    monkeypatch.setattr(loco, "_RUN", 256 * 1024)
    small, _ = _file_command_peaks(tmp_path / "small", 4)
    large, one = _file_command_peaks(tmp_path / "large", 16)
    mib = [f"{a / 2**20:.1f} -> {b / 2**20:.1f} MiB" for a, b in zip(small, large, strict=True)]
    for a, b in zip(small, large, strict=True):
        assert b < 1.3 * a + 2**21, mib
    assert max(large) < one / 2, mib


def test_an_input_cut_short_while_read_is_named_not_the_output(
    trainer: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """LOCAL is read while the outputs are written (beside it, in its folder): a read error is
    LOCAL's, not taken for an error of the patch's temp; nothing is written."""
    g, lo, r = trainer
    opened = loco._F32Source.__init__

    def open_then_cut(self: Any, path: Any) -> None:
        opened(self, path)
        if Path(path) == lo:
            with open(lo, "r+b") as f:
                f.truncate(lo.stat().st_size - 8)

    monkeypatch.setattr(loco._F32Source, "__init__", open_then_cut)
    with pytest.raises(InputError) as caught:
        loco.encode_files(g, lo, r, g.parent / "pg.pulse")
    assert caught.value.message.startswith(f"{lo}: file is shorter than its header says")
    assert not (g.parent / "pg.pulse").exists() and not r.exists()
    assert not list(g.parent.glob(TEMP_GLOB))


@pytest.mark.parametrize("dense", [False, True])
def test_reduce_checks_each_patch_to_its_end(
    trainer: tuple[Path, Path, Path], dense: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: streaming, reduce (patch output) never resumed its reader after the
    last tensor, so a patch cut short in its trailer (a copy still arriving) was averaged and
    written (exit 0). Every patch is read to its end, trailer and fingerprints, first."""
    g, lo, r = trainer
    pg = g.parent / "pg.pulse"
    loco.encode_files(g, lo, r, pg)
    cut = g.parent / "cut.pulse"
    cut.write_bytes(pg.read_bytes()[:-40])
    out = g.parent / ("avg.safetensors" if dense else "avg.pulse")
    args = ["loco", "reduce", str(pg), str(cut), "-o", str(out)] + (["--dense"] if dense else [])
    assert main(args) == 3
    err = capsys.readouterr().err
    assert err.startswith(f"pulsectl: error: {cut}: ") and err.count("\n") == 1, err
    assert not out.exists() and not list(g.parent.glob(TEMP_GLOB))
    with pytest.raises(CorruptPatchError):
        loco.step_files(g, cut, g.parent / "g2.safetensors", plain=True)
    assert not (g.parent / "g2.safetensors").exists()


def test_a_patch_not_laid_out_by_name_is_refused(tmp_path: Path) -> None:
    """FORMAT.md: a loco patch's tensors are laid out by name. The commands read several
    patches side by side in that order; one laid out otherwise (every checksum valid) had its
    tensors' values swapped (found in review). It is refused, as not a loco patch."""
    import math

    from pulsectl.checkpoint import HEADER_ALIGN, parse_header

    def by_name_reversed(shapes: dict[str, tuple[int, ...]]) -> Any:
        doc, offset = {}, 0
        for name in sorted(shapes, reverse=True):
            nbytes = 4 * math.prod(shapes[name])
            doc[name] = {
                "dtype": "F32",
                "shape": list(shapes[name]),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(doc, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % HEADER_ALIGN)
        return parse_header(raw, 8 + len(raw) + offset, "<reversed>")

    update = loco.SparseUpdate.from_dense(
        {"a": np.full(16, 1.0, np.float32), "b": np.full((4, 4), 1000.0, np.float32)}
    )
    st = by_name_reversed(update.shapes)
    runs = iter([(update.positions[t.name], update.values[t.name]) for t in st.tensors])
    buf = io.BytesIO()
    real = loco._target_header
    loco._target_header = by_name_reversed  # type: ignore[assignment]
    try:
        loco._write_patch(buf, update.shapes, loco._loco_doc(update.kind, 1, "bf16"), runs)
    finally:
        loco._target_header = real  # type: ignore[assignment]
    patch = tmp_path / "reversed.pulse"
    patch.write_bytes(buf.getvalue())
    assert [i["name"] for i in read_patch_info(patch).to_json()["tensors"]] == ["b", "a"]
    with pytest.raises(CorruptPatchError, match="tensors are not laid out by name"):
        loco.read_update(patch)
    with pytest.raises(CorruptPatchError, match="tensors are not laid out by name"):
        loco.reduce_files([patch], tmp_path / "avg.pulse")
    assert not (tmp_path / "avg.pulse").exists()


def test_two_nans_give_the_first_ones_quieted_whatever_the_run() -> None:
    """IEEE 754 leaves open which NaN comes of two; numpy's loops give either operand's, by
    the array's length (found in review: a streamed last run and the whole tensor differed).
    loco takes the first operand's, quieted, so the file commands (runs) and the library
    (whole tensors) agree bit for bit."""
    first = np.array([0x7FC00001, 0xFF800002, 0x7FC00003], np.uint32).view(np.float32)
    second = np.array([0xFFC00004, 0x7FC00005, 0x3F800000], np.uint32).view(np.float32)
    for n in (1, 3, 5, 17, 1031):  # the scalar tail and the vector body of numpy's loops
        x, y = np.resize(first, n), np.resize(second, n)
        with np.errstate(all="ignore"):
            got = loco._ieee(np.add, x, y).view(np.uint32)
        want = np.resize(np.array([0x7FC00001, 0xFFC00002, 0x7FC00003], np.uint32), n)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("run", [7, 1 << 22])
def test_file_commands_with_nans_match_the_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: int
) -> None:
    """NaNs of several payloads in G, L, R and the momentum, meeting in one operation: the file
    commands (in runs) and the library (whole tensors) give the same bytes."""
    monkeypatch.setattr(loco, "_RUN", run)
    rng = np.random.default_rng(70)

    def with_nans(seed: int) -> dict[str, np.ndarray]:
        w = _model(seed)
        flat = w["big"].reshape(-1)
        at = rng.choice(flat.size, 40, replace=False)
        flat.view(np.uint32)[at] = rng.integers(0x7F800001, 0x7FFFFFFF, 40, dtype=np.uint32) | (
            rng.integers(0, 2, 40, dtype=np.uint32) << 31
        )
        return w

    g, local, residual, momentum = (with_nans(s) for s in (71, 72, 73, 74))
    gp, lp = _save(tmp_path / "g.safetensors", g), _save(tmp_path / "l.safetensors", local)
    rp, pg = _save(tmp_path / "r.safetensors", residual), tmp_path / "pg.pulse"
    loco.encode_files(gp, lp, rp, pg)
    want_u, want_r = loco.encode(g, local, residual)
    assert pg.read_bytes() == loco.dumps(want_u)
    assert rp.read_bytes() == _save(tmp_path / "want_r.safetensors", want_r).read_bytes()
    avg = tmp_path / "avg.pulse"
    other = tmp_path / "pg1.pulse"
    loco.encode_files(gp, lp, tmp_path / "r1.safetensors", other)
    loco.reduce_files([pg, other], avg)
    want_avg = loco.reduce([want_u, loco.encode(g, local)[0]])
    assert avg.read_bytes() == loco.dumps(want_avg)
    mp = _save(tmp_path / "m.safetensors", momentum)
    out = tmp_path / "g2.safetensors"
    loco.step_files(gp, avg, out, momentum_path=mp)
    want_g, want_m = loco.outer_step(g, want_avg, momentum)
    assert out.read_bytes() == _save(tmp_path / "want_g.safetensors", want_g).read_bytes()
    assert want_m is not None
    assert mp.read_bytes() == _save(tmp_path / "want_m.safetensors", want_m).read_bytes()
