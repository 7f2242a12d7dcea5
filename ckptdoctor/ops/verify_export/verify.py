"""``verify-export``: does a Hugging Face export match its Megatron checkpoint?

Metadata only by default (the checkpoint's ``.metadata`` and saved args, the export's config.json, index and shard
headers): the HF files' own consistency, every checkpoint tensor's HF tensors with their shapes for every layer
and expert, every HF tensor accounted for, and config.json against the args. ``--values`` (torch) compares each
HF tensor with the checkpoint slice it should equal after undoing the fused layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptdoctor.checkpoint import Checkpoint
from ckptdoctor.errors import CkptError
from ckptdoctor.formats.hf_export import HfExport, read_export
from ckptdoctor.ops.verify_export.expected import Dims, Expected, derived_args, expected_tensors
from ckptdoctor.ops.verify_export.mapping import Mapping, builtin_mappings, choose_mapping, load_mapping_file
from ckptdoctor.ops.verify_export.report import SCHEMA, ExportFinding, ExportTensor, VerifyExportReport
from ckptdoctor.ops.verify_export.values import compare_values
from ckptdoctor.progress import Progress
from ckptdoctor.severity import ERROR, INFO, WARNING


@dataclass
class VerifyOptions:
    family: str | None = None
    mapping_file: str | None = None
    values: bool = False
    strict: bool = False  # warnings (a dtype change) make the verdict a mismatch
    jobs: int | None = None  # --values workers (None: the available cores)


def verify_export(
    checkpoint: Checkpoint,
    hf_dir: str | Path,
    options: VerifyOptions,
    progress: Progress | None = None,
) -> VerifyExportReport:
    export = read_export(hf_dir)
    mappings = builtin_mappings()
    if options.mapping_file is not None:
        mappings.update(load_mapping_file(options.mapping_file))
    mapping = choose_mapping(mappings, export.config, options.family)
    args, source = checkpoint.saved_config()  # Megatron-LM's args, else Megatron-Bridge's run_config.yaml model
    if source is None:
        raise CkptError(
            f"{checkpoint.iteration_dir}: no saved args (nor run_config.yaml); the shapes cannot be derived"
        )
    findings = file_findings(export)
    dims = Dims.from_args(args, export.config)
    expected, unmapped = expected_tensors(checkpoint, mapping, dims)
    held = export.holder()  # optional tensors (an MTP layer's copies of shared ones) count only where present
    expected = [want for want in expected if not want.optional or want.hf_name in held]
    for item in unmapped:
        findings.append(
            ExportFinding("unmapped", WARNING, f"{item.megatron_key}: {item.reason}", megatron_key=item.megatron_key)
        )
    tensors, coverage = coverage_findings(export, expected, args)
    findings.extend(coverage)
    findings.extend(unfilled_findings(expected, mapping))
    findings.extend(config_findings(export.config, derived_args(args), mapping))
    compared = 0
    notes: list[str] = []
    if options.values:
        compared, value_findings, notes = compare_values(
            checkpoint, export, expected, tensors, dims, progress, options.jobs
        )
        findings.extend(value_findings)
    counts = {
        "errors": sum(f.severity == ERROR for f in findings),
        "warnings": sum(f.severity == WARNING for f in findings),
        "infos": sum(f.severity == INFO for f in findings),
    }
    bad = counts["errors"] or (options.strict and counts["warnings"])
    return VerifyExportReport(
        schema=SCHEMA,
        checkpoint=str(checkpoint.iteration_dir),
        hf_dir=export.path,
        family=mapping.family,
        model_type=export.config.get("model_type"),
        verdict="mismatch" if bad else "match",
        shards=len(export.shards) + len(export.missing_shards) + len(export.unreadable),
        hf_tensors=len(tensors),
        expected_tensors=len(expected),
        values_compared=compared,
        counts=counts,
        findings=findings,
        tensors=tensors,
        notes=notes,
    )


def file_findings(export: HfExport) -> list[ExportFinding]:
    """The export's own consistency: index against shards, headers against file sizes."""
    findings = [
        ExportFinding("shard-missing", ERROR, f"{shard}: named by the index, not in the dir", shard=shard)
        for shard in export.missing_shards
    ]
    findings += [
        ExportFinding("shard-unreadable", ERROR, why, shard=shard) for shard, why in sorted(export.unreadable.items())
    ]
    for shard, header in sorted(export.shards.items()):
        cut = header.cut_tensors()
        if cut:
            named = ", ".join(cut[:3]) + (", ..." if len(cut) > 3 else "")
            findings.append(
                ExportFinding(
                    "truncated",
                    ERROR,
                    f"{shard}: the header places {header.data_bytes} data bytes, the file holds {header.buffer_bytes} "
                    f"after its header ({len(cut)} tensor(s) cut: {named})",
                    shard=shard,
                )
            )
    seen: dict[str, str] = {}
    for shard, header in sorted(export.shards.items()):
        for name in header.tensors:
            if name in seen:
                findings.append(
                    ExportFinding("duplicate", ERROR, f"{name}: in {seen[name]} and {shard}", hf_name=name, shard=shard)
                )
            else:
                seen[name] = shard
    if export.index is not None:
        gone = set(export.missing_shards) | set(export.unreadable)
        for name, shard in sorted(export.index.items()):
            if shard not in gone and name not in export.shards[shard].tensors:
                findings.append(
                    ExportFinding(
                        "ghost",
                        ERROR,
                        f"{name}: the index lists it in {shard}, which does not hold it",
                        hf_name=name,
                        shard=shard,
                    )
                )
        for shard, header in sorted(export.shards.items()):
            for name in sorted(header.tensors):
                if export.index.get(name) != shard:
                    listed = export.index.get(name)
                    where = f"the index lists it in {listed}" if listed else "the index does not list it"
                    findings.append(
                        ExportFinding("orphan", ERROR, f"{name}: held by {shard}; {where}", hf_name=name, shard=shard)
                    )
        findings += [
            ExportFinding("unindexed-file", WARNING, f"{name}: a safetensors file the index never names", shard=name)
            for name in export.unindexed_files
        ]
    return findings


def coverage_findings(
    export: HfExport, expected: list[Expected], args: dict[str, Any]
) -> tuple[list[ExportTensor], list[ExportFinding]]:
    """Every expected HF tensor present with its shape; every HF tensor accounted for."""
    held = export.holder()
    infos = {name: export.shards[shard].tensors[name] for name, shard in held.items()}
    by_name = {e.hf_name: e.megatron_key for e in expected}
    findings: list[ExportFinding] = []
    tensors = [
        ExportTensor(name, held[name], info.torch_dtype, list(info.shape), by_name.get(name))
        for name, info in sorted(infos.items())
    ]
    tied = bool(derived_args(args).get("tie_word_embeddings"))
    for want in expected:
        if want.hf_name not in held:
            findings.append(
                ExportFinding(
                    "missing",
                    ERROR,
                    f"{want.hf_name}: not in the export (from {want.megatron_key}{_where(want)})",
                    hf_name=want.hf_name,
                    megatron_key=want.megatron_key,
                    layer=want.layer,
                    expert=want.expert,
                )
            )
            continue
        shard = held[want.hf_name]
        info = infos[want.hf_name]
        if info.shape != want.shape:
            findings.append(
                ExportFinding(
                    "shape",
                    ERROR,
                    f"{want.hf_name}: shape {list(info.shape)}, expected {list(want.shape)} "
                    f"(from {want.megatron_key}{_where(want)})",
                    hf_name=want.hf_name,
                    megatron_key=want.megatron_key,
                    shard=shard,
                    layer=want.layer,
                    expert=want.expert,
                )
            )
        if want.dtype and info.torch_dtype != want.dtype:
            findings.append(
                ExportFinding(
                    "dtype",
                    WARNING,
                    f"{want.hf_name}: {info.torch_dtype}, the checkpoint's {want.megatron_key} is {want.dtype}",
                    hf_name=want.hf_name,
                    megatron_key=want.megatron_key,
                    shard=shard,
                    layer=want.layer,
                    expert=want.expert,
                )
            )
    for name, shard in sorted(held.items()):
        if name in by_name:
            continue
        if name == "lm_head.weight" and tied:
            findings.append(
                ExportFinding(
                    "extra",
                    INFO,
                    f"{name}: stored although the checkpoint ties it to the embedding",
                    hf_name=name,
                    shard=shard,
                )
            )
            continue
        findings.append(
            ExportFinding("extra", ERROR, f"{name}: no checkpoint tensor maps to it", hf_name=name, shard=shard)
        )
    return tensors, findings


def unfilled_findings(expected: list[Expected], mapping: Mapping) -> list[ExportFinding]:
    """The HF model's tensors no checkpoint tensor fills (the family's ``requires``): transformers initialises them
    at random, so the export, however complete, does not compute the checkpoint's model."""
    names = {want.hf_name for want in expected}
    layers = sorted({want.layer for want in expected if want.layer is not None})
    findings: list[ExportFinding] = []
    for have, needs in mapping.requires.items():
        have_rule, needs_rule = mapping.layer_rules[have], mapping.layer_rules[needs]
        for layer in layers:
            if have_rule.hf[0].format(layer=layer, expert=0) not in names:
                continue
            wanted = [name.format(layer=layer, expert=0) for name in needs_rule.hf]
            if any(name in names for name in wanted):
                continue
            findings.extend(
                ExportFinding(
                    "random-init",
                    WARNING,
                    f"{name}: the {mapping.family} model has it, the checkpoint has no {needs} in layer {layer} to "
                    f"fill it (transformers initialises it at random: not the checkpoint's model)",
                    hf_name=name,
                    layer=layer,
                )
                for name in wanted
            )
    return findings


def _where(want: Expected) -> str:
    parts = []
    if want.layer is not None:
        parts.append(f"layer {want.layer}")
    if want.expert is not None:
        parts.append(f"expert {want.expert}")
    return f", {', '.join(parts)}" if parts else ""


def _config_value(config: dict[str, Any], field: str) -> Any:
    if field == "rope_theta" and "rope_theta" not in config:
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        return rope.get("rope_theta") if isinstance(rope, dict) else None
    return config.get(field)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def config_findings(config: dict[str, Any], args: dict[str, Any], mapping: Mapping) -> list[ExportFinding]:
    """config.json's fields against the saved args they state (fields or args absent on either side are skipped)."""
    findings = []
    for field, arg in mapping.config.items():
        have = _config_value(config, field)
        want = args.get(arg)
        if have is None or want is None:
            if field == "vocab_size" and isinstance(have, int):
                padded = args.get("padded_vocab_size")
                if isinstance(padded, int) and have > padded:
                    findings.append(
                        ExportFinding(
                            "config",
                            ERROR,
                            f"config.json vocab_size {have} > the checkpoint's padded_vocab_size {padded}",
                        )
                    )
            continue
        if field == "shared_expert_intermediate_size" and not want:
            continue
        if not _equal(have, want):
            findings.append(
                ExportFinding("config", ERROR, f"config.json {field} = {have!r}, the saved args' {arg} = {want!r}")
            )
    return findings
