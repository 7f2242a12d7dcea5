"""The storage layer's seams: the write guard tells a URL's path from a local one without importing the storage
layer, a remote path crosses to a worker process onto that process's one store, and the primitives below
storage import nothing above them."""

from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.errors import CkptError
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.interface import forget_stores
from ckptdoctor.write_guard import refuse_remote_write


def test_the_write_guard_refuses_a_remote_path_and_a_folded_url(tmp_path):
    remote = as_path("memory://bucket/ckpt/iter_0000010")
    assert not isinstance(remote, os.PathLike)  # what the guard tells it by
    with pytest.raises(CkptError, match="cannot be changed in place on object storage"):
        refuse_remote_write(remote, in_place=True)
    with pytest.raises(CkptError, match="this command does not write from object storage"):
        refuse_remote_write(remote, in_place=False)
    with pytest.raises(CkptError, match=r"^s3://b/k: --output to object storage"):
        refuse_remote_write(Path("s3:/b/k"), in_place=False)
    refuse_remote_write(tmp_path, in_place=True)  # a local dir: no refusal


def test_a_pickled_remote_path_lands_on_the_store_of_its_process():
    forget_stores()
    path = as_path("memory://bucket/a/b")
    back = pickle.loads(pickle.dumps(path))
    assert back == path and back.store is path.store and str(back) == "memory://bucket/a/b"
    forget_stores()
    again = pickle.loads(pickle.dumps(path))  # a process without the store makes its own from the scheme
    assert again.store is not path.store and str(again) == str(path)
    forget_stores()


def test_the_primitives_import_nothing_above_them():
    code = (
        "import sys, ckptdoctor.atomic, ckptdoctor.locking\n"
        "print(sorted(m for m in sys.modules if m.startswith('ckptdoctor.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    below = ["ckptdoctor.atomic", "ckptdoctor.errors", "ckptdoctor.locking", "ckptdoctor.write_guard"]
    assert ast.literal_eval(out) == below


def test_a_file_removed_after_the_listing_is_left_out(tmp_path, monkeypatch):
    """A checkpoint dir read while another writer renames its temp file into place: the temp file is listed, then
    gone when its size is asked for. It is left out of the sizes (it was an uncaught FileNotFoundError: one of two
    ``fix-args --in-place`` started together failed on the other's journal temp file)."""
    from ckptdoctor.storage import files

    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 5)
    (tmp_path / "..ckptdoctor-fixargs-1.json.ckptdoctor-part-1f").write_bytes(b"y")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "common.pt").write_bytes(b"zz")
    real_scandir = os.scandir

    class ListedThenRemoved:
        """os.scandir whose temp files are removed once listed."""

        def __init__(self, path):
            self.entries = list(real_scandir(path))
            for entry in self.entries:
                if ".ckptdoctor-part-" in entry.name:
                    os.unlink(entry.path)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(os, "scandir", ListedThenRemoved)
    assert files.file_sizes(tmp_path) == {"__0_0.distcp": 5}
    (tmp_path / "..ckptdoctor-fixargs-2.json.ckptdoctor-part-2f").write_bytes(b"y")
    assert files.tree_bytes(tmp_path) == (7, 2)


def test_a_forked_workers_threads_all_wait_for_its_own_client():
    """In a forked worker the first request replaces the parent's client (not fork-safe: its open connections are
    the parent's and every other worker's). A second thread of the worker must not use the old client while the
    first one reconnects: it did, and MSC range GETs were answered with another process's bytes (seen as
    'truncated' chunks, undecodable archives, hangs under diff --values -j 2)."""
    import threading
    import time

    from ckptdoctor.storage.interface import ObjectStore

    class Store(ObjectStore):
        scheme, args = "test", ()

        def __init__(self) -> None:
            super().__init__()
            self.client = "parent's"

        def _connect(self) -> None:
            time.sleep(0.2)  # a slow client creation: the other thread arrives meanwhile
            self.client = "this process's"

        def url(self, key: str) -> str:
            return f"test://{key}"

        def _ls(self, key):
            return []

        def _get(self, key, offset, length):
            return self.client.encode()

        def _put(self, local, key):
            raise NotImplementedError

    store = Store()
    store._pid = -1  # as a forked worker finds it: made by another process
    seen: list[bytes] = []

    def request() -> None:
        seen.append(store._retrying("k", lambda: store._get("k", 0, 1)))

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    assert seen == [b"this process's"] * 4
    assert store._pid == os.getpid()


@pytest.mark.parametrize("name", ["metadata.json", ".metadata", "latest_checkpointed_iteration.txt"])
@pytest.mark.parametrize("command", [["check"], ["latest-good"], ["history"]])
def test_storage_that_refuses_a_read_stops_the_command(capsys, monkeypatch, name, command):
    """Storage that refuses a read no retry cures (access denied, a persistent 500: StorageUnavailable) is no
    finding about the checkpoint: check said CKD102/CKD111/CKD120 and exit 1, latest-good and history called every
    iteration broken (automation might skip or delete good checkpoints). One line naming the object, exit 2."""
    from conftest import FIXTURES

    from ckptdoctor import locate
    from ckptdoctor.cli import main
    from ckptdoctor.formats import torch_dist
    from ckptdoctor.storage import files
    from ckptdoctor.storage.interface import StorageUnavailable

    real = files.open_regular

    def refusing(path, *args, **kwargs):
        if Path(str(path)).name == name:
            raise StorageUnavailable(f"{path}: cannot read: access denied (Access Denied)")
        return real(path, *args, **kwargs)

    for module in (files, locate, torch_dist):
        monkeypatch.setattr(module, "open_regular", refusing)
    rc = main([*command, str(FIXTURES / "core019_tp2")])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("ckptdoctor: error: ") and f"{name}: cannot read: access denied" in err, (
        rc,
        out,
        err,
    )


def test_credentials_in_an_endpoint_url_never_reach_a_message():
    """An endpoint configured as https://user:secret@host shows up in the backends' errors: the user and password
    are left out of every message (a CI log keeps them)."""
    from ckptdoctor.storage.interface import _one_line, without_credentials

    text = "Could not connect to the endpoint URL: https://AKIA:s3cr3t@minio.internal:9000/bucket?x=1 (retries: 3)"
    assert "s3cr3t" not in without_credentials(text) and "AKIA" not in without_credentials(text)
    assert "https://***@minio.internal:9000/bucket" in without_credentials(text)
    assert "s3cr3t" not in _one_line(ConnectionError(text))
    assert without_credentials("s3://bucket/key and user@example.com") == "s3://bucket/key and user@example.com"


def test_msc_errors_no_retry_cures_fail_at_once():
    """MSC wraps the S3 client's errors in a RuntimeError naming the status: access denied, a missing bucket and
    missing credentials are permanent (they were retried 4 times, with the backoff, as transient ones); a 500 is
    left to the retries."""
    pytest.importorskip("multistorageclient")
    from ckptdoctor.storage.msc_store import MscStore

    store = MscStore.__new__(MscStore)  # (no profile needed to classify)
    denied = RuntimeError("Failed to GET object(s) at b/k. request_id: 1, status_code: 403, error_type: AccessDenied")
    assert store._classify(denied) == "access denied"
    assert store._classify(RuntimeError("An error occurred (NoSuchBucket) when calling ...")) == "no such bucket"
    assert store._classify(RuntimeError("Unable to locate credentials")).startswith("no credentials")
    assert store._classify(RuntimeError("Failed to GET object(s). status_code: 500, error_type: ClientError")) is None


def test_msc_logs_nothing_of_its_own_on_stderr(tmp_path, monkeypatch, capfd):
    """MSC logs each failed request at ERROR; with no handler configured, Python's last-resort handler printed those
    lines on stderr beside the command's one line."""
    pytest.importorskip("multistorageclient")
    import logging

    from ckptdoctor.storage.interface import StorageUnavailable
    from ckptdoctor.storage.msc_store import MscStore

    monkeypatch.setenv("MSC_CONFIG", str(tmp_path / "missing.yaml"))
    with pytest.raises(StorageUnavailable):
        MscStore("no-such-profile")
    capfd.readouterr()
    logging.getLogger("multistorageclient.retry").error("Non-retryable error occurred for %s: %s", "read", "x")
    assert capfd.readouterr().err == ""
