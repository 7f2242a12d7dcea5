"""Benchmark ``ckptdoctor diff``: structural cost independent of data size, ``--values`` against ``cat``, in one run.

Inputs (``make_synthetic.py`` through ``harness.synthetic``, cached in ``bench/data``): per size, A = TP=2 and
B = the same model saved at TP=4 (20,000 keys, 2,000 data files, ``--shape-tp 4``: hidden size and vocab fit TP=4,
so A and B hold the same keys with the same global shapes, and with the generator's default ``--values global``
the same values: B is a reshard of A); for ``--values`` also a private byte copy of the largest A
(``diffcopy_<size>``: the common "is this copy / resumed save the same" case).

Checked before anything is reported (``check_inputs``, ``check_outputs``: from the synthetics' own records and the
JSON of each command's warm-up run): A and B have the same hidden size, vocab, layers and experts; the structural
diff finds no key on one side only and no dtype or shape change, only layout; each ``--values`` diff compares every
tensor key, reads both checkpoints' data and finds no value difference.

Measured: one alternating group (``harness.alternate``: a warm-up round, then ``--rounds`` rounds, the order
rotating), every command its own child process (wall spawn -> exit, that child's peak RSS via ``wait4``):

- ``structural-<size>``: ``diff A B --format json --limit 20``; per-round ratio largest / smallest size (<= 1.3);
- ``values-copy``: ``diff A COPY --values --format json --limit 20`` and ``cat-copy`` (``cat`` of both
  checkpoints' files to /dev/null): per-round ``cat`` / ``diff`` = the fraction of ``cat``'s throughput (>= 60%),
  peak RSS against 3x the largest chunk + 300 MB;
- ``values-reshard``: ``diff A B --values ...`` (TP=2 against TP=4: the cross-layout decode path, every TP-split
  chunk decoded and compared by region) and ``cat-reshard``: the same figures.

Then, unless ``--skip-workaround``, the usual workaround at the largest size, once (it reads every byte anyway):
``dcp_to_torch_save`` both, ``torch.load`` both, compare the dicts; over the structural diff's median (>= 50x).

    python bench/bench_diff.py                      # 0.5G and 2G, 3 rounds -> bench/results/diff.json
    python bench/bench_diff.py --sizes 0.5G --rounds 1 --skip-workaround   # a quick run
    python bench/bench_diff.py --render             # the table of bench/results/diff.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402  (no torch: the measured children start small)
from harness import DATA, PYTHON, RESULTS, Case, alternate, ckptdoctor, fmt_spread  # noqa: E402

KEYS, FILES = 20000, 2000
SHAPE_TP = "4"  # both saves' hidden size and vocab fit TP=4: one model, two layouts
SAME_MODEL = ("hidden", "vocab", "layers", "experts", "layout", "dtype", "shape_tp", "values")
WORKAROUND = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
a_dir, b_dir, a_pt, b_pt = sys.argv[1:5]
dcp_to_torch_save(a_dir, a_pt)
dcp_to_torch_save(b_dir, b_pt)
a = torch.load(a_pt, weights_only=False)
b = torch.load(b_pt, weights_only=False)
only = len(a.keys() ^ b.keys())
differ = 0
for k in a.keys() & b.keys():
    x, y = a[k], b[k]
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        differ += not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
    else:
        differ += not (type(x) is type(y))
print(only, "keys on one side,", differ, "differ")
"""


def largest_chunk(*saves: Path) -> int:
    """The largest chunk's bytes (from ckptdoctor's own reader: no torch in this process)."""
    sys.path.insert(0, str(harness.CODE))
    from ckptdoctor.checkpoint import open_checkpoint

    return max(
        c.storage.length
        for save in saves
        for e in open_checkpoint(save).entries.values()
        for c in e.chunks
        if c.storage is not None
    )


def cat_both(a: Path, b: Path) -> tuple[list[str], int]:
    """``cat`` of both checkpoints' ``.distcp`` and ``.metadata`` files to /dev/null, and their bytes."""
    files, total = [], 0
    for save in (a, b):
        iteration, names, size = harness.iteration_files(save)
        files += [str(iteration / n) for n in names]
        total += size
    return ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files], total


def check_inputs(a: Path, b: Path) -> dict:
    """A and B are one model in two layouts: the generator's records of both agree on every shape input."""
    ia, ib = harness.synthetic_info(a), harness.synthetic_info(b)
    differ = {k: (ia.get(k), ib.get(k)) for k in SAME_MODEL if ia.get(k) != ib.get(k)}
    if differ or (ia["tp"], ib["tp"]) != (2, 4):
        raise SystemExit(f"{a.name} / {b.name} are not TP=2 / TP=4 saves of one model: {differ}")
    return {k: ia.get(k) for k in SAME_MODEL} | {"tp": [ia["tp"], ib["tp"]], "tensor_keys": ia["tensor_keys"]}


def check_outputs(doc: dict, label: str, tensor_keys: int, values: bool) -> dict:
    """What the warm-up run of ``label`` printed says it compared; raises when it compared less than it claims."""
    s = doc["summary"]
    problems = [f"{k}={s[k]}" for k in ("only_a", "only_b", "changed") if s[k]]
    seen: dict = {"keys_a": doc["a"]["keys"], "keys_b": doc["b"]["keys"], "layout_keys": s["layout"]}
    if values:
        v = doc["values"]
        seen |= {k: v[k] for k in ("compared", "equal", "different", "not_compared", "bytes_read", "workers")}
        seen["not_compared_keys"] = {k["key"]: k["note"] for k in v["not_compared_keys"]}
        tensors_left = [k["key"] for k in v["not_compared_keys"] if k["kind"] == "tensor"]
        listed = len(v["not_compared_keys"]) == v["not_compared"]  # objects sharded differently: layout, not data
        if v["compared"] < tensor_keys or tensors_left or not listed or v["different"]:
            problems.append(
                f"values compared {v['compared']} of {tensor_keys} tensor keys, {v['different']} differ, "
                f"{v['not_compared']} not compared"
            )
        data = {side: doc[side]["data_files"]["bytes"] for side in ("a", "b")}
        if any(v["bytes_read"][side] < 0.99 * data[side] for side in data):
            problems.append(f"read {v['bytes_read']} of data files {data}")
    if problems:
        raise SystemExit(f"{label}: the diff did not compare what this benchmark says: {'; '.join(problems)}")
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_options(p)
    p.add_argument("--sizes", default="0.5G,2G", help="comma-separated; --values runs at the last (largest)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--skip-workaround", action="store_true")
    p.add_argument("--render", action="store_true", help="print the table of bench/results/diff.json")
    p.add_argument("--cleanup", action="store_true", help="then delete the copy and the TP=4 saves")
    o = p.parse_args(argv)
    harness.use_code(o.code)
    if o.render:
        print(render(json.loads((RESULTS / "diff.json").read_text())))
        return 0
    recorder = harness.Recorder("diff", argv)
    sizes = [s.strip() for s in o.sizes.split(",")]
    big = sizes[-1]
    pairs = {
        s: (
            harness.synthetic(s, KEYS, FILES, **{"shape-tp": SHAPE_TP}),
            harness.synthetic(s, KEYS, FILES, **{"shape-tp": SHAPE_TP, "tp": "4"}),
        )
        for s in sizes
    }
    model = {s: check_inputs(a, b) for s, (a, b) in pairs.items()}
    a, b = pairs[big]
    copy = harness.private_copy(a, DATA / f"diffcopy_{big}".replace(".", "p"))
    out = RESULTS / "stdout" / "diff"
    out.mkdir(parents=True, exist_ok=True)
    limit = ["--format", "json", "--limit", "20"]
    cases = {
        f"structural-{s}": Case(
            ckptdoctor("diff", str(x), str(y), *limit), ok_rcs=(0, 1), stdout_path=out / f"{s}.json"
        )
        for s, (x, y) in pairs.items()
    }
    cat_copy, bytes_copy = cat_both(a, copy)
    cat_reshard, bytes_reshard = cat_both(a, b)
    cases |= {
        "cat-copy": Case(cat_copy),
        "values-copy": Case(
            ckptdoctor("diff", str(a), str(copy), "--values", *limit), stdout_path=out / "values-copy.json"
        ),
        "cat-reshard": Case(cat_reshard),
        "values-reshard": Case(
            ckptdoctor("diff", str(a), str(b), "--values", *limit),
            ok_rcs=(0, 1),  # exit 1: the layouts differ (reported, values equal)
            stdout_path=out / "values-reshard.json",
        ),
    }
    group = alternate(cases, o.rounds, o.timeout)
    if group.failures:
        raise SystemExit(f"failed: {group.failures}")
    tensor_keys = model[big]["tensor_keys"]
    checked = {
        label: check_outputs(json.loads(case.stdout_path.read_text()), label, tensor_keys, label.startswith("values"))
        for label, case in cases.items()
        if case.stdout_path is not None
    }
    chunk = largest_chunk(a, b, copy)
    payload: dict = {
        "sizes": sizes,
        "inputs": {s: {"a": harness.synthetic_info(x), "b": harness.synthetic_info(y)} for s, (x, y) in pairs.items()},
        "model": model,
        "checked": checked,
        "bytes": {"copy": bytes_copy, "reshard": bytes_reshard},
        "largest_chunk_bytes": chunk,
        "rss_bound_mb": 3 * chunk / 2**20 + 300,
        "group": group.summary(),
        "ratios": {
            "structural_big_over_small": group.ratio(f"structural-{big}", f"structural-{sizes[0]}"),
            "cat_over_values_copy": group.ratio("cat-copy", "values-copy"),
            "cat_over_values_reshard": group.ratio("cat-reshard", "values-reshard"),
        },
    }
    recorder.write(payload)  # written again with the workaround's figures (kept if the workaround fails)
    if not o.skip_workaround:
        scratch = DATA / "diff_workaround"
        scratch.mkdir(exist_ok=True)
        iteration_a, iteration_b = harness.iteration_files(a)[0], harness.iteration_files(b)[0]
        cmd = [
            PYTHON,
            "-c",
            WORKAROUND,
            str(iteration_a),
            str(iteration_b),
            str(scratch / "a.pt"),
            str(scratch / "b.pt"),
        ]
        try:
            run = harness.run_once(cmd, o.timeout, out / "workaround.txt")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if run.timed_out or run.rc:
            raise SystemExit(f"workaround failed: {run}")
        output = (out / "workaround.txt").read_text().strip()
        payload["workaround"] = asdict(run) | {
            "command": shlex.join(cmd[:2] + ["WORKAROUND", *cmd[3:]]),
            "output": output,
        }
    doc = json.loads(recorder.write(payload).read_text())
    print(harness.header(doc) + "\n\n" + render(doc))
    if o.cleanup:
        shutil.rmtree(copy, ignore_errors=True)
        for _, tp4 in pairs.values():
            shutil.rmtree(tp4, ignore_errors=True)
    return 0


def render(doc: dict) -> str:
    cases, ratios, sizes = doc["group"]["cases"], doc["ratios"], doc["sizes"]
    big, small = sizes[-1], sizes[0]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def data_gb(size: str) -> str:
        return f"{doc['inputs'][size]['a']['data_bytes'] / 1e9:.2f} GB"

    lines = [
        "| case | input | wall s, median [min–max] | CPU s (median) | peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    inputs = {f"structural-{s}": f"A vs B, {data_gb(s)} each" for s in sizes}
    inputs |= {
        "cat-copy": f"A + copy at {big}, {doc['bytes']['copy'] / 1e9:.2f} GB",
        "values-copy": f"A vs copy at {big}",
        "cat-reshard": f"A + B at {big}, {doc['bytes']['reshard'] / 1e9:.2f} GB",
        "values-reshard": f"A (TP=2) vs B (TP=4) at {big}",
    }
    for label, what in inputs.items():
        c = cases[label]
        lines.append(
            f"| `{label}` | {what} | {fmt_spread(c['seconds'], '.2f')} | {c['cpu_s']['median']:.2f} "
            f"| {c['peak_rss_mb']:.0f} |"
        )
    r = ratios["structural_big_over_small"]
    cpu = harness.summary_ratio(cases, f"structural-{big}", f"structural-{small}")
    lines += ["", "| measure | result | target |", "|---|---|---|"]
    lines.append(
        f"| structural {big} / {small}, per round: wall; CPU | {fmt_spread(r, '.2f')}; {fmt_spread(cpu, '.2f')} "
        f"| <= 1.3: {verdict(r['median'] <= 1.3)} |"
    )
    if "workaround" in doc:
        w = doc["workaround"]
        structural = cases[f"structural-{big}"]["seconds"]["median"]
        speedup = w["wall_s"] / structural
        lines.append(
            f"| workaround at {big} (`dcp_to_torch_save` both, `torch.load` both, compare; one run) / structural | "
            f"{w['wall_s']:.1f} s / {structural:.2f} s = {speedup:.0f}x (CPU {w['cpu_s']:.1f} s, peak RSS "
            f"{w['peak_rss_mb'] / 1024:.1f} GiB) | >= 50x: {verdict(speedup >= 50)} |"
        )
    bound = doc["rss_bound_mb"]
    for kind in ("copy", "reshard"):
        ratio = ratios[f"cat_over_values_{kind}"]
        seconds = cases[f"values-{kind}"]["seconds"]["median"]
        cat = cases[f"cat-{kind}"]["seconds"]["median"]
        rss = cases[f"values-{kind}"]["peak_rss_mb"]
        total = doc["bytes"][kind]
        lines.append(
            f"| `--values` {kind} at {big}: throughput vs `cat`, per round | {total / seconds / 1e9:.2f} GB/s vs "
            f"{total / cat / 1e9:.2f} GB/s = {fmt_spread(ratio, '.0%')} | >= 60%: {verdict(ratio['median'] >= 0.6)} |"
        )
        cpu = harness.summary_ratio(cases, f"cat-{kind}", f"values-{kind}")
        lines.append(
            f"| `--values` {kind}: CPU s of `cat` / of the diff, per round (less load-sensitive) "
            f"| {fmt_spread(cpu, '.0%')} | |"
        )
        lines.append(
            f"| `--values` {kind} peak RSS | {rss:.0f} MB (largest chunk {doc['largest_chunk_bytes'] / 2**20:.2f} "
            f"MiB) | <= {bound:.0f} MB: {verdict(rss <= bound)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
