"""S3 stores against a real S3-compatible server (moto_server on 127.0.0.1), through boto3 and
through the `aws` CLI in pipes."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pulsectl.store import PublishOptions, StepUnreachableError, open_store, prune, publish, pull
from pulsectl.store.layout import manifest_key
from pulsectl.synth import generate_chain

boto3 = pytest.importorskip("boto3", reason="boto3 not installed: pip install 'pulsectl[s3]'")
pytest.importorskip("moto", reason="moto not installed: pip install 'moto[server]'")


def _script(name: str) -> str | None:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


MOTO = _script("moto_server")
AWS = _script("aws")
PULSECTL = _script("pulsectl")
BUCKET = "runs"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on a free port, stopped after; the env a client needs to reach it."""
    if MOTO is None:
        pytest.skip("moto_server not installed: pip install 'moto[server]'")
    port = _free_port()
    proc = subprocess.Popen(
        [MOTO, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("moto_server did not start")
                time.sleep(0.1)
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": url,
        }
        yield env
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    if BUCKET not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=BUCKET)
    return s3_env


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return generate_chain(tmp_path_factory.mktemp("s3chain"), "tiny", steps=12, lr=3e-6, seed=31)


def sh(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    path = os.pathsep.join(str(Path(p).parent) for p in (PULSECTL, AWS) if p)
    full = {**os.environ, **env, "PATH": f"{path}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", f"set -o pipefail; {script}"],
        cwd=cwd,
        capture_output=True,
        env=full,
        timeout=120,
    )


def test_publish_pull_prune_over_s3(s3: dict[str, str], chain: list[Path], tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/run1"
    opts = PublishOptions(anchor_every=5, cache_dir=tmp_path / "cache")
    for p in chain:
        publish(url, p, options=opts)
    keys = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="run1/")["Contents"]
    names = {k["Key"] for k in keys}
    assert f"run1/{manifest_key(12)}" in names and "run1/pulse-store.json" in names
    out = tmp_path / "w.safetensors"
    summary = pull(url, out, step=7)
    assert summary.start == "anchor of step 5" and out.read_bytes() == chain[7].read_bytes()
    summary = pull(url, out)
    assert summary.start == "local copy of step 7" and out.read_bytes() == chain[12].read_bytes()

    # A damaged patch on S3: fall back to anchor 10, never a wrong checkpoint.
    store = open_store(url)
    import json

    m9 = json.loads(store.read(manifest_key(9)))
    boto3.client("s3").put_object(Bucket=BUCKET, Key=f"run1/{m9['patch']['key']}", Body=b"rot")
    shutil.copy(chain[6], out)
    with pytest.raises(StepUnreachableError):
        pull(url, out, step=9)
    assert out.read_bytes() == chain[6].read_bytes()
    summary = pull(url, out, step=11)
    assert summary.start == "anchor of step 10" and summary.problems
    assert out.read_bytes() == chain[11].read_bytes()

    plan = prune(url, keep_anchors=1, keep_steps=2)
    assert plan.kept_steps == (10, 11, 12)
    left = {
        k["Key"]
        for k in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="run1/")["Contents"]
    }
    assert f"run1/{manifest_key(3)}" not in left and f"run1/{manifest_key(10)}" in left
    assert pull(url, tmp_path / "x.safetensors", step=10).step == 10


def test_multipart_upload(s3: dict[str, str], tmp_path: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    from pulsectl.store.s3 import S3Store

    mib = 1024 * 1024
    store = S3Store(
        f"s3://{BUCKET}/big",
        transfer_config=TransferConfig(multipart_threshold=5 * mib, multipart_chunksize=5 * mib),
    )
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 * mib))
    store.upload(src, "anchors/00000000-00.safetensors")
    head = boto3.client("s3").head_object(Bucket=BUCKET, Key="big/anchors/00000000-00.safetensors")
    assert head["ETag"].strip('"').endswith("-3")  # three parts
    back = store.fetch("anchors/00000000-00.safetensors", tmp_path / "back.bin")
    assert back.read_bytes() == src.read_bytes()


@pytest.mark.skipif(
    AWS is None or PULSECTL is None, reason="awscli not installed: pip install awscli"
)
def test_aws_cli_pipes(s3: dict[str, str], chain: list[Path], tmp_path: Path) -> None:
    shutil.copy(chain[0], tmp_path / "a.safetensors")
    shutil.copy(chain[3], tmp_path / "b.safetensors")
    # Without the store: a patch through `aws s3 cp` both ways.
    r = sh(
        f"pulsectl diff a.safetensors b.safetensors | aws s3 cp - s3://{BUCKET}/pipe/p.pulse"
        f" && aws s3 cp s3://{BUCKET}/pipe/p.pulse -"
        " | pulsectl apply a.safetensors - -o c.safetensors"
        " && cmp c.safetensors b.safetensors",
        tmp_path,
        s3,
    )
    assert r.returncode == 0, r.stderr
    # A store published with `pulsectl publish` (boto3), mirrored with `aws s3 sync`, pulled
    # from the mirror and from S3 by the CLI.
    r = sh(
        f"for i in 0 1 2 3; do pulsectl -q publish s3://{BUCKET}/cli step_00$i.safetensors"
        " -k 3 --cache cache || exit 1; done"
        f" && aws s3 sync --only-show-errors s3://{BUCKET}/cli mirror"
        " && pulsectl pull mirror -o m.safetensors && cmp m.safetensors step_003.safetensors"
        f" && pulsectl pull s3://{BUCKET}/cli -o w.safetensors --step 2"
        " && cmp w.safetensors step_002.safetensors"
        f" && pulsectl log s3://{BUCKET}/cli",
        chain[0].parent,
        s3,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines()[-1].split()[:2] == ["3", "anchor"]
    for name in ("cache", "mirror", "m.safetensors", "w.safetensors"):
        target = chain[0].parent / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()


def test_missing_boto3_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hint names the package itself: `pip install pulsectl[s3]` outside this project's
    environment fetches an unrelated PyPI project of that name."""
    from pulsectl.cli.app import main

    monkeypatch.setitem(sys.modules, "boto3", None)
    assert main(["log", f"s3://{BUCKET}/x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "pulsectl: error: s3:// stores need boto3, which is not installed: pip install "
        "'boto3>=1.34' (the s3 extra), or pipe patches through `aws s3 cp - s3://...`"
    )


def test_a_manifest_is_created_once(s3: dict[str, str], chain: list[Path], tmp_path: Path) -> None:
    """Two publishers of one step (a restarted trainer racing its old process): the
    conditional put (If-None-Match: *) lets the first manifest stand and refuses the second."""
    from pulsectl.store.base import ObjectExistsError

    store = open_store(f"s3://{BUCKET}/once")
    store.create("steps/00000001.json", b"first")
    # Only the conditional PUT may refuse: a check before it would race (it is told nothing).
    store.exists = lambda key: False  # type: ignore[method-assign]
    with pytest.raises(ObjectExistsError, match="once/steps/00000001.json: already in the store"):
        store.create("steps/00000001.json", b"second")
    assert store.read("steps/00000001.json") == b"first"


def test_a_server_without_conditional_puts_gets_a_check_first(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server (or an old botocore) that does not know If-None-Match: the create falls back
    to a check, then a plain PUT."""
    from botocore.exceptions import ClientError

    from pulsectl.store.base import ObjectExistsError

    store = open_store(f"s3://{BUCKET}/nocond")
    real = store.client.put_object

    def no_condition(**kw: object) -> object:
        if "IfNoneMatch" in kw:
            error = {"Error": {"Code": "NotImplemented", "Message": "not here"}}
            raise ClientError(error, "PutObject")  # type: ignore[arg-type]
        return real(**kw)

    monkeypatch.setattr(store.client, "put_object", no_condition)
    store.create("steps/00000002.json", b"first")
    with pytest.raises(ObjectExistsError):
        store.create("steps/00000002.json", b"second")
    assert store.read("steps/00000002.json") == b"first"


def test_prune_reports_keys_s3_refused_to_delete(
    s3: dict[str, str], chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeleteObjects answers 200 with the refused keys in Errors: prune must not say it
    deleted them."""
    from pulsectl.errors import OutputError

    url = f"s3://{BUCKET}/refused"
    for p in chain[:3]:
        publish(url, p, options=PublishOptions(anchor_every=1, cache_dir=tmp_path / "c"))
    store = open_store(url)

    def refuse(**kw: object) -> dict[str, object]:
        objects = kw["Delete"]["Objects"]  # type: ignore[index]
        return {
            "Errors": [{"Key": o["Key"], "Code": "AccessDenied", "Message": "no"} for o in objects]
        }

    monkeypatch.setattr(store.client, "delete_objects", refuse)
    with pytest.raises(OutputError, match=r"S3 refused to delete it: AccessDenied: no \(and"):
        prune(store, keep_anchors=1, keep_steps=1)
    assert store.exists(manifest_key(0))


def test_s3_client_setup_errors_are_one_line(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped AWS_PROFILE or AWS_ENDPOINT_URL is a usage error naming the setting, not a
    traceback."""
    from pulsectl.cli.app import main

    url = f"s3://{BUCKET}/setup"
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    assert main(["log", url]) == 2
    assert capsys.readouterr().err == (
        f"pulsectl: error: {url}: cannot set up the S3 client: The config profile "
        "(no-such-profile) could not be found\n"
    )
    monkeypatch.delenv("AWS_PROFILE")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "minio:9000")
    assert main(["log", url]) == 2
    assert capsys.readouterr().err == (
        f"pulsectl: error: {url}: cannot set up the S3 client: Invalid endpoint: minio:9000\n"
    )


def test_a_refused_upload_is_one_line(s3: dict[str, str], tmp_path: Path) -> None:
    """upload_file wraps the server's refusal in its own exception: it is still named."""
    from pulsectl.errors import InputError

    source = tmp_path / "x.pulse"
    source.write_bytes(b"x" * 100)
    store = open_store("s3://no-such-bucket-here/p")
    with pytest.raises(InputError, match="bucket 'no-such-bucket-here' does not exist"):
        store.upload(source, "patches/x.pulse")


def test_a_lost_reply_to_the_conditional_put_is_not_a_lost_race(
    s3: dict[str, str], chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore retries a PUT whose reply was lost; the retry meets the object the first
    attempt made and S3 answers 412. The manifest is this run's: the step is published."""
    from botocore.exceptions import ClientError

    url = f"s3://{BUCKET}/lost-reply"
    store = open_store(url)
    real = store.client.put_object

    def reply_lost(**kw: object) -> object:
        real(**kw)
        if "IfNoneMatch" in kw:  # as the retry would end
            error = {"Error": {"Code": "PreconditionFailed", "Message": "At least one"}}
            raise ClientError(error, "PutObject")  # type: ignore[arg-type]
        return None

    monkeypatch.setattr(store.client, "put_object", reply_lost)
    opts = PublishOptions(cache_dir=tmp_path / "cache")
    assert publish(store, chain[0], options=opts).manifest.step == 0
    monkeypatch.setattr(store.client, "put_object", real)
    assert publish(url, chain[1], options=opts).manifest.kind == "patch"


def test_s3_pull_into_a_full_disk_names_the_output(
    s3: dict[str, str],
    chain: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from _faultkit import tmpfs

    from pulsectl.cli.app import main

    url = f"s3://{BUCKET}/fulldisk"
    publish(url, chain[0], options=PublishOptions(cache_dir=tmp_path / "cache"))
    with tmpfs(tmp_path / "small", "40k") as small:
        out = small / "m.safetensors"
        assert main(["pull", url, "-o", str(out), "-q"]) == 1
        assert capsys.readouterr().err == (
            f"pulsectl: error: {out}: no space left on device; free some space or write the "
            "output elsewhere\n"
        )
        assert list(small.iterdir()) == []


def test_log_and_prune_of_a_mistyped_prefix_are_errors(
    s3: dict[str, str], chain: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pulsectl.cli.app import main

    publish(f"s3://{BUCKET}/real", chain[0], options=PublishOptions(cache_dir=tmp_path / "c"))
    url = f"s3://{BUCKET}/reall"
    assert main(["log", url]) == 1
    assert capsys.readouterr().err == (
        f"pulsectl: error: {url}: not a pulsectl store (no pulse-store.json and no published "
        "step); check the path\n"
    )
    assert main(["prune", url, "--keep-anchors", "1", "--keep-steps", "1"]) == 1
    assert "not a pulsectl store" in capsys.readouterr().err


class _FlipProxy:
    """A TCP proxy in front of the S3 server that flips the first body byte of each response
    to a request naming ``key_part``: bytes damaged on their way from S3."""

    def __init__(self, port: int, key_part: str, times: int | None = None) -> None:
        import threading

        self.target, self.key_part = port, key_part.encode()
        self.flipped = 0
        self.times = times  # responses to flip (None: every one)
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            state = {"pending": False}
            threading.Thread(
                target=self._requests, args=(client, upstream, state), daemon=True
            ).start()
            threading.Thread(
                target=self._responses, args=(upstream, client, state), daemon=True
            ).start()

    def _requests(self, src: socket.socket, dst: socket.socket, state: dict) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if data[:4] in (b"GET ", b"HEAD") and self.key_part in data.split(b"\r\n", 1)[0]:
                    more = self.times is None or self.flipped < self.times
                    state["pending"] = data[:4] == b"GET " and more
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _responses(self, src: socket.socket, dst: socket.socket, state: dict) -> None:
        in_body = False
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if state["pending"]:
                    buf = bytearray(data)
                    at = 0
                    if not in_body:
                        end = data.find(b"\r\n\r\n")
                        in_body, at = end >= 0, end + 4
                    if in_body and at < len(buf):
                        buf[at] ^= 0x01
                        state["pending"], in_body = False, False
                        self.flipped += 1
                    data = bytes(buf)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.server.close()


def test_bytes_damaged_on_their_way_from_s3_are_a_damaged_object(
    s3: dict[str, str], chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore's own checksum caught a flipped byte of a patch, and pull ended with exit 1
    and botocore's message, though anchor 6 was a route; such an object is damaged (pull
    goes round it, or exit 3 when there is no way left)."""
    import json

    from pulsectl.errors import IntegrityError

    url = f"s3://{BUCKET}/flip"
    opts = PublishOptions(anchor_every=3, cache_dir=tmp_path / "cache")
    for p in chain[:7]:
        publish(url, p, options=opts)
    m5 = json.loads(open_store(url).read(manifest_key(5)))
    proxy = _FlipProxy(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), m5["patch"]["key"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
        out = tmp_path / "w.safetensors"
        shutil.copy(chain[4], out)
        summary = pull(url, out, step=6)
        assert proxy.flipped and out.read_bytes() == chain[6].read_bytes()
        assert summary.start == "anchor of step 6"
        assert any("S3's checksum does not match" in p for p in summary.problems)
        store = open_store(url)
        with pytest.raises(IntegrityError, match="damaged: S3's checksum does not match"):
            store.fetch(m5["patch"]["key"], tmp_path / "p.pulse")
        assert not (tmp_path / "p.pulse").exists()
    finally:
        proxy.close()


def test_download_attempts_follow_aws_max_attempts(
    s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """s3transfer retried a stalled body 5 times (5 read timeouts of 60 s) whatever
    AWS_MAX_ATTEMPTS said; the attempts set for botocore bound it too."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert open_store(f"s3://{BUCKET}/x").transfer.num_download_attempts == 1
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    assert open_store(f"s3://{BUCKET}/x").transfer.num_download_attempts == 5


def test_a_manifest_damaged_on_its_way_once_is_read_again(
    s3: dict[str, str], chain: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore does not retry a response that fails S3's checksum; a manifest flipped once on
    the way is read again. Flipped on every read, it is a damaged step (pull takes the step
    before it, with a warning), not the end of the command."""
    from pulsectl.store import read_log

    url = f"s3://{BUCKET}/flip-manifest"
    opts = PublishOptions(cache_dir=tmp_path / "cache")
    for p in chain[:3]:
        publish(url, p, options=opts)
    port = int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    out = tmp_path / "w.safetensors"
    for times, step in ((1, 2), (None, 1)):
        proxy = _FlipProxy(port, manifest_key(2), times=times)
        try:
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
            kinds = [s["kind"] for s in read_log(url)["steps"]]
            assert kinds == ["anchor", "patch", "patch" if times else "damaged"]
            assert pull(url, out, force=True).step == step
            assert out.read_bytes() == chain[step].read_bytes()
            assert proxy.flipped >= 1
        finally:
            proxy.close()
