"""A store under an ``s3://bucket/prefix`` URL, through boto3 (the ``s3`` extra).

boto3 reads the usual AWS settings: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE,
AWS_DEFAULT_REGION, and AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for S3-compatible servers.
A PUT appears whole or not at all; big objects go up and down in parallel multipart transfers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pulsectl._atomic import os_error, remove
from pulsectl.errors import InputError, IntegrityError, OutputError, UsageError, counted
from pulsectl.store.base import MissingObjectError, ObjectExistsError, Store

MULTIPART_THRESHOLD = 64 * 1024 * 1024
MULTIPART_CHUNK = 64 * 1024 * 1024
MAX_CONCURRENCY = 8
DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes
CHECKSUM_READS = 3  # reads of a small object (a manifest) whose bytes fail S3's checksum


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise UsageError(
            "s3:// stores need boto3, which is not installed: pip install 'boto3>=1.34' (the s3 "
            "extra), or pipe patches through `aws s3 cp - s3://...`"
        ) from None
    return boto3


def _damaged(where: str, exc: Exception) -> IntegrityError:
    """The object's bytes failed S3's own checksum (on the way, or at rest): damaged, as a
    fingerprint mismatch is, so that pull looks for another way (exit 3 when there is none)."""
    return IntegrityError(f"{where}: damaged: S3's checksum does not match ({exc})", path=where)


class S3Store(Store):
    def __init__(self, url: str, *, transfer_config: Any = None) -> None:
        rest = url[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UsageError(f"{url}: no bucket; give s3://BUCKET/PREFIX")
        self.url = url.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        boto3 = _boto3()
        from boto3.s3.transfer import TransferConfig
        from botocore import exceptions as bx

        try:
            self.client = boto3.client("s3")
        except (bx.BotoCoreError, ValueError) as exc:
            # A mistyped AWS_PROFILE, region or AWS_ENDPOINT_URL: botocore says which.
            raise UsageError(f"{self.url}: cannot set up the S3 client: {exc}") from None
        # s3transfer retries a download whose body stalls or breaks off on its own, 5 times
        # unless told; the attempts the user set for botocore (AWS_MAX_ATTEMPTS, max_attempts
        # in ~/.aws/config) bound those too, or a stalled body cost 5 read timeouts whatever
        # was set.
        attempts = (getattr(self.client.meta.config, "retries", None) or {}).get(
            "total_max_attempts"
        )
        self.transfer = transfer_config or TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD,
            multipart_chunksize=MULTIPART_CHUNK,
            max_concurrency=MAX_CONCURRENCY,
            num_download_attempts=attempts if isinstance(attempts, int) and attempts > 0 else 5,
        )

    def _key(self, key: str) -> str:
        return self.prefix + key

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        """Turn botocore's exceptions into one pulsectl line naming the object."""
        from boto3 import exceptions as b3x
        from botocore import exceptions as bx

        where = self.where(key)
        try:
            yield
        except bx.ClientError as exc:
            raise self._client_error(exc, where) from None
        except b3x.S3UploadFailedError as exc:
            # upload_file wraps the ClientError of the part that failed (AccessDenied, a quota).
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, bx.ClientError):
                raise self._client_error(cause, where) from None
            raise InputError(f"{where}: upload failed: {exc}", path=where) from None
        except b3x.RetriesExceededError as exc:
            # download_file gave up: the body broke off, stalled or came damaged every time.
            last = exc.last_exception
            if isinstance(last, bx.FlexibleChecksumError):
                raise _damaged(where, last) from None
            if isinstance(last, bx.ReadTimeoutError):
                timeout = getattr(self.client.meta.config, "read_timeout", None)
                why = f"read timed out (nothing arrived for {timeout} s)"
            else:
                why = str(last)
            attempts = self.transfer.num_download_attempts
            raise InputError(
                f"{where}: download failed after {counted(attempts, 'attempt')}: {why}",
                path=where,
            ) from None
        except bx.FlexibleChecksumError as exc:
            raise _damaged(where, exc) from None
        except bx.NoCredentialsError:
            raise InputError(
                f"{where}: no AWS credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE)",
                path=where,
            ) from None
        except bx.EndpointConnectionError as exc:
            raise InputError(f"{where}: cannot reach S3 ({exc})", path=where) from None
        except bx.BotoCoreError as exc:
            raise InputError(f"{where}: {exc}", path=where) from None

    def _client_error(self, exc: Any, where: str) -> InputError:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        if code in ("NoSuchKey", "404", "NotFound"):
            return MissingObjectError(f"{where}: not in the store", path=where)
        if code == "NoSuchBucket":
            return InputError(
                f"{where}: bucket {self.bucket!r} does not exist (create it, or check "
                "AWS_ENDPOINT_URL)",
                path=where,
            )
        return InputError(f"{where}: S3 error {code}: {err.get('Message', exc)}", path=where)

    def list(self, prefix: str) -> dict[str, int]:
        found: dict[str, int] = {}
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(self.prefix) :]
                    if not key.rsplit("/", 1)[-1].startswith("."):
                        found[key] = int(obj["Size"])
        return found

    def read(self, key: str) -> bytes:
        # botocore does not retry a response whose bytes fail S3's checksum: bytes damaged on
        # the way are read again; only bytes that fail every time are the object's own damage.
        for attempt in range(1, CHECKSUM_READS + 1):
            try:
                with self._errors(key):
                    body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
                    return bytes(body.read())
            except IntegrityError:
                if attempt == CHECKSUM_READS:
                    raise
        raise AssertionError("unreachable")

    def fetch(self, key: str, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._errors(key):
                try:
                    self.client.download_file(
                        self.bucket, self._key(key), str(dest), Config=self.transfer
                    )
                except ConnectionError as exc:
                    where = self.where(key)
                    raise InputError(f"{where}: download broke off: {exc}", path=where) from None
                except OSError as exc:  # the local side: a full disk, a read-only folder
                    raise os_error(exc, dest) from None
        except BaseException:
            remove(dest)
            raise
        return dest

    def write(self, key: str, data: bytes) -> None:
        with self._errors(key):
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def create(self, key: str, data: bytes) -> None:
        """A conditional put (If-None-Match: *): S3 refuses it when the key exists. A server
        that does not implement the condition gets the check-then-put of ``Store.create``."""
        from botocore import exceptions as bx

        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*"
            )
        except bx.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                raise ObjectExistsError(
                    f"{self.where(key)}: already in the store", path=self.where(key)
                ) from None
            if code not in ("NotImplemented", "501"):
                with self._errors(key):
                    raise
            super().create(key, data)
        except bx.ParamValidationError:
            super().create(key, data)  # a botocore from before conditional writes (< 1.35)
        except bx.BotoCoreError:
            with self._errors(key):
                raise

    def upload(self, source: Path, key: str) -> None:
        with self._errors(key):
            self.client.upload_file(str(source), self.bucket, self._key(key), Config=self.transfer)

    def delete(self, keys: Iterable[str]) -> None:
        batch = [self._key(k) for k in keys]
        for i in range(0, len(batch), DELETE_BATCH):
            chunk = batch[i : i + DELETE_BATCH]
            with self._errors(chunk[0][len(self.prefix) :]):
                reply = self.client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
                )
            # A batch delete answers 200 even when it deletes nothing: each refused key is
            # listed in Errors (AccessDenied, say). A missing key is not an error in S3.
            refused = reply.get("Errors") or []
            if refused:
                first = refused[0]
                key = str(first.get("Key", ""))[len(self.prefix) :]
                more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
                raise OutputError(
                    f"{self.where(key)}: S3 refused to delete it: {first.get('Code', '?')}: "
                    f"{first.get('Message', '')}{more}",
                    path=self.where(key),
                )

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key):
                self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except MissingObjectError:
            return False
        return True
