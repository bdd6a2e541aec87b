"""Integrity failures: exit 3 (or 1), one clear line, no output, no temp files, BASE untouched."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
import zstandard
from _faultkit import build_patch, parse_patch
from conftest import tree_bytes
from safetensors.torch import save_file

from pulsectl import format as format_module
from pulsectl.cli.app import main
from pulsectl.codecs import (
    CODEC_CONTEXT,
    CODEC_CONTEXT_PAIRED,
    CODEC_DELTA,
    CODEC_RICE,
    CODEC_RICE_PAIRED,
    CODEC_STORE,
    CODEC_ZSTD,
)
from pulsectl.format import (
    BLOCK_CHECK,
    BLOCK_HEAD,
    FOOTER,
    FRAME_HEAD,
)
from pulsectl.info import read_patch_info


@pytest.fixture
def work(chain: list[Path], tmp_path: Path) -> dict[str, Path]:
    """Steps 0..3 copied into ``in/``, patches p1..p3 in ``patches/``, an empty ``out/``."""
    src, patches, out = tmp_path / "in", tmp_path / "patches", tmp_path / "out"
    for d in (src, patches, out):
        d.mkdir()
    paths: dict[str, Path] = {"out": out}
    for i in range(4):
        paths[f"s{i}"] = src / f"s{i}.safetensors"
        shutil.copy(chain[i], paths[f"s{i}"])
    for i in range(1, 4):
        paths[f"p{i}"] = patches / f"p{i}.pulse"
        argv = [
            "-q",
            "diff",
            str(paths[f"s{i - 1}"]),
            str(paths[f"s{i}"]),
            "-o",
            str(paths[f"p{i}"]),
        ]
        assert main(argv) == 0
    return paths


Capsys = pytest.CaptureFixture[str]


def _fails(cap: Capsys, argv: list[str], code: int, out_dir: Path, watched: list[Path]) -> str:
    """Run ``argv``: exit ``code``, one error line, ``out_dir`` empty, ``watched`` unchanged."""
    cap.readouterr()
    before = {p: tree_bytes(p) for p in watched}
    assert main(argv) == code, argv
    lines = cap.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pulsectl: error: "), lines
    assert list(out_dir.iterdir()) == [], "output or temp files left behind"
    assert {p: tree_bytes(p) for p in watched} == before, "an input was modified"
    return lines[0]


def _apply_argv(w: dict[str, Path], base: str, *patches: str) -> list[str]:
    return ["apply", str(w[base]), *(str(w[p]) for p in patches), "-o", str(w["out"] / "c")]


def test_good_chain_works(work: dict[str, Path]) -> None:
    assert main(_apply_argv(work, "s0", "p1", "p2", "p3")) == 0
    assert (work["out"] / "c").read_bytes() == work["s3"].read_bytes()


def test_wrong_base(work: dict[str, Path], capsys: Capsys) -> None:
    msg = _fails(capsys, _apply_argv(work, "s1", "p1"), 3, work["out"], [work["s1"], work["p1"]])
    assert "wrong base" in msg and str(work["s1"]) in msg and "p1.pulse" in msg
    assert "tensor '" in msg  # names the first tensor that differs


def test_patch_applied_to_its_own_target_says_so(
    work: dict[str, Path], capsys: Capsys, tmp_path: Path
) -> None:
    """Applying a patch twice (or one made with OLD and NEW swapped) is the commonest wrong base:
    the error says the base already holds what the patch writes, not only that it differs."""
    msg = _fails(capsys, _apply_argv(work, "s1", "p1"), 3, work["out"], [work["s1"], work["p1"]])
    assert "already has the bytes the patch writes" in msg and "applied already" in msg, msg
    swapped = tmp_path / "swapped.pulse"
    assert main(["-q", "diff", str(work["s1"]), str(work["s0"]), "-o", str(swapped)]) == 0
    msg = _fails(
        capsys,
        ["apply", str(work["s0"]), str(swapped), "-o", str(work["out"] / "c")],
        3,
        work["out"],
        [work["s0"]],
    )
    assert "OLD and NEW swapped" in msg, msg
    # Any other wrong base keeps the plain message.
    msg = _fails(capsys, _apply_argv(work, "s2", "p1"), 3, work["out"], [work["s2"]])
    assert "already has" not in msg and "the patch expects" in msg, msg


def test_wrong_base_only_in_the_last_tensor(work: dict[str, Path], capsys: Capsys) -> None:
    """The base is checked tensor by tensor as it is read: a base that differs only in its
    last tensor is caught at the end of the pass, and the partial output is removed."""
    from safetensors import safe_open

    with safe_open(str(work["s0"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    last = max(tensors, key=lambda k: _start_of(work["s0"], k))
    tensors[last] = tensors[last].clone()
    tensors[last].view(-1)[-1] += 1
    bad = work["s0"].with_name("bad.safetensors")
    save_file(tensors, str(bad), metadata=meta)
    work["bad"] = bad
    msg = _fails(capsys, _apply_argv(work, "bad", "p1"), 3, work["out"], [bad, work["p1"]])
    assert "wrong base" in msg and f"tensor {last!r}" in msg and "(nothing was written)" in msg


def test_base_differing_only_in_metadata_gives_the_exact_target(work: dict[str, Path]) -> None:
    """Only the bytes a patch reads are its base: other header metadata does not matter, and
    the output is still verified against the target's fingerprints."""
    from safetensors import safe_open

    with safe_open(str(work["s0"]), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    other = work["s0"].with_name("other-meta.safetensors")
    save_file(tensors, str(other), metadata={"note": "re-saved elsewhere"})
    assert other.read_bytes() != work["s0"].read_bytes()
    work["other"] = other
    assert main(_apply_argv(work, "other", "p1")) == 0
    assert (work["out"] / "c").read_bytes() == work["s1"].read_bytes()


def _start_of(path: Path, name: str) -> int:
    import json

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return int(json.loads(raw[8 : 8 + n])[name]["data_offsets"][0])


def test_chain_out_of_order(work: dict[str, Path], capsys: Capsys) -> None:
    msg = _fails(capsys, _apply_argv(work, "s0", "p2", "p1"), 3, work["out"], [work["s0"]])
    assert "out of order" in msg and "p1.pulse" in msg


def test_chain_missing_middle_patch(work: dict[str, Path], capsys: Capsys) -> None:
    msg = _fails(capsys, _apply_argv(work, "s0", "p1", "p3"), 3, work["out"], [work["s0"]])
    assert "out of order" in msg and "p3.pulse" in msg and "missing" in msg


def test_chain_with_a_patch_given_twice(work: dict[str, Path], capsys: Capsys) -> None:
    msg = _fails(capsys, _apply_argv(work, "s0", "p1", "p1"), 3, work["out"], [work["s0"]])
    assert "out of order" in msg and "given twice" in msg
    # A missing patch is not taken for a repeated one.
    msg = _fails(capsys, _apply_argv(work, "s0", "p1", "p3"), 3, work["out"], [work["s0"]])
    assert "given twice" not in msg


def test_chain_out_of_order_from_stdin(
    work: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: Capsys
) -> None:
    """The order check also holds when a patch arrives on stdin (no trailer to peek at)."""
    import io
    import sys

    stdin = io.TextIOWrapper(io.BytesIO(work["p2"].read_bytes()))
    monkeypatch.setattr(sys, "stdin", stdin)
    argv = ["apply", str(work["s0"]), str(work["p1"]), "-", "-o", str(work["out"] / "c")]
    assert main(argv) == 0  # p1 then p2 from stdin: fine
    (work["out"] / "c").unlink()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(work["p3"].read_bytes())))
    msg = _fails(capsys, argv, 3, work["out"], [work["s0"]])
    assert "out of order" in msg


def _largest_frame(patch: Path) -> tuple[int, int, str]:
    """Offset and size of the largest frame's first block payload, and its tensor's name."""
    info = read_patch_info(patch)
    index = max(range(len(info.trailer.items)), key=lambda i: info.trailer.items[i].encoded)
    frame = info.trailer.frames[index]
    data = patch.read_bytes()
    _, _, length = BLOCK_HEAD.unpack_from(data, frame + FRAME_HEAD.size)
    name = info.header.items[index].name
    assert name is not None and length > 16
    return frame + FRAME_HEAD.size + BLOCK_HEAD.size, length, name


def test_corrupted_frame(work: dict[str, Path], capsys: Capsys) -> None:
    start, length, name = _largest_frame(work["p1"])
    data = bytearray(work["p1"].read_bytes())
    data[start + length // 2] ^= 0x10
    work["p1"].write_bytes(data)
    msg = _fails(capsys, _apply_argv(work, "s0", "p1"), 3, work["out"], [work["s0"]])
    assert repr(name) in msg and "p1.pulse" in msg and "damaged" in msg


def test_corrupted_second_patch_removes_first_result(work: dict[str, Path], capsys: Capsys) -> None:
    start, length, name = _largest_frame(work["p2"])
    data = bytearray(work["p2"].read_bytes())
    data[start + 3] ^= 0xFF
    work["p2"].write_bytes(data)
    msg = _fails(capsys, _apply_argv(work, "s0", "p1", "p2", "p3"), 3, work["out"], [work["s0"]])
    assert repr(name) in msg and "p2.pulse" in msg


def test_in_place_failure_leaves_base(work: dict[str, Path], capsys: Capsys) -> None:
    start, length, _ = _largest_frame(work["p1"])
    data = bytearray(work["p1"].read_bytes())
    data[start] ^= 0x01
    work["p1"].write_bytes(data)
    folder = work["s0"].parent
    before = sorted(p.name for p in folder.iterdir())
    _fails(
        capsys, ["apply", str(work["s0"]), str(work["p1"]), "--in-place"], 3, work["out"], [folder]
    )
    assert sorted(p.name for p in folder.iterdir()) == before


def _reseal(data: bytearray, payload_start: int, length: int) -> None:
    """Recompute the block checksum and the file checksum after editing a payload."""
    head = bytes(data[payload_start - BLOCK_HEAD.size : payload_start + length])
    BLOCK_CHECK.pack_into(data, payload_start + length, xxhash.xxh3_64_intdigest(head))
    checksum_at = len(data) - FOOTER.size + 8
    struct.pack_into("<Q", data, checksum_at, xxhash.xxh3_64_intdigest(bytes(data[:checksum_at])))


def test_consistent_but_wrong_payload_fails_the_fingerprint(tmp_path: Path, capsys: Capsys) -> None:
    """A payload edited with valid checksums still cannot produce a wrong output."""
    gen = torch.Generator().manual_seed(0)
    save_file({"w": torch.zeros(64)}, tmp_path / "a.safetensors")
    noise = torch.randint(0, 2**31, (4096,), generator=gen, dtype=torch.int32)
    save_file({"w": torch.zeros(64), "noise": noise}, tmp_path / "b.safetensors")
    p, out = tmp_path / "p.pulse", tmp_path / "out"
    out.mkdir()
    assert (
        main(
            [
                "-q",
                "diff",
                str(tmp_path / "a.safetensors"),
                str(tmp_path / "b.safetensors"),
                "-o",
                str(p),
            ]
        )
        == 0
    )
    info = read_patch_info(p)
    index = [i.name for i in info.header.items].index("noise")
    frame = info.trailer.frames[index]
    data = bytearray(p.read_bytes())
    codec, _, length = BLOCK_HEAD.unpack_from(data, frame + FRAME_HEAD.size)
    assert codec == CODEC_STORE
    payload = frame + FRAME_HEAD.size + BLOCK_HEAD.size
    data[payload + 100] ^= 0x01
    _reseal(data, payload, length)
    p.write_bytes(data)
    assert main(["inspect", "--check", str(p)]) == 0  # the container is intact
    capsys.readouterr()
    argv = ["apply", str(tmp_path / "a.safetensors"), str(p), "-o", str(out / "c")]
    msg = _fails(capsys, argv, 3, out, [tmp_path / "a.safetensors"])
    assert "'noise'" in msg and "fingerprint" in msg


def test_truncated_patch(work: dict[str, Path], capsys: Capsys) -> None:
    full = work["p1"].read_bytes()
    frame_start, length, _ = _largest_frame(work["p1"])
    cuts = [
        0,
        5,
        12,
        30,
        frame_start - 4,
        frame_start + length // 2,
        len(full) - 30,
        len(full) - 17,
        len(full) - 1,
    ]
    for cut in cuts:
        work["p1"].write_bytes(full[:cut])
        msg = _fails(capsys, _apply_argv(work, "s0", "p1"), 3, work["out"], [work["s0"]])
        assert "ends early" in msg or "truncated" in msg, (cut, msg)
        assert "p1.pulse" in msg
        assert main(["inspect", "--check", str(work["p1"])]) in (1, 3)
        assert "ends early" in capsys.readouterr().err or cut < 8


def test_truncated_patch_in_chain(work: dict[str, Path], capsys: Capsys) -> None:
    full = work["p1"].read_bytes()
    work["p1"].write_bytes(full[: len(full) // 2])
    msg = _fails(capsys, _apply_argv(work, "s0", "p1", "p2"), 3, work["out"], [work["s0"]])
    assert "p1.pulse" in msg and ("ends early" in msg or "truncated" in msg)


def test_trailing_garbage(work: dict[str, Path], capsys: Capsys) -> None:
    work["p1"].write_bytes(work["p1"].read_bytes() + b"\0")
    msg = _fails(capsys, _apply_argv(work, "s0", "p1"), 3, work["out"], [work["s0"]])
    assert "p1.pulse" in msg


def test_not_a_patch(work: dict[str, Path], capsys: Capsys) -> None:
    msg = _fails(
        capsys,
        ["apply", str(work["s0"]), str(work["s1"]), "-o", str(work["out"] / "c")],
        1,
        work["out"],
        [work["s0"]],
    )
    assert "not a .pulse patch" in msg


def test_wrong_base_in_folder_names_the_tensor(
    sharded_chain: list[Path], tmp_path: Path, capsys: Capsys
) -> None:
    base, out = tmp_path / "base", tmp_path / "out"
    shutil.copytree(sharded_chain[0], base)
    out.mkdir()
    p = tmp_path / "p.pulse"
    assert main(["-q", "diff", str(base), str(sharded_chain[1]), "-o", str(p)]) == 0
    shard = sorted(base.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last tensor of the last shard
    shard.write_bytes(data)
    msg = _fails(capsys, ["apply", str(base), str(p), "-o", str(out / "c")], 3, out, [base])
    assert "wrong base" in msg and shard.name in msg and "tensor '" in msg

    shard.unlink()  # a missing shard
    msg = _fails(capsys, ["apply", str(base), str(p), "-o", str(out / "c")], 3, out, [base])
    assert "wrong base" in msg and shard.name in msg and "missing" in msg


def test_wrong_layout(
    work: dict[str, Path], sharded_chain: list[Path], tmp_path: Path, capsys: Capsys
) -> None:
    """A folder given as BASE of a single-file patch is refused before anything is written."""
    out = work["out"]
    code = main(["apply", str(sharded_chain[0]), str(work["p1"]), "-o", str(out / "c")])
    assert code in (2, 3)
    assert list(out.iterdir()) == []
    capsys.readouterr()


@pytest.mark.parametrize("workers", [2, 5])
def test_many_workers_many_blocks(chain: list[Path], tmp_path: Path, workers: int) -> None:
    """Small blocks on several workers: every tensor spans many blocks, decoded and written out
    of order, its base hashed in block order. The output is exact; a base wrong in one late
    block of one tensor is refused, naming that tensor, with nothing left behind."""
    from conftest import TEMP_GLOB, patch_bytes

    from pulsectl.apply import apply_patches
    from pulsectl.checkpoint import Checkpoint
    from pulsectl.errors import IntegrityError

    patch = tmp_path / "p.pulse"
    patch.write_bytes(patch_bytes(chain[0], chain[1], block_bytes=4096, workers=workers))
    out = tmp_path / "out.safetensors"
    apply_patches(chain[0], [patch], out, workers=workers)
    assert out.read_bytes() == chain[1].read_bytes()

    info = max(Checkpoint.open(chain[0]).files[0].header.tensors, key=lambda t: t.nbytes)
    assert info.nbytes >= 4 * 4096  # several blocks
    data = bytearray(chain[0].read_bytes())
    at = info.start + info.nbytes - 4096 - 2  # inside its second-to-last block
    data[at] ^= 0x01
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    out2 = tmp_path / "out2.safetensors"
    with pytest.raises(IntegrityError, match=f"tensor {info.name!r} has fingerprint"):
        apply_patches(bad, [patch], out2, workers=workers)
    assert not out2.exists() and not list(tmp_path.glob(TEMP_GLOB))


def test_a_block_waiting_for_a_cancelled_one_is_released() -> None:
    """apply cancels the tasks not yet started when it stops on an error; a later block of the
    same tensor, already waiting for its turn to hash, must not wait forever (it did: CI hung
    in test_many_workers_many_blocks)."""
    import threading

    from pulsectl.apply import _Chain

    abandoned = threading.Event()
    chain = _Chain(abandoned)
    waiter = threading.Thread(target=chain.feed, args=(1, None), daemon=True)  # block 0 never runs
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # still waiting for block 0
    abandoned.set()
    waiter.join(5)
    assert not waiter.is_alive()


def test_fp32_patch_and_bf16_base_mixed_up_name_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's FP32-masters recipe, done wrong either way: the error says which of `--as` and
    `cast` was missed, not only that the base is wrong."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 32)
    w1 = w0 + 1e-2 * torch.randn(64, 32)
    f0, f1 = tmp_path / "m0.f32.safetensors", tmp_path / "m1.f32.safetensors"
    save_file({"w": w0}, str(f0))
    save_file({"w": w1}, str(f1))
    anchor = tmp_path / "anchor.safetensors"
    plain, cast = tmp_path / "plain.pulse", tmp_path / "cast.pulse"
    assert main(["-q", "cast", str(f0), "--to", "bf16", "-o", str(anchor)]) == 0
    assert main(["-q", "diff", str(f0), str(f1), "-o", str(plain)]) == 0
    assert main(["-q", "diff", str(f0), str(f1), "--as", "bf16", "-o", str(cast)]) == 0
    out = tmp_path / "out.safetensors"
    assert main(["apply", str(anchor), str(plain), "-o", str(out)]) == 3
    assert capsys.readouterr().err.strip() == (
        f"pulsectl: error: {anchor}: wrong base for {plain}: tensor 'w' has 4,096 bytes, the "
        "patch's base had 8,192; it is BF16 here, F32 in the patch; the patch was made from F32 "
        "checkpoints: to update their BF16 cast, diff with --as bf16 (or apply the patch to the "
        "checkpoint it was made from)"
    )
    assert main(["apply", str(f0), str(cast), "-o", str(out)]) == 3
    assert capsys.readouterr().err.strip() == (
        f"pulsectl: error: {f0}: wrong base for {cast}: tensor 'w' has 8,192 bytes, the patch's "
        "base had 4,096; it is F32 here, BF16 in the patch; the patch was made with --as bf16: "
        "apply it to the cast of the checkpoint it was made from (pulsectl cast CKPT --to bf16)"
    )
    assert not out.exists()
    assert main(["-q", "apply", str(anchor), str(cast), "-o", str(out)]) == 0


def test_a_folder_whose_config_cast_rewrote_still_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hugging Face folder: `cast` rewrites config.json's torch_dtype, and config.json comes
    before the shards, so its size was the error ('the file has 26 bytes'), not the missed
    step (found in review). The tensor in another dtype is named first."""
    torch.manual_seed(0)
    folders = []
    for step in (0, 1):
        folder = tmp_path / f"m{step}"
        folder.mkdir()
        w = torch.randn(64, 32) + step * 1e-2
        save_file({"w": w}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text('{"torch_dtype": "float32"}')
        folders.append(folder)
    anchor, cast = tmp_path / "anchor", tmp_path / "cast.pulse"
    assert main(["-q", "cast", str(folders[0]), "--to", "bf16", "-o", str(anchor)]) == 0
    assert (anchor / "config.json").stat().st_size != (folders[0] / "config.json").stat().st_size
    assert main(["-q", "diff", *map(str, folders), "--as", "bf16", "-o", str(cast)]) == 0
    out = tmp_path / "out"
    assert main(["apply", str(folders[0]), str(cast), "-o", str(out)]) == 3
    assert capsys.readouterr().err.strip() == (
        f"pulsectl: error: {folders[0] / 'model.safetensors'}: wrong base for {cast}: tensor 'w' "
        "has 8,192 bytes, the patch's base had 4,096; it is F32 here, BF16 in the patch; the "
        "patch was made with --as bf16: apply it to the cast of the checkpoint it was made from "
        "(pulsectl cast CKPT --to bf16)"
    )
    assert not out.exists()
    assert main(["-q", "apply", str(anchor), str(cast), "-o", str(out)]) == 0
    # Only the config differs (no tensor in another dtype): its size is the error.
    (anchor / "config.json").write_text('{"torch_dtype": "bfloat16", "x": 1}')
    assert main(["apply", str(anchor), str(cast), "-o", str(tmp_path / "out2")]) == 3
    assert "config.json: wrong base for" in capsys.readouterr().err


def test_bf16_patch_and_fp8_cast_mixed_up_name_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same mix-up one width down: BF16 checkpoints and their FP8 cast (`diff --as
    f8_e4m3`). b4dbcb6 named the cast for any float base that cast turns into the patch's
    dtype; merged with 9a00068 only an F32/F64 base was, so an `--as f8_e4m3` patch applied to
    the BF16 checkpoint it was made from was told to "apply the patch to the checkpoint it was
    made from"."""
    torch.manual_seed(0)
    w0 = torch.randn(64, 32)
    w1 = w0 + 1e-1 * torch.randn(64, 32)
    b0, b1 = tmp_path / "m0.safetensors", tmp_path / "m1.safetensors"
    save_file({"w": w0.bfloat16()}, str(b0))
    save_file({"w": w1.bfloat16()}, str(b1))
    anchor = tmp_path / "anchor.safetensors"
    plain, cast = tmp_path / "plain.pulse", tmp_path / "cast.pulse"
    assert main(["-q", "cast", str(b0), "--to", "f8_e4m3", "-o", str(anchor)]) == 0
    assert main(["-q", "diff", str(b0), str(b1), "-o", str(plain)]) == 0
    assert main(["-q", "diff", str(b0), str(b1), "--as", "f8_e4m3", "-o", str(cast)]) == 0
    out = tmp_path / "out.safetensors"
    assert main(["apply", str(b0), str(cast), "-o", str(out)]) == 3
    assert capsys.readouterr().err.strip() == (
        f"pulsectl: error: {b0}: wrong base for {cast}: tensor 'w' has 4,096 bytes, the patch's "
        "base had 2,048; it is BF16 here, F8_E4M3 in the patch; the patch was made with --as "
        "f8_e4m3: apply it to the cast of the checkpoint it was made from (pulsectl cast CKPT "
        "--to f8_e4m3)"
    )
    assert main(["apply", str(anchor), str(plain), "-o", str(out)]) == 3
    assert capsys.readouterr().err.strip() == (
        f"pulsectl: error: {anchor}: wrong base for {plain}: tensor 'w' has 2,048 bytes, the "
        "patch's base had 4,096; it is F8_E4M3 here, BF16 in the patch; the patch was made from "
        "BF16 checkpoints: to update their F8_E4M3 cast, diff with --as f8_e4m3 (or apply the "
        "patch to the checkpoint it was made from)"
    )
    assert not out.exists()
    assert main(["-q", "apply", str(anchor), str(cast), "-o", str(out)]) == 0


GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"


def _rewrite(src: Path, dst: Path, block: Any = None) -> None:
    """Copy patch ``src`` to ``dst`` through pulsectl's own reader and writer, every checksum
    and offset recomputed; ``block(codec, payload)`` may give a block new bytes."""
    parts = parse_patch(src.read_bytes())
    frames = [[(c, block(c, p) if block else p) for c, p in f] for f in parts.frames]
    dst.write_bytes(build_patch(parts.header, frames, parts.trailer))


def _longer_last_plane(payload: bytes) -> bytes:
    """A codec 3 payload whose last stored plane has a byte after its zstd frame."""
    count, gap_bytes, word, _ = struct.unpack_from("<IBBH", payload)
    nplanes = gap_bytes + word
    sizes = list(struct.unpack_from(f"<{nplanes}I", payload, 8))
    at = 8 + 4 * nplanes
    planes = []
    for size in sizes:
        planes.append(payload[at : at + size])
        at += size
    last = max(p for p, size in enumerate(sizes) if size)
    planes[last] += b"\0"
    sizes[last] += 1
    head = struct.pack("<IBBH", count, gap_bytes, word, 0) + struct.pack(f"<{nplanes}I", *sizes)
    return head + b"".join(planes)


@pytest.mark.parametrize(
    "where",
    ["header", "codec 2 payload", "codec 3 value plane", "header, a second frame"],
)
def test_bytes_after_a_zstd_frame_are_damage(
    where: str, tmp_path: Path, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FORMAT.md: each is one zstd frame. Bytes after it (another frame too) are refused as
    damage, as a strict reader written from the document refuses them; they used to be
    skipped. The same patch rewritten without them applies (the rewrite is sound)."""
    src = GOLDEN / ("codec3/single.pulse" if "codec 3" in where else "single.pulse")
    base, target = GOLDEN / "single_base.safetensors", GOLDEN / "single_target.safetensors"
    out = tmp_path / "out"
    out.mkdir()
    control = tmp_path / "control.pulse"
    _rewrite(src, control)
    assert main(["-q", "apply", str(base), str(control), "-o", str(out / "t")]) == 0
    assert (out / "t").read_bytes() == target.read_bytes()
    (out / "t").unlink()

    bad = tmp_path / "bad.pulse"
    if where.startswith("header"):
        extra = b"\0\0\0\0" if where == "header" else zstandard.ZstdCompressor().compress(b"{}")
        real = format_module._pack_json
        monkeypatch.setattr(
            format_module,
            "_pack_json",
            lambda obj: real(obj) + extra if "layout" in obj else real(obj),
        )
        _rewrite(src, bad)
        monkeypatch.undo()
        what = "header is damaged"
    elif where == "codec 2 payload":
        _rewrite(src, bad, lambda codec, p: p + b"\0" if codec == CODEC_ZSTD else p)
        what = "damaged zstd data"
    else:
        _rewrite(src, bad, lambda codec, p: _longer_last_plane(p) if codec == CODEC_DELTA else p)
        what = "damaged zstd data"
    msg = _fails(capsys, ["apply", str(base), str(bad), "-o", str(out / "t")], 3, out, [base])
    assert "bad.pulse" in msg and what in msg and "unused data" in msg, msg


def _rice_parts(codec: int, payload: bytes) -> tuple[bytes, bytes, bytes, list[bytes], int]:
    """A codec 4-7 payload as (its fields before the unary stream, the unary stream, the
    remainder stream, the planes' data, the remainder bits used)."""
    count, word = struct.unpack_from("<IB", payload)
    if codec in (CODEC_RICE, CODEC_RICE_PAIRED):
        at, bits = 8, count * payload[5]
    else:
        ncontexts = struct.unpack_from("<H", payload, 8)[0]
        (table_bytes,) = struct.unpack_from("<I", payload, 12)
        table = zstandard.ZstdDecompressor().decompress(payload[16 : 16 + table_bytes])
        ks = np.frombuffer(table, np.uint8, ncontexts, 2 * ncontexts)
        changes = np.frombuffer(table, "<u4", ncontexts, 3 * ncontexts)
        at, bits = 16 + table_bytes, int((ks.astype(np.int64) * changes).sum())
    fields = payload[:at]
    streams = []
    for _ in range(2):
        (size,) = struct.unpack_from("<I", payload, at)
        streams.append(payload[at + 4 : at + 4 + size])
        at += 4 + size
    sizes = struct.unpack_from(f"<{word}I", payload, at)
    at += 4 * word
    planes = []
    for size in sizes:
        planes.append(payload[at : at + size])
        at += size
    return fields, streams[0], streams[1], planes, bits


def _rice_join(fields: bytes, unary: bytes, remainder: bytes, planes: list[bytes]) -> bytes:
    parts = [fields, struct.pack("<I", len(unary)), unary, struct.pack("<I", len(remainder))]
    parts += [remainder, struct.pack(f"<{len(planes)}I", *map(len, planes)), *planes]
    return b"".join(parts)


def _not_canonical(how: str, codec: int, payload: bytes) -> bytes:
    if codec not in (CODEC_CONTEXT, CODEC_RICE, CODEC_RICE_PAIRED, CODEC_CONTEXT_PAIRED):
        return payload
    fields, unary, remainder, planes, bits = _rice_parts(codec, payload)
    assert _rice_join(fields, unary, remainder, planes) == payload
    count = struct.unpack_from("<I", payload)[0]
    if how == "bytes after the last unary code":
        unary += b"\xff\x00"
    elif how == "remainder padding bits set":
        pad = 8 * len(remainder) - bits
        assert 0 <= pad < 8
        remainder = remainder[:-1] + bytes([remainder[-1] | ((1 << pad) - 1)]) if pad else remainder
    else:  # an all-zero plane stored as a frame
        planes = [p or zstandard.ZstdCompressor().compress(bytes(count)) for p in planes]
    return _rice_join(fields, unary, remainder, planes)


@pytest.mark.parametrize(
    "patch", ["json19/single.pulse", "single.pulse", "json19/single_max.pulse", "single_max.pulse"]
)
@pytest.mark.parametrize(
    "how",
    ["bytes after the last unary code", "remainder padding bits set", "a zero plane as a frame"],
)
def test_payloads_writers_would_not_write_still_decode(
    patch: str, how: str, tmp_path: Path
) -> None:
    """FORMAT.md's writer-only rules (a zero plane has size 0, 0-bit padding, nothing after the
    unary codes) do not bind readers: such a payload still has one meaning, and apply gives
    the exact target from it, for codecs 5, 6 (json19/single, single) and 4, 7 (the _max)."""
    base, target = GOLDEN / "single_base.safetensors", GOLDEN / "single_target.safetensors"
    odd = tmp_path / "odd.pulse"
    seen: list[bool] = []

    def change(codec: int, payload: bytes) -> bytes:
        new = _not_canonical(how, codec, payload)
        seen.append(new != payload)
        return new

    _rewrite(GOLDEN / patch, odd, change)
    assert any(seen), "the golden patch has no block this rewrite changes"
    assert main(["-q", "apply", str(base), str(odd), "-o", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t").read_bytes() == target.read_bytes()


def test_a_frame_that_does_not_state_its_size_says_so(
    tmp_path: Path, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FORMAT.md: every frame states its content size. One that did not was reported as
    holding 18446744073709551615 bytes (zstd's 'unknown')."""
    from pulsectl import _zstd
    from pulsectl.errors import CorruptPatchError

    bare = zstandard.ZstdCompressor(write_content_size=False).compress(b"abc")
    with pytest.raises(
        CorruptPatchError, match=r"^zstd frame does not state its size \(expected 3\)$"
    ):
        _zstd.decompress(bare, 3)
    src = GOLDEN / "single.pulse"
    base = GOLDEN / "single_base.safetensors"
    out = tmp_path / "out"
    out.mkdir()
    bad = tmp_path / "bad.pulse"
    monkeypatch.setattr(
        format_module,
        "_pack_json",
        lambda obj: zstandard.ZstdCompressor(write_content_size=False).compress(
            format_module.canonical_json(obj)
        ),
    )
    _rewrite(src, bad)
    monkeypatch.undo()
    msg = _fails(capsys, ["apply", str(base), str(bad), "-o", str(out / "t")], 3, out, [base])
    assert msg.endswith("header is damaged (its zstd frame does not state its size)"), msg
