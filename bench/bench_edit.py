"""Benchmark ``ckptdoctor edit``: O(metadata) by default, ``--compact`` against ``cp`` of the kept bytes, in one run.

Inputs: the cached ``make_synthetic.py`` checkpoints at 0.5 GB and 4 GB (same 20,000 keys, 2,000 data files and
6.5 MiB ``.metadata``; only tensor sizes differ). The edit removes the optimizer section (``--remove
'^optimizer\\.'``: the fp32 ``exp_avg``/``exp_avg_sq`` items, ~2/3 of the keys and 80% of the bytes).

One alternating group (``harness.alternate``: warm-up round, then ``--rounds`` rounds, order rotating), each run a
child process timed spawn -> exit, every output dir removed before its run; the inputs are private copies of the
shared cache (other benchmarks may regenerate it meanwhile):

- ``edit-<size>``: ``ckptdoctor edit SAVE --remove '^optimizer\\.' -o OUT`` (new ``.metadata``, data hard-linked);
- ``compact-<size>``: the same with ``--compact`` (kept items byte-copied into new files);
- ``cp-<size>``: ``cp`` of one file as large as the kept data (the least a copy of the kept bytes costs);
- ``cpsync-<size>``: the same followed by ``sync FILE`` (edit fsyncs what it writes; plain ``cp`` does not);
- ``cpr-<size>``: ``cp -r`` of a dir holding the kept bytes as ``--compact`` writes them: as many files (2,000),
  each as large as the kept part of its source file (random bytes);
- ``cprsync-<size>``: the same followed by ``sync -f`` (one ``syncfs`` of the filesystem: the cheapest way a shell
  makes 2,000 copied files durable; ``sync FILE...`` fsyncs them one after another, several times slower).

Targets (issue #14): edit(4G) / edit(0.5G) <= 1.3; compact(4G) <= 2 x cp(4G), the one-file ``cp`` (the ratios
against ``cp -r`` of the same files are reported beside it). Also reported per round: the copy part of
``--compact``, (compact - edit) / cpsync: what the byte copy costs beyond the metadata work both share.

    python bench/bench_edit.py [--sizes 0.5G 4G] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402

REMOVE = r"^optimizer\."


def kept_bytes(save: Path) -> int:
    """Data bytes of the items the edit keeps (from ckptdoctor's own reader: no torch)."""
    sys.path.insert(0, str(harness.CODE))
    from ckptdoctor.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(save)
    return sum(e.nbytes for k, e in checkpoint.entries.items() if not k.startswith("optimizer."))


def kept_file_sizes(save: Path) -> dict[str, int]:
    """Data file -> bytes of the kept items it holds: the sizes of the files ``--compact`` writes."""
    sys.path.insert(0, str(harness.CODE))
    from ckptdoctor.checkpoint import open_checkpoint

    sizes: dict[str, int] = {}
    for key, entry in open_checkpoint(save).entries.items():
        if key.startswith("optimizer."):
            continue
        for chunk in entry.chunks:
            if chunk.storage is not None:
                name = chunk.storage.relative_path
                sizes[name] = sizes.get(name, 0) + chunk.storage.length
    return dict(sorted(sizes.items()))


def make_kept_dir(path: Path, sizes: dict[str, int]) -> None:
    """A dir of files with these names and sizes (random bytes): what ``cp -r`` of the kept bytes copies."""
    if path.is_dir() and {p.name: p.stat().st_size for p in path.iterdir()} == sizes:
        return
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name, size in sizes.items():
        make_blob(path / name, size)


def source(size: str, keys: int, files: int, dest: Path) -> Path:
    """The private input copy; the shared cache is (re)made only when the private copy is not of these options."""
    want = {"total_bytes": harness.parse_size(size), "keys": keys, "files": files}
    info = dest / "synthetic.json"
    if info.exists() and json.loads(info.read_text()).get("requested") == want:
        return dest
    return harness.private_copy(harness.synthetic(size, keys, files), dest)


def make_blob(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    with open(path, "wb") as f:
        left = size
        while left:
            step = min(8 << 20, left)
            f.write(os.urandom(step))
            left -= step


def copy_part(group: harness.Group, size: str) -> dict | None:
    """Per round (compact_i - edit_i) / cpsync_i: the byte copy of --compact against cp + sync of the kept bytes."""
    compact, edit, cpsync = (group.per_round(f"{label}-{size}") for label in ("compact", "edit", "cpsync"))
    if not (compact and edit and cpsync) or not len(compact) == len(edit) == len(cpsync):
        return None
    return harness.spread([(c - e) / s for c, e, s in zip(compact, edit, cpsync)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["0.5G", "4G"])
    p.add_argument("--keys", type=int, default=20000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scratch", type=Path, default=harness.DATA / "edit_scratch")
    p.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another ckptdoctor source tree (e.g. a git worktree of an older commit): its --compact runs join the "
        "group as compact-before-<size>, with the per-round ratio compact / compact-before",
    )
    harness.add_common_options(p)
    o = p.parse_args(argv)
    harness.use_code(o.code)
    recorder = harness.Recorder("edit", argv)
    o.scratch.mkdir(parents=True, exist_ok=True)
    cases: dict[str, harness.Case] = {}
    inputs = {}
    for size in o.sizes:
        save = source(size, o.keys, o.files, o.scratch / f"src_{size}")
        kept = kept_bytes(save)
        sizes = kept_file_sizes(save)
        inputs[size] = harness.synthetic_info(save) | {"kept_bytes": kept, "kept_files": len(sizes)}
        blob, copy = o.scratch / f"blob_{size}", o.scratch / f"blob_{size}.copy"
        make_blob(blob, kept)
        kept_dir, kept_copy = o.scratch / f"kept_{size}", o.scratch / f"kept_{size}.copy"
        make_kept_dir(kept_dir, sizes)
        for label, extra in (("edit", []), ("compact", ["--compact"])):
            out = o.scratch / f"{label}_{size}"
            cases[f"{label}-{size}"] = harness.Case(
                harness.ckptdoctor("edit", str(save), "--remove", REMOVE, *extra, "-o", str(out)),
                before=lambda out=out: shutil.rmtree(out, ignore_errors=True),
            )
        if o.before is not None:
            out = o.scratch / f"compact-before_{size}"
            cases[f"compact-before-{size}"] = harness.Case(
                harness.ckptdoctor("edit", str(save), "--remove", REMOVE, "--compact", "-o", str(out)),
                before=lambda out=out: shutil.rmtree(out, ignore_errors=True),
                cwd=o.before.resolve(),
            )
        cases[f"cp-{size}"] = harness.Case(
            ["cp", str(blob), str(copy)], before=lambda copy=copy: copy.unlink(missing_ok=True)
        )
        cases[f"cpsync-{size}"] = harness.Case(
            ["sh", "-c", f"cp {blob} {copy} && sync {copy}"], before=lambda copy=copy: copy.unlink(missing_ok=True)
        )
        cases[f"cpr-{size}"] = harness.Case(
            ["cp", "-r", str(kept_dir), str(kept_copy)],
            before=lambda kept_copy=kept_copy: shutil.rmtree(kept_copy, ignore_errors=True),
        )
        cases[f"cprsync-{size}"] = harness.Case(
            ["sh", "-c", f"cp -r {kept_dir} {kept_copy} && sync -f {kept_copy}"],
            before=lambda kept_copy=kept_copy: shutil.rmtree(kept_copy, ignore_errors=True),
        )
    group = harness.alternate(cases, o.rounds, timeout=1200)
    small, large = o.sizes[0], o.sizes[-1]
    ratios = {
        "edit_large_over_small": group.ratio(f"edit-{large}", f"edit-{small}"),
        **{f"compact_over_cp_{s}": group.ratio(f"compact-{s}", f"cp-{s}") for s in o.sizes},
        **{f"compact_over_cpsync_{s}": group.ratio(f"compact-{s}", f"cpsync-{s}") for s in o.sizes},
        **{f"compact_over_cpr_{s}": group.ratio(f"compact-{s}", f"cpr-{s}") for s in o.sizes},
        **{f"compact_over_cprsync_{s}": group.ratio(f"compact-{s}", f"cprsync-{s}") for s in o.sizes},
        **{f"copy_part_over_cpsync_{s}": copy_part(group, s) for s in o.sizes},
    }
    if o.before is not None:
        ratios |= {f"compact_over_before_{s}": group.ratio(f"compact-{s}", f"compact-before-{s}") for s in o.sizes}
    before = None
    if o.before is not None:
        before = {
            "tree": str(o.before),
            "commit": harness._git("rev-parse", "HEAD", cwd=o.before),
            "dirty_paths": harness._git("status", "--porcelain", "--", "ckptdoctor", cwd=o.before).splitlines(),
        }
    recorder.write({"inputs": inputs, "group": group.summary(), "ratios": ratios, "before": before})
    print("| case | wall median [min-max] | CPU | peak RSS |\n|---|---|---|---|")
    for label in cases:
        print(
            f"| {label} | {harness.fmt_spread(group.seconds(label), unit=' s')} | "
            f"{harness.fmt_spread(group.cpu(label), unit=' s')} | {group.peak_rss_mb(label) or 0:.0f} MB |"
        )
    for name, value in ratios.items():
        print(f"{name}: {harness.fmt_spread(value)}")
    for size in o.sizes:
        shutil.rmtree(o.scratch / f"compact_{size}", ignore_errors=True)
        shutil.rmtree(o.scratch / f"edit_{size}", ignore_errors=True)
        shutil.rmtree(o.scratch / f"kept_{size}.copy", ignore_errors=True)
        shutil.rmtree(o.scratch / f"compact-before_{size}", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
