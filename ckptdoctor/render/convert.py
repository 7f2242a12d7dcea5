"""Text for ``ckptdoctor convert``: every key's place in the target format, what is not carried, what was written."""

from __future__ import annotations

from ckptdoctor.ops.convert.plan import ConvertPlan
from ckptdoctor.ops.convert.write import ConvertReport
from ckptdoctor.render.common import human_bytes
from ckptdoctor.text_safety import text_safe


def _swiglu_note(swiglu: bool, target: str) -> str:
    if not swiglu:
        return ""
    how = "joined from" if target == "torch_dist" else "split into"
    return f" (SwiGLU: linear_fc1 {how} _w/_v)"


def _precision_note(plan: ConvertPlan) -> str:
    """What mixed precision changed: where the fp32 main params come from or go to, and what was cast."""
    cast = sum(1 for m in plan.mappings if m.cast)
    if plan.target_format == "torch_dist":
        return (
            f"{plan.model_dtype} model, fp32 main params: {cast} source keys cast to {plan.model_dtype}, "
            "their fp32 values kept as optimizer.state.param where the parameter has optimizer state"
        )
    mains = sum(
        1
        for m in plan.mappings
        if m.source.startswith("optimizer.state.param.") and m.targets and m.targets[0].startswith("model.")
    )
    return (
        f"{plan.model_dtype} model, fp32 main params: model.module.* holds them, {mains} from optimizer.state.param, "
        f"{cast} cast up from the model copy (no main params saved)"
    )


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
    ]
    if plan.model_dtype:
        lines.append("precision       " + _precision_note(plan))
    lines += ["", "key mapping"]
    for mapping in plan.mappings:
        cast = f", cast to {mapping.cast}" if mapping.cast else ""
        lines.append(f"  {mapping.source}  ({mapping.how}{cast})")
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
