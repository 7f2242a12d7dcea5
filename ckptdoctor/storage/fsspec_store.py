"""fsspec URLs (``s3://bucket/path``, ``gs://``, ``az://``, ...), imported only when such a URL is given.

Endpoint and credentials come from where fsspec and the backend look already: for S3, the AWS variables and
files (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL``) or fsspec's
``FSSPEC_S3_ENDPOINT_URL``-style variables and config files. Retries are ckptdoctor's (one policy for every
backend), so the S3 client is told not to retry on its own.
"""

from __future__ import annotations

from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.interface import ObjectStore, Stat

_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
_EXTRAS = {"s3fs": "ckptdoctor[s3]"}


def _missing(scheme: str, package: str) -> CkptError:
    target = _EXTRAS.get(package, package)
    return CkptError(f"{scheme}:// URLs need the '{package}' package, which is not installed: pip install '{target}'")


class FsspecStore(ObjectStore):
    """One fsspec filesystem; keys are the filesystem's paths (``bucket/dir/name`` for S3)."""

    def __init__(self, scheme: str) -> None:
        super().__init__()
        self.scheme = scheme
        self.args = (scheme,)
        package = _PACKAGES.get(scheme, "fsspec")
        try:
            import fsspec
            import fsspec.config
        except ImportError:
            raise _missing(scheme, package if package == "s3fs" else "fsspec") from None
        self.options: dict[str, Any] = {}
        configured = fsspec.config.conf.get(scheme, {})
        if scheme in ("s3", "s3a") and "config_kwargs" not in configured:
            # botocore counts max_attempts as retries after the first (2 attempts, with its own backoff):
            # total_max_attempts=1 is one attempt, ours are the only retries
            self.options["config_kwargs"] = {
                "retries": {"total_max_attempts": 1},
                "connect_timeout": 10,
                "read_timeout": 60,
            }
        self.package = package
        self.retries = 1 if "retries" not in configured else None  # s3fs's own retry loop: ours is enough
        self._connect()

    def _connect(self) -> None:
        import fsspec

        try:  # a new instance (not fsspec's cached one): after a fork the parent's is unusable
            self.fs = fsspec.filesystem(self.scheme, skip_instance_cache=True, **self.options)
        except ImportError:
            raise _missing(self.scheme, self.package) from None
        except ValueError as exc:
            raise CkptError(f"{self.scheme}:// URLs are not supported by fsspec ({exc})") from None
        if self.retries is not None and hasattr(self.fs, "retries"):
            self.fs.retries = self.retries

    def url(self, key: str) -> str:
        return f"{self.scheme}://{key}"

    def _put(self, local: str, key: str) -> None:
        self.fs.put_file(local, key)

    def _copy(self, src: str, dst: str) -> None:
        self.fs.cp_file(src, dst)  # S3: CopyObject (UploadPartCopy past 5 GB), no byte through this process

    def copies_to(self, src: str, other: ObjectStore, dst: str) -> bool:
        """One bucket only: a copy across buckets may cross accounts or regions the credentials do not reach."""
        return other is self and src.split("/", 1)[0] == dst.split("/", 1)[0]

    def _ls(self, key: str) -> list[Stat]:
        if not key:
            return []  # not the list of every bucket
        out = []
        for info in self.fs.ls(key, detail=True, refresh=False):
            name = str(info["name"]).rstrip("/")
            if name == key:  # ``ls`` of an object lists the object itself
                continue
            is_dir = info.get("type") == "directory"
            out.append(Stat(name.rpartition("/")[2], 0 if is_dir else int(info.get("size") or 0), is_dir))
        return out

    def _find(self, key: str) -> list[tuple[str, int]]:
        found = self.fs.find(key, detail=True)
        return [
            (name[len(key) + 1 :], int(info.get("size") or 0))
            for name, info in found.items()
            if name.startswith(key + "/") and info.get("type") != "directory"
        ]

    def stat(self, key: str) -> Stat | None:
        if key and "/" not in key:  # a bucket: a directory when it can be listed
            try:
                self.list(key)
            except FileNotFoundError:
                return None
            return Stat(key, 0, True)
        return super().stat(key)

    def _get(self, key: str, offset: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(key, start=offset, end=offset + length))

    def _classify(self, exc: BaseException) -> str | None:
        name = type(exc).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return "no credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
        if "InvalidAccessKeyId" in str(exc) or "SignatureDoesNotMatch" in str(exc):
            return f"credentials refused ({' '.join(str(exc).split())[:200]})"
        if isinstance(exc, (NotADirectoryError, IsADirectoryError)):
            return str(exc)
        return super()._classify(exc)
