"""Text for ``ckptdoctor convert``: every key's place in the target format, what is not carried, what was written."""

from __future__ import annotations

from ckptdoctor.ops.convert.write import ConvertReport
from ckptdoctor.render.common import human_bytes
from ckptdoctor.text_safety import text_safe


def _swiglu_note(swiglu: bool, target: str) -> str:
    if not swiglu:
        return ""
    how = "joined from" if target == "torch_dist" else "split into"
    return f" (SwiGLU: linear_fc1 {how} _w/_v)"


@text_safe
def render_convert(report: ConvertReport) -> str:
    """The plan (every source key and the output keys it becomes, then what the output cannot carry and why),
    then what was written, or that nothing was on a dry run."""
    plan, result = report.plan, report.result
    outputs = sum(len(m.targets) for m in plan.mappings)
    lines = [
        f"checkpoint      {plan.source}",
        f"conversion      {plan.source_format} -> {plan.target_format}{_swiglu_note(plan.swiglu, plan.target_format)}",
        f"keys            {len(plan.mappings)} source items -> {outputs} output keys, "
        f"{len(plan.not_carried)} not carried",
        "args            " + ", ".join(f"{name}={value!r}" for name, value in plan.arg_changes.items()),
        "",
        "key mapping",
    ]
    for mapping in plan.mappings:
        lines.append(f"  {mapping.source}  ({mapping.how})")
        lines += [f"    -> {target}" for target in mapping.targets]
    if plan.not_carried:
        lines += ["", "not carried (no place in the target format)"]
        lines += [f"  {item.key}: {item.why}" for item in plan.not_carried]
    lines.append("")
    if result is None:
        lines.append("dry run: nothing written (give -o/--output DIR to write)")
    else:
        lines.append(
            f"written         {result.iteration_dir}: {result.tensors} tensors in {result.chunks} chunks, "
            f"{result.objects} bytes items, {human_bytes(result.output_bytes)} "
            f"(source {human_bytes(result.source_bytes)}) in {result.seconds:.1f} s"
        )
    return "\n".join(lines)
