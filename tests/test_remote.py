"""Checkpoints on object storage: a real S3-compatible server (moto) on loopback, reached through s3fs
(``s3://``) and multi-storage-client (``msc://``), behind a proxy that logs every request.

Every read command gives the same output for the uploaded fixtures as for the local copies (the checkpoint's
name aside: the URL where the local path was); metadata-only commands GET only ``.metadata``,
``metadata.json``, the tracker and the common state, however large the data files; ``diff --values`` GETs each
byte range once; a server gone mid-run or a missing object is one line naming the URL, exit 2. Writes: an
``--output`` URL is uploaded with ``metadata.json`` last; from a URL (fix-args, edit, seal -o) the data files are
copied on the server within one bucket or MSC profile (the proxy counts each CopyObject) and streamed elsewhere.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import s3_server  # moto, s3fs and multi-storage-client are test dependencies: no skip
from conftest import FIXTURES, free_port, run_cli

from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.cli import main
from ckptdoctor.storage import interface
from ckptdoctor.storage.dispatch import as_path
from ckptdoctor.storage.ranges import coalesce

# One moto server for the file: under pytest-xdist (``--dist loadgroup``) the file runs on one worker.
pytestmark = pytest.mark.xdist_group("s3")

NAMES = ["core019_tp1", "core019_tp2", "core016_tp2", "core014_zarr_tp2", "core019_convert_tp4"]
PREFIXES = {"s3": f"s3://{s3_server.BUCKET}/", "msc": "msc://s3test/"}
OTHER_BUCKET = "other"
OTHER_PREFIXES = {"s3": f"s3://{OTHER_BUCKET}/", "msc": "msc://s3other/"}


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = s3_server.start()
    try:
        for name in NAMES:
            srv.upload_tree(FIXTURES / name, name)
        # the same checkpoint with 8 MiB more in every data file: metadata work must not read more
        padded = tmp_path_factory.mktemp("padded") / "core019_tp1"
        shutil.copytree(FIXTURES / "core019_tp1", padded)
        for data_file in padded.rglob("*.distcp"):
            with open(data_file, "ab") as f:
                f.write(b"\0" * (8 << 20))
        srv.upload_tree(padded, "padded/core019_tp1")
        srv.client().create_bucket(Bucket=OTHER_BUCKET)  # a second bucket (and MSC profile): outputs elsewhere
        srv.msc_file = srv.msc_config(  # type: ignore[attr-defined]
            tmp_path_factory.mktemp("msc") / "msc.yaml", {"s3test": s3_server.BUCKET, "s3other": OTHER_BUCKET}
        )
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def remote(server, monkeypatch):
    """The environment a user sets (AWS variables, MSC_CONFIG); a fresh store cache per test."""
    for name, value in server.env(server.msc_file).items():
        monkeypatch.setenv(name, value)
    interface.forget_stores()
    server.log.clear()
    yield server
    interface.forget_stores()


def ckd(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process, with a fresh listing cache (so each command's requests are its own)."""
    interface.forget_stores()
    capsys.readouterr()
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


_TIMING = re.compile(r"(\"seconds\": |\"peak_in_flight\": | in )[0-9.]+")


def normalized(text: str, prefix: str) -> str:
    """Remote output with the URL prefix as the local fixtures dir, timings blanked (they differ run to run)."""
    return _TIMING.sub(r"\1#", text.replace(prefix, f"{FIXTURES}/") if prefix else text)


def local_args(args: tuple[str, ...]) -> list[str]:
    return [f"{FIXTURES}/{a[1:]}" if a.startswith("@") else a for a in args]


def remote_args(args: tuple[str, ...], prefix: str, only: int | None = None) -> list[str]:
    return [
        f"{prefix}{a[1:]}" if a.startswith("@") and (only is None or i == only) else local_args((a,))[0]
        for i, a in enumerate(args)
    ]


COMMANDS = [
    ("inspect", "@core019_tp1"),
    ("inspect", "@core016_tp2"),
    ("inspect", "@core014_zarr_tp2"),
    ("inspect", "@core016_tp2/iter_0000010/.metadata"),  # a file inside an iteration dir
    ("show", "@core019_tp2", "decoder.layers.self_attention.linear_qkv.weight"),
    ("check", "@core019_tp1", "@core016_tp2"),
    ("check", "--deep", "@core019_tp2", "@core014_zarr_tp2"),
    ("diff", "@core019_tp1", "@core019_tp2"),
    ("diff", "--values", "@core016_tp2", "@core019_tp2"),
    ("latest-good", "@core016_tp2"),
    ("fix-args", "@core019_tp2"),
    ("strip-frozen", "--dry-run", "@core019_tp1"),
    ("edit", "--remove", "output_layer.weight", "--dry-run", "@core019_tp1"),
    ("can-load", "@core019_tp2", "--target", "tp=1"),
    ("repair", "@core019_convert_tp4"),  # the report: what --write would do
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: "-".join(a.lstrip("@-") for a in c[:2]))
def test_remote_output_equals_local(remote, capsys, command):
    """Text and JSON, through s3fs and through MSC: the local output, the checkpoint's name aside."""
    name, *rest = command
    for fmt in ("text", "json"):
        if fmt == "json" and name == "strip-frozen":
            continue  # strip-frozen --dry-run has no JSON report
        extra = ["--format", "json"] if fmt == "json" else []
        rc_local, out_local, err_local = ckd(capsys, name, *extra, *local_args(tuple(rest)))
        expected = (rc_local, normalized(out_local, ""), normalized(err_local, ""))
        for backend, prefix in PREFIXES.items():
            remote.log.clear()
            rc, out, err = ckd(capsys, name, *extra, *remote_args(tuple(rest), prefix))
            assert (rc, normalized(out, prefix), normalized(err, prefix)) == expected, (backend, fmt)
            if fmt == "json":
                json.loads(out)
            assert remote.log.gets(), f"{backend}: no request reached the server"


@pytest.fixture(scope="session")
def runs_tree(server, tmp_path_factory):
    """A folder of runs (issue #35 point 1), local and uploaded under ``runs/``: save dirs at two depths, one with a
    damaged newer iteration (latest-good walks back past it), a dir of notes, and a hidden dir (not entered)."""
    runs = tmp_path_factory.mktemp("tree") / "runs"
    shutil.copytree(FIXTURES / "core019_tp1", runs / "core019_tp1")
    shutil.copytree(FIXTURES / "core014_zarr_tp2", runs / "old" / "core014_zarr_tp2")
    two = runs / "team" / "core016_tp2"
    shutil.copytree(FIXTURES / "core016_tp2", two)
    shutil.copytree(two / "iter_0000010", two / "iter_0000020")
    (two / "iter_0000020" / "__1_0.distcp").unlink()
    (two / "latest_checkpointed_iteration.txt").write_text("20")
    shutil.copytree(FIXTURES / "core019_tp2", runs / ".trash" / "core019_tp2")
    (runs / "notes").mkdir()
    (runs / "notes" / "readme.txt").write_text("not a checkpoint\n")
    server.upload_tree(runs, "runs")
    return runs


TREE_WALKS = [
    ("check", "@runs"),  # recursion is the default: every save dir below, not the hidden one
    ("check", "--all-iterations", "@runs"),
    ("check", "--all-iterations", "@runs/team/core016_tp2"),
    ("check", "--no-recursive", "@runs"),
    ("latest-good", "@runs/team/core016_tp2"),  # walks back from the tracker's damaged iteration
    ("inspect", "@runs/team/core016_tp2/iter_0000010"),
    ("inspect", "@runs"),  # no checkpoint: one error naming the URL
    ("diff", "@runs/core019_tp1", "@runs/team/core016_tp2/iter_0000010"),
    ("can-load", "@runs/old/core014_zarr_tp2", "--target", "tp=1"),
    ("fix-args", "@runs/team/core016_tp2/iter_0000010"),
    ("repair", "@runs/team/core016_tp2"),
    ("show", "@runs/core019_tp1", "output_layer.weight"),
    ("strip-frozen", "--dry-run", "@runs/core019_tp1"),
    ("edit", "--remove", "output_layer.weight", "--dry-run", "@runs/old/core014_zarr_tp2"),
    ("seal", "@runs/core019_tp1"),  # refused: a write on object storage
]


@pytest.mark.parametrize("command", TREE_WALKS, ids=lambda c: "-".join(a.lstrip("@-") for a in c[:3]))
def test_tree_walk_on_a_url_equals_local(remote, runs_tree, capsys, command):
    """Every command's walk of a tree (a folder of runs, a save dir's iterations) on s3:// and msc://: the local
    output, the URL where the path was (``check s3://bucket/runs`` was an internal error)."""
    name, *rest = command
    local = [str(runs_tree.parent / a[1:]) if a.startswith("@") else a for a in rest]
    for fmt in ("text", "json"):
        extra = ["--format", "json"] if fmt == "json" and name not in ("strip-frozen", "seal") else []
        rc_local, out_local, err_local = ckd(capsys, name, *extra, *local)
        for backend, prefix in PREFIXES.items():
            argv = [f"{prefix}{a[1:]}" if a.startswith("@") else a for a in rest]
            rc, out, err = ckd(capsys, name, *extra, *argv)
            assert "internal error" not in err, (backend, err)
            if name == "seal":
                assert rc == 2 and IN_PLACE in err, err
                continue
            got = (rc, out.replace(prefix, f"{runs_tree.parent}/"), err.replace(prefix, f"{runs_tree.parent}/"))
            assert got == (rc_local, out_local, err_local), (backend, fmt)
    if command[:2] == ("check", "@runs"):
        assert rc_local == 1 and ".trash" not in out_local and "core016_tp2/iter_0000020" in out_local


def test_diff_local_against_remote(remote, capsys):
    args = ("diff", "--values", "@core019_tp1", "@core019_tp2")
    rc_local, out_local, _ = ckd(capsys, *local_args(args))
    rc, out, err = ckd(capsys, *remote_args(args, PREFIXES["s3"], only=3))
    assert rc == rc_local and normalized(out, PREFIXES["s3"]) == normalized(out_local, ""), err
    assert {r.key.split("/")[0] for r in remote.log.gets()} == {"core019_tp2"}  # A was read locally


def test_damaged_checkpoint_same_findings_as_local(remote, capsys, tmp_path):
    """A missing data file, a truncated one and a missing common.pt: the same findings remotely."""
    damaged = tmp_path / "damaged"
    shutil.copytree(FIXTURES / "core016_tp2", damaged)
    iteration = damaged / "iter_0000010"
    data_files = sorted(iteration.glob("*.distcp"))
    data_files[0].unlink()
    with open(data_files[1], "r+b") as f:
        f.truncate(data_files[1].stat().st_size // 2)
    (iteration / "common.pt").unlink()
    remote.upload_tree(damaged, "damaged/core016_tp2")
    for args in (["check"], ["check", "--deep", "--format", "json"], ["inspect"]):
        rc_local, out_local, err_local = ckd(capsys, *args, str(damaged))
        url = f"{PREFIXES['s3']}damaged/core016_tp2"
        rc, out, err = ckd(capsys, *args, url)
        assert (rc, out.replace(url, str(damaged)), err.replace(url, str(damaged))) == (rc_local, out_local, err_local)
        assert rc in (1, 2) and "internal error" not in err


def test_sealed_checkpoint_hashes_in_few_large_requests(remote, capsys, tmp_path):
    """``check`` verifies integrity.json by hashing every file: read sequentially, a remote file is fetched
    ahead in large concurrent requests, not one GET per 1 MiB read."""
    sealed = tmp_path / "sealed"
    shutil.copytree(FIXTURES / "core019_tp1", sealed)
    (data_file,) = sealed.glob("iter_*/*.distcp")
    with open(data_file, "ab") as f:
        f.write(b"\1" * (20 << 20))  # past every range .metadata names: still a clean checkpoint
    assert ckd(capsys, "seal", str(sealed))[0] == 0
    remote.upload_tree(sealed, "sealed/core019_tp1")
    url = f"{PREFIXES['s3']}sealed/core019_tp1"
    rc_local, out_local, _ = ckd(capsys, "check", str(sealed))
    remote.log.clear()
    rc, out, err = ckd(capsys, "check", url)
    assert (rc, out.replace(url, str(sealed))) == (rc_local, out_local), err
    gets = [r for r in remote.log.gets() if r.key.endswith(data_file.name)]
    common = _metadata_bytes("core019_tp1") - sum(
        (FIXTURES / "core019_tp1" / n).stat().st_size
        for n in ("iter_0000010/.metadata", "iter_0000010/metadata.json", "latest_checkpointed_iteration.txt")
    )
    # hashed once, whole; the gate's pass reads the bytes items' pickles (rng state, _extra_state) before
    items = _item_bytes("core019_tp1")
    assert sum(r.body_bytes for r in gets) == data_file.stat().st_size + common + items
    assert len(gets) <= 8  # the common state, the items, then 20 MiB in 1 MiB reads: 21 without read-ahead


def _item_bytes(name: str) -> int:
    """The ranges of the bytes items but the common state: what check's gate reads of the data files (their
    pickles: rng state, _extra_state), never a tensor chunk."""
    ckpt = open_checkpoint(FIXTURES / name)
    return sum(
        e.chunks[0].storage.length  # type: ignore[union-attr]
        for key, e in ckpt.entries.items()
        if e.kind != "tensor" and key != ckpt.common_source
    )


def _metadata_bytes(name: str, gate: bool = False) -> int:
    """.metadata + metadata.json + tracker + the common state's range: all a metadata command may read (with
    ``gate``, check: also every bytes item's range)."""
    ckpt = open_checkpoint(FIXTURES / name)
    total = sum((ckpt.iteration_dir / f).stat().st_size for f in (".metadata", "metadata.json"))
    total += (ckpt.iteration_dir.parent / "latest_checkpointed_iteration.txt").stat().st_size
    source = ckpt.common_source
    if source == "common.pt":
        total += (ckpt.iteration_dir / "common.pt").stat().st_size
    elif source is not None:
        storage_location = ckpt.entries[source].chunks[0].storage
        assert storage_location is not None
        total += storage_location.length
    return total + (_item_bytes(name) if gate else 0)


@pytest.mark.parametrize("command", [("inspect",), ("check",), ("fix-args",), ("diff", "@core019_tp1")])
def test_metadata_commands_transfer_no_tensor_bytes(remote, capsys, command):
    name, *rest = command
    transferred = {}
    for prefix in ("core019_tp1", "padded/core019_tp1"):
        remote.log.clear()
        counted = interface.TRANSFERS.bytes
        rc, out, err = ckd(capsys, name, f"{PREFIXES['s3']}{prefix}", *local_args(tuple(rest)))
        assert rc in (0, 1) and "error" not in err, err
        transferred[prefix] = remote.log.get_bytes()
        assert interface.TRANSFERS.bytes - counted == transferred[prefix]  # our own count agrees with the wire
        assert len({(r.key, r.range) for r in remote.log.gets()}) == len(remote.log.gets())  # nothing twice
    assert transferred["core019_tp1"] == transferred["padded/core019_tp1"]  # flat in data size (+8 MiB a file)
    assert 0 < transferred["core019_tp1"] <= _metadata_bytes("core019_tp1", gate=name == "check")


def test_metadata_commands_import_no_torch_and_no_msc(remote):
    proc = run_cli("inspect", f"{PREFIXES['s3']}core019_tp1", env=remote.env())
    assert proc.returncode == 0, proc.stderr
    assert "IMPORTED:\n" in proc.stderr  # neither torch nor megatron
    proc = run_cli("inspect", f"{PREFIXES['s3']}core019_tp1", block=("multistorageclient",), env=remote.env())
    assert proc.returncode == 0, proc.stderr


def test_local_paths_import_no_storage_client():
    blocked = ("fsspec", "s3fs", "aiobotocore", "botocore", "boto3", "multistorageclient")
    proc = run_cli("inspect", str(FIXTURES / "core019_tp1"), block=blocked)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("check", "--deep", str(FIXTURES / "core014_zarr_tp2"), block=blocked)
    assert proc.returncode == 0, proc.stderr


def test_diff_values_reads_each_range_once(remote, capsys):
    rc, out, err = ckd(capsys, "diff", "--values", f"{PREFIXES['s3']}core019_tp2", f"{PREFIXES['s3']}core016_tp2")
    assert rc == 1 and "values (bitwise)" in out, err
    gets = [(r.key, r.range) for r in remote.log.gets() if r.key.endswith(".distcp")]
    assert gets and max(Counter(gets).values()) == 1
    data = sum(p.stat().st_size for n in ("core019_tp2", "core016_tp2") for p in (FIXTURES / n).rglob("*.distcp"))
    assert sum(r.body_bytes for r in remote.log.gets() if r.key.endswith(".distcp")) <= data


def test_deep_check_coalesces_reads(remote, capsys):
    rc, out, err = ckd(capsys, "check", "--deep", f"{PREFIXES['s3']}core019_tp2")
    assert rc == 0, out + err
    data_gets = [r for r in remote.log.gets() if r.key.endswith(".distcp")]
    chunks = sum(len(e.chunks) for e in open_checkpoint(FIXTURES / "core019_tp2").entries.values())
    # two files, each read in one request by --deep and in at most a few by the gate's pass over the bytes items
    # (their ranges coalesced), not one per chunk
    assert 0 < len(data_gets) <= 8 < chunks


def test_coalesce_merges_near_ranges_up_to_the_gap_and_size_limits():
    assert coalesce([(0, 10), (10, 5), (20, 5)], max_gap=5) == [(0, 25)]
    assert coalesce([(0, 10), (100, 5)], max_gap=5) == [(0, 10), (100, 105)]
    assert coalesce([(0, 10), (10, 10), (20, 10)], max_gap=0, max_request=20) == [(0, 20), (20, 30)]
    assert coalesce([(0, 100)], max_request=10) == [(0, 100)]  # one long range is one request


def test_missing_object_is_one_line_naming_the_url(remote, capsys):
    url = f"{PREFIXES['s3']}no_such_checkpoint"
    rc, out, err = ckd(capsys, "inspect", url)
    assert rc == 2 and err == f"ckptdoctor: error: {url}: no such file or directory\n"
    remote.client().delete_object(Bucket=s3_server.BUCKET, Key="padded/core019_tp1/iter_0000010/.metadata")
    rc, out, err = ckd(capsys, "inspect", f"{PREFIXES['msc']}padded/core019_tp1")
    assert rc == 2 and err.count("\n") == 1, err
    assert "msc://s3test/padded/core019_tp1/iter_0000010: .metadata missing" in err, err
    remote.upload_tree(FIXTURES / "core019_tp1", "padded/core019_tp1")  # put the padded one back below
    remote.client().upload_file(
        str(FIXTURES / "core019_tp1/iter_0000010/.metadata"),
        s3_server.BUCKET,
        "padded/core019_tp1/iter_0000010/.metadata",
    )


@pytest.mark.parametrize("command", ["inspect", "check", "diff"])
def test_server_gone_mid_run_is_exit_2_naming_the_url(remote, capsys, monkeypatch, command):
    monkeypatch.setattr(interface, "BACKOFF_S", 0.01)
    url = f"{PREFIXES['s3']}core019_tp1"
    real_list = interface.ObjectStore.list

    def list_then_drop(self, key):  # the server goes away once the dir has been listed
        result = real_list(self, key)
        remote.proxy.drop = True
        return result

    monkeypatch.setattr(interface.ObjectStore, "list", list_then_drop)
    try:
        args = [command, url] + ([url] if command == "diff" else [])
        rc, out, err = ckd(capsys, *args)
    finally:
        remote.proxy.drop = False
    assert rc == 2, out + err
    assert err.startswith(f"ckptdoctor: error: {url}") and "cannot read after 4 attempts" in err, err
    assert err.count("\n") == 1 and "internal error" not in err and "Traceback" not in err


def test_no_server_at_all(capsys, monkeypatch):
    for name, value in {**s3_server.CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(interface, "BACKOFF_S", 0.01)  # the 4 attempts, without 1.4 s of backoff
    rc, out, err = ckd(capsys, "inspect", "s3://ckpt/core019_tp1")
    interface.forget_stores()
    assert rc == 2 and out == "", err
    assert err.startswith("ckptdoctor: error: s3://ckpt") and err.count("\n") == 1, err
    assert "cannot read after 4 attempts" in err and "internal error" not in err, err


def test_no_credentials_is_one_line(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL="http://127.0.0.1:1")
    proc = run_cli("inspect", "s3://ckpt/core019_tp1", env=env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("ckptdoctor: error: s3://ckpt: cannot read: no credentials (set AWS_ACCESS_KEY_ID")


def test_backend_not_installed_is_one_line_with_the_pip_command():
    proc = run_cli("inspect", "s3://ckpt/core019_tp1", block=("s3fs", "fsspec"))
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "ckptdoctor: error: s3:// URLs need the 's3fs' package, which is not installed: pip install 'ckptdoctor[s3]'\n"
    )
    proc = run_cli("check", "msc://profile/ckpt", block=("multistorageclient",))
    assert proc.returncode == 2
    assert "pip install 'ckptdoctor[msc]'" in proc.stderr.splitlines()[0]


def test_remote_path_answers_like_a_path(remote):
    path = as_path(f"{PREFIXES['s3']}core019_tp1/iter_0000010/metadata.json")
    assert str(path.parent.parent) == f"{PREFIXES['s3']}core019_tp1" and path.name == "metadata.json"
    assert path.is_file() and not path.is_dir() and path.parent.is_dir() and path.stem == "metadata"
    assert path.stat().st_size == (FIXTURES / "core019_tp1/iter_0000010/metadata.json").stat().st_size
    assert path.read_bytes() == (FIXTURES / "core019_tp1/iter_0000010/metadata.json").read_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        p.name for p in (FIXTURES / "core019_tp1/iter_0000010").iterdir()
    )
    assert as_path("file:///tmp/x") == Path("/tmp/x") and as_path("relative/dir") == Path("relative/dir")


IN_PLACE = "cannot be changed in place on object storage"


@pytest.mark.parametrize(
    "args, expected",
    [
        (("strip-frozen", "--force", "--in-place", "@s3:core019_tp1"), IN_PLACE),
        (("fix-args", "--in-place", "@s3:core019_convert_tp4"), IN_PLACE),
        (("seal", "@msc:core019_tp1"), IN_PLACE),
        (("edit", "--in-place", "--drop-extra-state", "@msc:core019_tp1"), IN_PLACE),
        (("strip-frozen", "--force", "--output", "{tmp}/out", "@s3:core019_tp1"), "does not write from object storage"),
        (("edit", "--compact", "--drop-extra-state", "-o", "{tmp}/out", "@s3:core019_tp1"), "rewrites tensor bytes"),
        (("fix-args", "-o", "@s3:core019_convert_tp4/fixed", "@s3:core019_convert_tp4"), "lies inside the source"),
    ],
)
def test_writes_to_object_storage_are_refused_clearly(remote, capsys, tmp_path, args, expected):
    argv = []
    for a in args:
        if a.startswith("@s3:") or a.startswith("@msc:"):
            backend, name = a[1:].split(":", 1)
            argv.append(f"{PREFIXES[backend]}{name}")
        else:
            argv.append(local_args((a.replace("{tmp}", str(tmp_path)),))[0])
    rc, out, err = ckd(capsys, *argv)
    assert rc == 2 and expected in err and err.count("\n") == 1, out + err
    assert not [r for r in remote.log.requests if r.method in ("PUT", "POST", "DELETE")]
    assert not (Path.cwd() / "s3:").exists() and not (tmp_path / "out").exists()


# --- --output on object storage: written locally, uploaded with metadata.json last ----------------------


_BYTES = re.compile(r'("\w*bytes\w*": )\d+|(\d{8})T\d{6}')  # byte counts; fix-args' file stamps
WRITES = [
    ("strip-frozen", "--force", "@core019_tp1"),
    ("edit", "--drop-section", "optimizer", "@core019_tp2"),
    ("fix-args", "@core019_convert_tp4"),
    ("seal", "@core019_tp1"),
]


@pytest.mark.parametrize("backend", ["s3", "msc"])
@pytest.mark.parametrize("command", WRITES, ids=lambda c: c[0])
def test_output_to_object_storage_is_uploaded_metadata_json_last(remote, capsys, tmp_path, backend, command):
    name = f"out-{command[0]}-{backend}"
    url = f"{PREFIXES[backend]}{name}"
    local = tmp_path / name
    rc_local, out_local, _ = ckd(capsys, *local_args(command), "--output", str(local), "--format", "json")
    remote.log.clear()
    rc, out, err = ckd(capsys, *local_args(command), "--output", url, "--format", "json")
    assert rc == rc_local == 0, err
    # the URL where the path was; byte counts masked: a re-pickled common state's memo can differ run to run
    assert normalized(_BYTES.sub(r"\1#", out.replace(url, str(local))), "") == normalized(
        _BYTES.sub(r"\1#", out_local), ""
    )
    assert "ckptdoctor-upload-" not in out + err
    puts = [r.key for r in remote.log.requests if r.method == "PUT"]
    uploaded = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    stamp = re.compile(r"\d{8}T\d{6}")  # fix-args names its new common state by the second it ran
    assert sorted(stamp.sub("#", k.split(f"{name}/", 1)[1]) for k in puts) == [stamp.sub("#", u) for u in uploaded]
    order = [k.rpartition("/")[2] for k in puts]
    completes = [i for i, n in enumerate(order) if n == "metadata.json"]
    assert completes and min(completes) > max(i for i, n in enumerate(order) if n.endswith(".distcp"))
    if "latest_checkpointed_iteration.txt" in order:
        assert order[-1] == "latest_checkpointed_iteration.txt"
    # what was uploaded reads like the local copy
    rc, remote_inspect, _ = ckd(capsys, "inspect", url, "--format", "json")
    _, local_inspect, _ = ckd(capsys, "inspect", str(local), "--format", "json")
    assert rc == 0 and _BYTES.sub(r"\1#", remote_inspect.replace(url, str(local))) == _BYTES.sub(r"\1#", local_inspect)
    assert ckd(capsys, "check", "--isolated", url)[0] == 0
    # an --output URL that holds objects is refused, nothing written (strip-frozen's --force allows it)
    if "--force" in command:
        return
    remote.log.clear()
    rc, out, err = ckd(capsys, *local_args(command), "--output", url)
    assert rc == 2 and "already holds objects" in err and err.count("\n") == 1
    assert not [r for r in remote.log.requests if r.method in ("PUT", "POST", "DELETE")]


# --- O(metadata) writes from object storage: server-side copy in one bucket or profile, streamed elsewhere ------


def _data_files(name: str) -> dict[str, int]:
    """The fixture's data files (relative to its save dir) and their sizes."""
    root = FIXTURES / name
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*.distcp")}


def _gets_of_data(remote, prefix: str) -> int:
    """Bytes GET from the source's data files: only ranges (bytes items), never an object whole."""
    gets = [r for r in remote.log.gets() if r.key.startswith(f"{prefix}/") and r.key.endswith(".distcp")]
    assert all(r.range for r in gets), [r.key for r in gets if not r.range]
    return sum(r.body_bytes for r in gets)


FROM_REMOTE = [
    ("fix-args", "@core019_convert_tp4"),
    ("edit", "--drop-section", "optimizer", "@core016_tp2"),
    ("seal", "@core019_tp1"),
]


@pytest.mark.parametrize("backend", ["s3", "msc"])
@pytest.mark.parametrize("command", FROM_REMOTE, ids=lambda c: c[0])
def test_write_from_object_storage_to_the_same_bucket_copies_data_on_the_server(
    remote, capsys, tmp_path, backend, command
):
    """fix-args, edit and seal -o from a URL to a URL in the same bucket (or MSC profile): every data file is a
    server-side copy (CopyObject), not one of their bytes is uploaded or downloaded, only the files the write
    changed are uploaded, metadata.json after every data file; the result passes check and equals the local
    write."""
    name = command[-1][1:]
    url = f"{PREFIXES[backend]}from-remote/{command[0]}-{backend}"
    local = tmp_path / "local"
    rc_local, out_local, _ = ckd(capsys, *local_args(command), "-o", str(local), "--format", "json")
    remote.log.clear()
    rc, out, err = ckd(capsys, *remote_args(command, PREFIXES[backend]), "-o", url, "--format", "json")
    assert rc == rc_local == 0, err
    where = "the same MSC profile" if backend == "msc" else "the same bucket"
    assert f"server-side: source and output are in {where}" in err.splitlines()[0]
    data = _data_files(name)
    copied = {r.copy_source: r.key for r in remote.log.copies()}
    for relative in data:  # each data file copied on the server from the source's object, to the output
        assert copied.get(f"{s3_server.BUCKET}/{name}/{relative}", "").endswith(relative), (relative, copied)
    uploaded = {r.key.rpartition("/")[2]: r.sent_bytes for r in remote.log.uploads()}
    assert not any(n in uploaded for n in (Path(d).name for d in data))  # no source data file re-uploaded
    assert sum(uploaded.values()) < sum(data.values()) / 4  # only small files went up
    assert _gets_of_data(remote, name) < sum(data.values()) / 4 or command[0] == "seal"  # seal hashes every byte
    writes = [r.key for r in remote.log.requests if r.method == "PUT"]
    completes = max(i for i, k in enumerate(writes) if k.endswith("/metadata.json"))
    assert all(i < completes for i, k in enumerate(writes) if k.endswith(".distcp"))
    # the output: the local write's report (paths, stamps and byte counts aside), and it passes check
    shown = out.replace(url, str(local)).replace(f"{PREFIXES[backend]}{name}", str(FIXTURES / name))
    assert normalized(_BYTES.sub(r"\1#", shown), "") == normalized(_BYTES.sub(r"\1#", out_local), "")
    assert ckd(capsys, "check", "--isolated", url)[0] == 0
    _, remote_inspect, _ = ckd(capsys, "inspect", url, "--format", "json")
    _, local_inspect, _ = ckd(capsys, "inspect", str(local), "--format", "json")
    assert _BYTES.sub(r"\1#", remote_inspect.replace(url, str(local))) == _BYTES.sub(r"\1#", local_inspect)
    if command[0] == "fix-args":  # the args changed: the output is consistent, the source still is not
        assert ckd(capsys, "fix-args", url)[0] == 0 and ckd(capsys, "fix-args", f"{PREFIXES[backend]}{name}")[0] == 1


@pytest.mark.parametrize("prefixes", [PREFIXES, OTHER_PREFIXES], ids=["same-bucket", "other-bucket"])
def test_edit_from_object_storage_says_how_its_data_files_travelled(remote, capsys, prefixes):
    """edit's text names how the data files reached the output (a server-side copy or streaming), not the hard
    links of its local staging dir, which are no blocks the output shares."""
    url = f"{prefixes['s3']}from-remote/edit-text-{len(prefixes['s3'])}"
    rc, out, err = ckd(capsys, "edit", "--drop-extra-state", f"{PREFIXES['s3']}core019_tp1", "-o", url)
    assert rc == 0, err
    how = "copied on the server" if prefixes is PREFIXES else "streamed"
    data_line = next(line for line in out.splitlines() if line.startswith("data files"))
    assert f"{len(_data_files('core019_tp1'))} {how}, 0 copied" in data_line
    assert "hard-linked" not in out and "share the source's blocks" not in out


@pytest.mark.parametrize("backend", ["s3", "msc"])
def test_write_from_object_storage_to_another_bucket_streams_and_says_so(remote, capsys, backend):
    """Another bucket (or MSC profile): the data files are streamed (read and uploaded), one line up front says
    so; the output is complete and passes check."""
    name = "core019_convert_tp4"
    url = f"{OTHER_PREFIXES[backend]}from-remote/fix-args-{backend}"
    rc, out, err = ckd(capsys, "fix-args", f"{PREFIXES[backend]}{name}", "-o", url, "-j", "2")
    assert rc == 0, err
    data = _data_files(name)
    why = "different MSC profiles" if backend == "msc" else "different buckets"
    line = f"copying {len(data)} data files (220.2 KB) by streaming: source and output are in {why}"
    assert line in err.splitlines()[0]
    assert not remote.log.copies()
    uploaded = {r.key.rpartition("/")[2]: r.sent_bytes for r in remote.log.uploads()}
    assert {Path(d).name: s for d, s in data.items()}.items() <= uploaded.items()  # every data file, whole
    assert f"streamed {len(data)} data files" in err and url in out
    assert ckd(capsys, "check", "--isolated", url)[0] == 0
    assert ckd(capsys, "fix-args", url)[0] == 0


@pytest.mark.parametrize("backend", ["s3", "msc"])
@pytest.mark.parametrize("command", FROM_REMOTE, ids=lambda c: c[0])
def test_write_from_object_storage_to_a_local_dir(remote, capsys, tmp_path, backend, command):
    """To a local dir: the data files streamed down, byte-identical to the source's; the output equals the
    local write and passes check; nothing is written to object storage."""
    name = command[-1][1:]
    out_dir, local = tmp_path / "out", tmp_path / "local"
    rc, out, err = ckd(capsys, *remote_args(command, PREFIXES[backend]), "-o", str(out_dir))
    assert rc == 0, err
    assert "by streaming: the output is a local dir" in err.splitlines()[0]
    assert not [r for r in remote.log.requests if r.method in ("PUT", "POST", "DELETE")]
    assert ckd(capsys, *local_args(command), "-o", str(local))[0] == 0
    for relative in _data_files(name):  # the source's data files, byte for byte
        assert (out_dir / relative).read_bytes() == (FIXTURES / name / relative).read_bytes()
    stamp = re.compile(r"\d{8}T\d{6}")
    listing = sorted(stamp.sub("#", p.relative_to(out_dir).as_posix()) for p in out_dir.rglob("*"))
    assert listing == sorted(stamp.sub("#", p.relative_to(local).as_posix()) for p in local.rglob("*"))
    assert ckd(capsys, "check", "--isolated", str(out_dir))[0] == 0
    assert not list(tmp_path.glob(".*ckptdoctor*"))  # no staging dir left beside the output


def test_a_stopped_delivery_leaves_no_metadata_json(remote, tmp_path):
    """Killed after the data files were copied: objects under the output, but no metadata.json, so every
    loader and check read it as an incomplete save; the source is untouched."""
    url = f"{PREFIXES['s3']}from-remote/stopped"
    env = {**remote.env(remote.msc_file), "CKPTDOCTOR_FAULT_AT": "deliver:data", "TMPDIR": str(tmp_path)}
    proc = run_cli("edit", "--drop-extra-state", f"{PREFIXES['s3']}core019_tp1", "-o", url, env=env)
    assert proc.returncode != 0
    keys = [
        k
        for k in remote.client()
        .list_objects_v2(Bucket=s3_server.BUCKET, Prefix="from-remote/stopped/")
        .get("Contents", [])
    ]
    names = [k["Key"].rpartition("/")[2] for k in keys]
    assert any(n.endswith(".distcp") for n in names) and "metadata.json" not in names and ".metadata" not in names
    proc = run_cli("check", "--isolated", url, env=remote.env(remote.msc_file))
    assert proc.returncode != 0 and "metadata.json" in proc.stdout


def test_a_write_from_object_storage_passes_the_gate(remote, capsys, tmp_path):
    """A pickle that would run code (os.system in the .metadata) is refused by every write from object storage
    as from a local dir (exit 1, CKD401), before anything is written there."""
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "core019_tp2", bad)
    metadata = bad / "iter_0000010" / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(original[:2] + b"]\x8c\x02os\x8c\x06system\x93a0" + original[2:])  # listed, unsafe
    remote.upload_tree(bad, "unsafe/core019_tp2")
    source = f"{PREFIXES['s3']}unsafe/core019_tp2"
    for command in (("fix-args", "--set", "lr=0.5"), ("edit", "--remove", "output_layer.weight"), ("seal",)):
        remote.log.clear()
        rc, out, err = ckd(capsys, *command, source, "-o", f"{PREFIXES['s3']}unsafe-out")
        assert rc == 1 and "CKD401" in err and "os.system" in err, (command, out + err)
        assert not [r for r in remote.log.requests if r.method in ("PUT", "POST", "DELETE")], command


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("backend", ["s3", "msc"])
def test_convert_from_object_storage_writes_what_a_local_source_gives(remote, capsys, tmp_path, backend):
    """convert reads its source's chunks through the storage layer (each worker its own ranges): from a URL, both
    ways, the output is byte for byte what the local source gives."""
    pytest.importorskip("torch")
    prefix = PREFIXES[backend]
    rc, _out, err = ckd(capsys, "convert", f"{FIXTURES}/core019_tp2", "--to", "fsdp_dtensor", "-o", str(tmp_path / "l"))
    assert rc == 0, err
    rc, _out, err = ckd(capsys, "convert", f"{prefix}core019_tp2", "--to", "fsdp_dtensor", "-o", str(tmp_path / "r"))
    assert rc == 0, err
    assert _files(tmp_path / "r") == _files(tmp_path / "l")
    remote.upload_tree(tmp_path / "l", f"converted-{backend}/core019_tp2")
    rc, _out, err = ckd(capsys, "convert", str(tmp_path / "l"), "--to", "torch_dist", "-o", str(tmp_path / "lb"))
    assert rc == 0, err
    url = f"{prefix}converted-{backend}/core019_tp2"
    rc, _out, err = ckd(capsys, "convert", url, "--to", "torch_dist", "-o", str(tmp_path / "rb"), "--jobs", "2")
    assert rc == 0, err
    assert _files(tmp_path / "rb") == _files(tmp_path / "lb")


def test_a_refused_write_from_object_storage_names_the_url(remote, capsys):
    """edit from a URL reads a local copy of the source's metadata (a private temp dir): its refusals named that
    dir (`/tmp/ckptdoctor-source-.../iter_0000010: the edit matches no key`), not the source the user gave."""
    source = f"{PREFIXES['s3']}core019_tp1"
    rc, _out, err = ckd(capsys, "edit", source, "--remove", "no_such_key_anywhere", "-o", f"{PREFIXES['s3']}x/no")
    assert rc == 2 and f"{source}/iter_0000010: the edit matches no key" in err and "ckptdoctor-source-" not in err
