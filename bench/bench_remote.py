"""Checkpoints on object storage: bytes on the wire and time, against a real S3-compatible server on loopback.

A moto S3 server runs on loopback behind the counting proxy of ``tests/s3_server.py`` (every request's method,
key, Range and response bytes are logged on the server side of the connection). Two things are measured:

1. **Metadata commands flat in data size**: ``inspect``, ``check``, ``fix-args`` and ``diff A A`` on the
   20,000-key synthetic checkpoint at two data sizes (default 0.5 GB and 4 GB, same keys and files): bytes
   transferred (GET bodies), requests and wall time per command, next to the local run.
2. **Value work remote vs download-then-local**: ``check --deep URL`` and ``diff --values LOCAL URL`` (the same
   checkpoint) against downloading the files first (``fsspec get``, as a separate child process) and running
   the command on the local copy.

Every command is a child process (``harness.run_once``: interpreter start and imports included); medians of
``--rounds`` runs after one untimed warm-up. Results: ``bench/results/remote.json``.

Usage::

    python bench/bench_remote.py                      # 0.5G and 4G metadata, 0.5G value work
    python bench/bench_remote.py --sizes 64M --value-size 64M --rounds 1   # quick
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import harness

sys.path.insert(0, str(harness.REPO / "tests"))
import s3_server  # noqa: E402

KEYS, FILES = 20000, 2000


def upload(server: s3_server.S3Server, local: Path, prefix: str) -> float:
    client = server.client()
    paths = [p for p in sorted(local.rglob("*")) if p.is_file()]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda p: client.upload_file(str(p), s3_server.BUCKET, f"{prefix}/{p.relative_to(local).as_posix()}"),
                paths,
            )
        )
    return time.perf_counter() - t0


def measure(server: s3_server.S3Server, cmd: list[str], rounds: int, env: dict) -> dict:
    """Median wall time of ``rounds`` runs (after a warm-up) and the requests of the last run."""
    walls, rcs = [], set()
    for i in range(rounds + 1):
        server.log.clear()
        run = harness.run_once(cmd, env=env)
        rcs.add(run.rc)
        if i:
            walls.append(run.wall_s)
    gets = server.log.gets()
    lists = [r for r in server.log.requests if r.method == "GET" and not r.key]
    return {
        "command": " ".join(cmd[2:]),
        "rc": sorted(rc for rc in rcs if rc is not None),
        "wall_s": round(statistics.median(walls), 3),
        "wall_s_all": [round(w, 3) for w in walls],
        "get_requests": len(gets),
        "get_bytes": sum(r.body_bytes for r in gets),
        "list_requests": len(lists),
        "list_bytes": sum(r.body_bytes for r in lists),
    }


def metadata_sizes(save: Path) -> dict:
    iteration = save / harness.synthetic_info(save)["iteration_dir"].rsplit("/", 1)[-1]
    files = {n: (iteration / n).stat().st_size for n in (".metadata", "metadata.json", "common.pt")}
    data = sum(p.stat().st_size for p in iteration.glob("*.distcp"))
    return {"files": files, "metadata_total": sum(files.values()), "data_bytes": data}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(doc: dict) -> str:
    """The README tables of a results file."""
    out = [harness.header(doc), "", "| data | command | GETs | bytes GET | LISTs (bytes) | remote wall | local wall |"]
    out.append("|---|---|---:|---:|---:|---:|---:|")
    for row in doc["metadata"]:
        for c in row["commands"]:
            name = c["command"].split(" s3://")[0].removeprefix("ckptdoctor ")
            out.append(
                f"| {row['size']} ({_mib(row['data_bytes'])} data) | `{name}` | {c['get_requests']} | "
                f"{c['get_bytes']:,} | {c['list_requests']} ({c['list_bytes']:,}) | {c['wall_s']:.2f} s | "
                f"{c['local_wall_s']:.2f} s |"
            )
    values = doc["values"]
    out += ["", f"Value work on the {values['size']} checkpoint ({_mib(values['data_bytes'])} in .distcp files):", ""]
    out.append("| command | remote | GETs | bytes GET | download | local after | download + local | remote / (d + l) |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("check --deep", "diff --values"):
        v = values.get(name)
        if v:
            r = v["remote"]
            out.append(
                f"| `{name}` | {r['wall_s']:.1f} s | {r['get_requests']} | {r['get_bytes']:,} "
                f"| {v['download_s']:.1f} s | {v['local_after_download_s']:.1f} s "
                f"| {v['download_then_local_s']:.1f} s | {v['ratio_remote_to_download_then_local']:.2f} |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.5G,4G", help="data sizes of the metadata benchmark")
    parser.add_argument("--value-size", default="0.5G", help="data size of the value-work benchmark")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--table", action="store_true", help="print the README tables of results/remote.json")
    harness.add_common_options(parser)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads((harness.RESULTS / "remote.json").read_text())))
        return
    harness.use_code(args.code)
    recorder = harness.Recorder("remote")
    server = s3_server.start()
    env = server.env()
    payload: dict = {"server": "moto 5 (server mode) on loopback behind a counting proxy", "metadata": [], "values": {}}
    try:
        saves = {size: harness.synthetic(size, KEYS, FILES) for size in args.sizes.split(",")}
        if args.value_size not in saves:
            saves[args.value_size] = harness.synthetic(args.value_size, KEYS, FILES)
        for size, save in saves.items():
            seconds = upload(server, save, f"synth_{size}")
            print(f"uploaded {save.name} in {seconds:.1f} s", flush=True)
        for size in args.sizes.split(","):
            save, url = saves[size], f"s3://{s3_server.BUCKET}/synth_{size}"
            row: dict = {"size": size, **metadata_sizes(save), "commands": []}
            for command in (["inspect"], ["check"], ["fix-args"], ["diff"]):
                target = [url, url] if command == ["diff"] else [url]
                remote = measure(server, harness.ckptdoctor(*command, *target), args.rounds, env)
                local_target = [str(save)] * len(target)
                local = measure(server, harness.ckptdoctor(*command, *local_target), args.rounds, env)
                remote["local_wall_s"] = local["wall_s"]
                row["commands"].append(remote)
                print(f"{size} {command[0]}: {remote}", flush=True)
            payload["metadata"].append(row)

        save, url = saves[args.value_size], f"s3://{s3_server.BUCKET}/synth_{args.value_size}"
        download_dir = harness.DATA / "tmp" / "remote_download"
        get = [
            harness.PYTHON,
            "-c",
            f"import fsspec; fsspec.filesystem('s3').get({url[5:]!r}, {str(download_dir)!r}, recursive=True)",
        ]
        values: dict = {"size": args.value_size, **metadata_sizes(save)}
        for name, command in (
            ("check --deep", ["check", "--deep"]),
            ("diff --values", ["diff", "--values", str(save)]),
        ):
            remote = measure(server, harness.ckptdoctor(*command, url), args.rounds, env)
            downloads, locals_ = [], []
            for _ in range(args.rounds):
                shutil.rmtree(download_dir, ignore_errors=True)
                downloads.append(harness.run_once(get, env=env).wall_s)
                locals_.append(harness.run_once(harness.ckptdoctor(*command, str(download_dir)), env=env).wall_s)
            shutil.rmtree(download_dir, ignore_errors=True)
            total = [d + c for d, c in zip(downloads, locals_)]
            values[name] = {
                "remote": remote,
                "download_s": round(statistics.median(downloads), 3),
                "local_after_download_s": round(statistics.median(locals_), 3),
                "download_then_local_s": round(statistics.median(total), 3),
                "ratio_remote_to_download_then_local": round(remote["wall_s"] / statistics.median(total), 3),
            }
            print(f"{name}: {values[name]}", flush=True)
        payload["values"] = values
    finally:
        server.stop()
    recorder.write(payload)


if __name__ == "__main__":
    main()
