"""multi-storage-client URLs (``msc://profile/path``), as Megatron's ``--enable-msc`` reads them.

The profile comes from the user's MSC configuration (``MSC_CONFIG``, ``~/.msc_config.yaml``, ...), where its
storage provider, endpoint and credentials are set; ckptdoctor adds nothing. Ranged reads use
``StorageClient.read(path, byte_range=Range(offset, size))``: no file is downloaded whole.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.interface import ObjectStore, Stat, StorageUnavailable, without_credentials


class MscStore(ObjectStore):
    """One MSC profile; keys are paths below the profile's base path."""

    scheme = "msc"

    def __init__(self, profile: str) -> None:
        super().__init__()
        self.profile = profile
        self.args = (profile,)
        try:
            import multistorageclient
            from multistorageclient.types import Range
        except ImportError:
            raise CkptError(
                "msc:// URLs need the 'multi-storage-client' package, which is not installed: "
                "pip install 'ckptdoctor[msc]'"
            ) from None
        # MSC logs each failed request at ERROR ("Non-retryable error occurred ...") through logging's last-resort
        # handler (stderr) when the application configures none: the one line a failure is here says it instead
        msc_logger = logging.getLogger("multistorageclient")
        if not msc_logger.handlers:
            msc_logger.addHandler(logging.NullHandler())
            msc_logger.propagate = False
        self._range = Range
        self._client_for = multistorageclient.StorageClient
        self._config_for = multistorageclient.StorageClientConfig.from_file
        self._connect()

    def _classify(self, exc: BaseException) -> str | None:
        """MSC wraps the S3 client's errors in its own (a RuntimeError naming the status code): what no retry cures
        fails at once, as for ``s3://``."""
        text = " ".join(str(exc).split())
        chain = f"{type(exc).__name__} {text} {type(exc.__cause__).__name__ if exc.__cause__ else ''}"
        if "NoCredentialsError" in chain or "Unable to locate credentials" in text:
            return "no credentials (set them in the MSC profile or the environment)"
        if "InvalidAccessKeyId" in text or "SignatureDoesNotMatch" in text:
            return f"credentials refused ({without_credentials(text)[:200]})"
        if "status_code: 403" in text or "AccessDenied" in text:
            return "access denied"
        if "NoSuchBucket" in text:
            return "no such bucket"
        return super()._classify(exc)

    def _connect(self) -> None:
        # a client of our own from the configuration as it is now, not resolve_storage_client's process-wide cache:
        # forget_stores() promises the next URL reads the environment again (a changed MSC_CONFIG or endpoint)
        try:
            self.client: Any = self._client_for(self._config_for(profile=self.profile))
        except Exception as exc:  # an unknown profile or a bad config: MSC raises various types
            raise StorageUnavailable(
                f"msc://{self.profile}: cannot use this MSC profile "
                f"({type(exc).__name__}: {without_credentials(' '.join(str(exc).split()))})"
            ) from None

    def url(self, key: str) -> str:
        return f"msc://{self.profile}/{key}"

    def _put(self, local: str, key: str) -> None:
        self.client.upload_file(remote_path=key, local_path=local)

    def _copy(self, src: str, dst: str) -> None:
        self.client.copy(src, dst)  # the profile's provider copies on the server (S3: CopyObject)

    def _ls(self, key: str) -> list[Stat]:
        prefix = f"{key}/" if key else ""
        out = []
        for meta in self.client.list(prefix, include_directories=True):
            name = str(meta.key).rstrip("/")
            if not name.startswith(prefix) or name == key:
                continue
            is_dir = meta.type == "directory"
            out.append(Stat(name[len(prefix) :], 0 if is_dir else int(meta.content_length or 0), is_dir))
        return out

    def _find(self, key: str) -> list[tuple[str, int]]:
        prefix = f"{key}/" if key else ""
        return [
            (str(meta.key)[len(prefix) :], int(meta.content_length or 0))
            for meta in self.client.list(prefix)
            if str(meta.key).startswith(prefix) and meta.type != "directory"
        ]

    def _get(self, key: str, offset: int, length: int) -> bytes:
        return bytes(self.client.read(key, byte_range=self._range(offset=offset, size=length)))
