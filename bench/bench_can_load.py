"""can-load on a synthetic 20,000-key checkpoint: the modelling alone and the whole process, against inspect.

    .venv/bin/python bench/bench_can_load.py [--keys 20000] [--rounds 5] [--code WORKTREE]

Uses the one harness (bench/harness.py): the cached synthetic checkpoint of make_synthetic.py (per-layer MoE
keys), one alternating group of child processes per run: ``ckptdoctor can-load`` whole processes for four
targets, the whole ``ckptdoctor inspect`` process on the same checkpoint (the same metadata read: the baseline),
and, for each target, ``predict()`` alone timed inside a child after the checkpoint is opened (reported on a
``BENCH_SECONDS=`` line). Writes bench/results/can_load.json; the README table is made from it.
"""

from __future__ import annotations

import argparse
import sys

import harness
from harness import Case, alternate, ckptdoctor, fmt_spread

TARGETS: tuple[tuple[str, ...], ...] = (
    ("tp=4",),
    ("tp=1,pp=2",),
    ("tp=2", "--set", "num_layers=3"),
    ("tp=2", "--strictness", "raise_all"),
)
_PREDICT_ONLY = """
import sys, time
from ckptdoctor.checkpoint import open_checkpoint
from ckptdoctor.ops.can_load.predict import LoadRun, predict
from ckptdoctor.ops.can_load.run import parse_sets
save, target, *extra = sys.argv[1:]
sets = parse_sets(extra[1:2]) if extra[:1] == ["--set"] else {}
strictness = extra[1] if extra[:1] == ["--strictness"] else "assume_ok_unexpected"
ckpt = open_checkpoint(save)
ckpt.common_state()
t0 = time.perf_counter()
report = predict(ckpt, target, LoadRun(sets=sets, strictness=strictness))
seconds = time.perf_counter() - t0
assert "torch" not in sys.modules and "megatron" not in sys.modules
print(report.verdict)
print(f"BENCH_SECONDS={seconds}")
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    harness.add_common_options(parser)
    opts = parser.parse_args(argv)
    harness.use_code(opts.code)
    recorder = harness.Recorder("can_load", argv)
    save = harness.synthetic("16M", opts.keys, 16)
    cases: dict[str, Case] = {"inspect": Case(ckptdoctor("inspect", str(save)))}
    for target in TARGETS:
        label = " ".join(target)
        cases[f"can-load {label}"] = Case(ckptdoctor("can-load", str(save), "--target", *target), ok_rcs=(0, 1))
        predict_cmd = [harness.PYTHON, "-c", _PREDICT_ONLY, str(save), *target]
        cases[f"predict() {label}"] = Case(predict_cmd, metric="reported")
    group = alternate(cases, opts.rounds)
    rows = []
    for target in TARGETS:
        label = " ".join(target)
        rows.append(
            {
                "target": label,
                "predict_s": group.seconds(f"predict() {label}"),
                "process_s": group.seconds(f"can-load {label}"),
                "process_cpu_s": group.cpu(f"can-load {label}"),
                "ratio_to_inspect": group.ratio(f"can-load {label}", "inspect"),
            }
        )
        print(
            f"{label:32} predict() {fmt_spread(rows[-1]['predict_s'])} s, process {fmt_spread(rows[-1]['process_s'])}"
            f" s (CPU {fmt_spread(rows[-1]['process_cpu_s'])} s), x inspect {fmt_spread(rows[-1]['ratio_to_inspect'])}"
        )
    print(f"{'inspect':32} process {fmt_spread(group.seconds('inspect'))} s (CPU {fmt_spread(group.cpu('inspect'))} s)")
    recorder.write(
        {
            "synthetic": harness.synthetic_info(save),
            "rows": rows,
            "inspect_s": group.seconds("inspect"),
            "inspect_cpu_s": group.cpu("inspect"),
            "group": group.summary(),
        }
    )
    return 0 if not group.failures else 1


if __name__ == "__main__":
    sys.exit(main())
