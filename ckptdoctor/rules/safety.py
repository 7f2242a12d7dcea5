"""Safety rules (CKD4xx), the gate: pickles, archives and configs that a real load would execute, or that attack
the reader.

PyTorch DCP reads ``.metadata`` with plain ``pickle.load``, Megatron reads the common state and sharded objects with
``weights_only=False``, Transformer Engine ``pickle.loads`` its extra state (after its classifier, in 2.16.1, 2.17.1 and
>= 2.18), and Megatron-Bridge instantiates ``_target_`` entries of ``run_config.yaml``: a global in those pickles, or a
target in that file, is code that runs on load. Every pickle ckptdoctor reads goes through
:mod:`ckptdoctor.pickle.unpickler` (an exact allowlist, refused before anything runs) after
:mod:`ckptdoctor.pickle.scanner` (resource limits), and every archive
through :mod:`ckptdoctor.formats.archive`; these rules turn the refusals, and the globals read as inert stand-ins
though not on the allowlist, into findings naming the file, so a check carries on. Every safety finding is an
error, and none can be deselected (:func:`ckptdoctor.rules.is_selected`): the only override is a global the user
trusts on the command line (``--trust-global``), whose finding is reported as overridden.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

from ckptdoctor import problems
from ckptdoctor.checkpoint import decode_object_bytes
from ckptdoctor.errors import CkptError, PickleLimitError, UnlistedGlobalError, UnsafePickleError, without_path
from ckptdoctor.formats.archive import ArchiveError, is_torch_zip
from ckptdoctor.formats.legacy_torch import check_legacy_save
from ckptdoctor.formats.run_config import MAX_RUN_CONFIG_BYTES, RUN_CONFIG, read_run_config
from ckptdoctor.formats.run_config_targets import describe, scan_targets
from ckptdoctor.formats.te_extra_state import is_extra_state_key
from ckptdoctor.formats.torch_dist import check_range_length
from ckptdoctor.pickle.policy import UnlistedGlobal, merged_unlisted, trusted_names
from ckptdoctor.pickle.stand_ins import valid_global_name
from ckptdoctor.rules import ERROR, Finding, RuleInfo, finding
from ckptdoctor.severity import OVERRIDDEN
from ckptdoctor.storage.stream import read_ranges

if TYPE_CHECKING:
    from ckptdoctor.checkpoint import Checkpoint

UNSAFE_PICKLE = RuleInfo(
    problems.UNSAFE_PICKLE,
    "unsafe-pickle",
    "safety",
    ERROR,
    "a pickle references a global outside the allowlist",
    "common.pt, .metadata, common_state and bytes items are pickles; PyTorch DCP and Megatron load them with "
    "plain pickle / weights_only=False, so a reference to os.system, eval, subprocess, or a torch/numpy helper "
    "that reaches them (torch.os.system, execWrapper) executes on load. The allowlist is exact (module and "
    "name); dotted names and names that are not identifiers are refused. ckptdoctor refuses without executing "
    "anything, and write commands never copy such a pickle; the checkpoint must not be loaded until the file "
    "is replaced.",
)
UNLISTED_GLOBAL = RuleInfo(
    problems.UNLISTED_GLOBAL,
    "unlisted-global",
    "safety",
    ERROR,
    "a pickle references a megatron / transformer_engine / nemo global that is not on the allowlist",
    "ckptdoctor reads it as an inert stand-in (nothing runs here, so inspect, show and diff still work), but a "
    "real load imports the real object and calls it, instantiates it or hands it on, as the pickle says; "
    "megatron-core ships helpers that import a name given as data and call it. The message says how the pickle "
    "uses the name. A new Megatron release can add names to its checkpoints: if you know the name and its "
    "code, pass --trust-global MODULE.NAME (command line only); no --ignore or config deselects this rule.",
)
PICKLE_LIMIT = RuleInfo(
    problems.PICKLE_LIMIT,
    "pickle-limit",
    "safety",
    ERROR,
    "a pickle breaks a resource limit (nesting, memo, size, or it mutates a shared class)",
    "A few MB of hostile pickle can crash a loader (a million-deep tuple overflows the C stack when hashed) "
    "or make it allocate gigabytes. Real checkpoints stay far inside the limits; raise --max-pickle-bytes "
    "for a legitimate giant.",
)
ARCHIVE_ANOMALY = RuleInfo(
    problems.ARCHIVE_ANOMALY,
    "archive-anomaly",
    "safety",
    ERROR,
    "a torch.save archive holds duplicate members, several prefixes or unsafe member names",
    "torch reads the first of two members with one name, other zip readers the last: the checkpoint means "
    "different things to different tools, and a check of one is no check of the other. torch refuses "
    "archives with several prefixes and member names that leave the archive directory.",
)

UNSAFE_CONFIG_TARGET = RuleInfo(
    problems.UNSAFE_CONFIG_TARGET,
    "unsafe-config-target",
    "safety",
    ERROR,
    "run_config.yaml names a _target_ that is not an allowlisted Megatron-Bridge config or provider class",
    "Megatron-Bridge's load and convert paths instantiate run_config.yaml's model (and tokenizer) sections from "
    "their _target_ entries: any importable dotted path, called with arguments from the file. Only the "
    "Megatron-Bridge provider and config classes (and functions referenced with _call_: false) are data; "
    "anything else, or a _target_ the line scanner cannot attribute for certain, fails the gate.",
)

RULES = [UNSAFE_PICKLE, UNLISTED_GLOBAL, PICKLE_LIMIT, ARCHIVE_ANOMALY, UNSAFE_CONFIG_TARGET]


def stand_ins_note(names: list[str]) -> str:
    """What a read-only command says of the globals it read as stand-ins (it reads on; ``check`` fails them)."""
    return f"not allowlisted {', '.join(names)}: read as inert stand-ins here; a real load runs them (check: CKD402)"


def refused_pickle(error: CkptError, path: object, what: str) -> Finding:
    """The CKD4xx finding for a refusal raised while reading ``what`` (e.g. "common state", "item <key>")."""
    if isinstance(error, UnlistedGlobalError):
        message = f"{what}: pickle references {error.global_name}, {error.detail}"
        return _about(finding(UNLISTED_GLOBAL, path, message), error.global_name)
    if isinstance(error, UnsafePickleError):
        why = error.detail or "not on the allowlist"
        return _about(
            finding(
                UNSAFE_PICKLE, path, f"{what}: pickle references {error.global_name}, {why} (refused, nothing executed)"
            ),
            error.global_name,
        )
    if isinstance(error, PickleLimitError):
        limit = finding(PICKLE_LIMIT, path, f"{what}: {_without_place(str(error))}")
        return limit if error.global_name is None else _about(limit, error.global_name)
    if isinstance(error, ArchiveError):
        return finding(ARCHIVE_ANOMALY, path, f"{what}: {_without_place(str(error))}")
    return finding(UNSAFE_PICKLE, path, f"{what}: {error}")


def gate_findings(read: Callable[[list[UnlistedGlobal]], object], path: object, what: str) -> list[Finding]:
    """The gate's findings about one pickle (or a chain of them: an archive, its nested saves): ``read(unlisted)``
    reads it through the one unpickler, collecting the globals read as stand-ins though not on the allowlist. A
    refusal is one finding (what was read before it is reported too); damage (any other :class:`CkptError`) is
    raised for the caller's own rules."""
    unlisted: list[UnlistedGlobal] = []
    try:
        read(unlisted)
    except (UnsafePickleError, PickleLimitError, ArchiveError) as exc:
        return [refused_pickle(exc, path, what), *unlisted_globals(unlisted, path, what)]
    return unlisted_globals(unlisted, path, what)


def item_findings(key: str, data: bytes, path: object) -> list[Finding]:
    """The gate on one bytes item (a ShardedObject: rng state, ``_extra_state``, optimizer leftovers), as megatron-core
    loads it with ``torch.load(weights_only=False)``: a ``torch.save`` archive's pickle (its storages only where a
    loader unpickles them: Transformer Engine's extra state), or, for bytes that are no zip archive, the pickles
    torch's legacy reader unpickles from the first byte (a tar archive, torch's legacy tar format, is an archive
    anomaly, CKD404: the gate cannot vouch for it). Damage is not the gate's business (``check --deep`` reports it):
    [] then, with whatever the pickles read before it named."""
    what = f"item {key}"
    legacy = bool(data) and not is_torch_zip(data)
    seen: list[UnlistedGlobal] = []

    def read(unlisted: list[UnlistedGlobal]) -> None:
        try:
            if legacy:
                check_legacy_save(data, what, unlisted)
            else:
                decode_object_bytes(data, what, unlisted)
        except (UnsafePickleError, PickleLimitError):
            raise
        except ArchiveError:
            if not legacy:
                raise
            if _is_tar(data):  # torch.load's legacy tar format: pickles ckptdoctor does not read, cannot vouch for
                raise ArchiveError(
                    f"{what}: a tar archive, which torch.load reads as its legacy tar format (pickles ckptdoctor "
                    "does not read)"
                ) from None
            seen.extend(unlisted)  # no pickle stream either: torch.load fails where ckptdoctor did (damage)
            raise CkptError(what) from None
        except CkptError:
            seen.extend(unlisted)
            raise

    try:
        return gate_findings(read, path, what)
    except CkptError:
        return unlisted_globals(seen, path, what)


def _is_tar(data: bytes) -> bool:
    """A tar header (its checksum valid) at the start: what torch's legacy reader opens with ``tarfile``."""
    import tarfile

    try:
        tarfile.TarInfo.frombuf(data[:512], "utf-8", "surrogateescape")
    except (tarfile.HeaderError, ValueError):
        return False
    return True


def check_items(
    checkpoint: Checkpoint,
    shown: Path,
    skip_files: Collection[str] = (),
    keys: Collection[str] | None = None,
    with_common: bool = False,
) -> list[Finding]:
    """The gate on every bytes item (of ``keys``, when given: what a write carries), the common state item only
    ``with_common`` (plain ``check`` gates it as the common state): each item's pickle is read (a few KB each; the
    ranges of one data file together, front to back), never a tensor chunk (``--deep``). Items in ``skip_files``
    (missing or truncated data files, reported by the structure rules) and ranges that cannot be read are left to
    those rules."""
    out: list[Finding] = []
    common = None if with_common else checkpoint.common_source
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for entry in checkpoint.entries.values():
        location = entry.chunks[0].storage if entry.chunks else None
        if entry.kind == "tensor" or entry.key == common or location is None:
            continue
        if location.relative_path in skip_files or (keys is not None and entry.key not in keys):
            continue
        data_file = checkpoint.iteration_dir / location.relative_path
        try:  # a range longer than a pickle may be is never read (a hostile .metadata could name 100 GB)
            check_range_length(data_file, location, entry.max_range_bytes(entry.chunks[0]))
        except PickleLimitError as exc:
            out.append(refused_pickle(exc, shown / location.relative_path, f"item {entry.key}"))
            continue
        by_file.setdefault(location.relative_path, []).append((location.offset, location.length, entry.key))
    files = [(checkpoint.iteration_dir / rel, sorted(ranges)) for rel, ranges in sorted(by_file.items())]
    shown_of = {checkpoint.iteration_dir / rel: shown / rel for rel in by_file}
    for data_file, key, blob in read_ranges(files):
        if isinstance(blob, CkptError) or key is None:
            continue  # unreadable: the structure rules (and --deep) report it
        data = bytes(blob)
        if is_extra_state_key(key):  # the extra-state census (rules/extra_state) reads them again: no second request
            checkpoint.keep_item_bytes(key, data)
        out += item_findings(key, data, shown_of[data_file])
    return out


def unlisted_globals(entries: list[UnlistedGlobal], path: object, what: str) -> list[Finding]:
    """CKD402, once per distinct global of one pickle read as a stand-in though not on the allowlist, saying how
    the pickle uses it; a trusted one (``--trust-global``) as an overridden finding (listed, never counted)."""
    out = []
    for entry in merged_unlisted(entries):
        if entry.trusted:
            message = f"{what}: pickle references {entry.name}, not on the allowlist, trusted by --trust-global"
            out.append(Finding(UNLISTED_GLOBAL.code, str(path), message, OVERRIDDEN, subject=entry.name))
            continue
        message = (
            f"{what}: pickle references {entry.name}, {entry.use}; not on the allowlist (ckptdoctor read it as an "
            "inert stand-in, nothing ran here)"
        )
        out.append(_about(finding(UNLISTED_GLOBAL, path, message), entry.name))
    return out


def _about(f: Finding, subject: str) -> Finding:
    return Finding(f.code, f.path, f.message, f.severity, f.fix, subject)


def _without_place(message: str) -> str:
    # Errors name their file ("<path>: ..."); the finding already carries the path.
    head, sep, rest = message.partition(": ")
    return rest if sep and ("/" in head or head.startswith("item ")) else message


# Where Megatron-LM's saved args name code: with --use-checkpoint-args, load_args_from_checkpoint copies the saved
# ``spec`` into the run (megatron/training/checkpointing.py, ``_set_arg('spec', force=True)``), and the model
# provider imports it (megatron/training/argument_utils.py: ``import_module(args.spec)``: ``__import__`` of the
# module, then one of its names). Megatron's own layer specs live in these packages.
SPEC_MODULE_PREFIXES = ("megatron.core.models.", "megatron.core.transformer.")


def saved_spec_findings(args: object, path: object, what: str) -> list[Finding]:
    """CKD405 for a saved ``args.spec`` outside Megatron's own spec modules (``--trust-global MODULE.NAME`` trusts
    one): Megatron-LM imports it by name when it loads with ``--use-checkpoint-args``."""
    spec = getattr(args, "spec", None) if args is not None and not isinstance(args, dict) else None
    if isinstance(args, dict):
        spec = args.get("spec")
    if spec is None:
        return []
    parts = list(spec) if isinstance(spec, (list, tuple)) else None
    named = (
        parts is not None and len(parts) == 2 and all(isinstance(p, str) for p in parts) and valid_global_name(*parts)
    )
    name = f"{parts[0]}.{parts[1]}" if named and parts is not None else None
    if name is not None and (name.startswith(SPEC_MODULE_PREFIXES) or name in trusted_names()):
        return []
    shown = name or repr(spec)[:120]
    message = (
        f"{what}: saved args.spec names {shown}, which Megatron-LM imports by name (__import__, then the name) when "
        "it loads with --use-checkpoint-args; only Megatron's own spec modules (megatron.core.models.*, "
        "megatron.core.transformer.*) are data"
    )
    return [_about(finding(UNSAFE_CONFIG_TARGET, path, message), shown)]


def run_config_findings(iteration_dir: Path, shown: Path) -> list[Finding]:
    """CKD405 for each ``_target_`` of the iteration dir's Megatron-Bridge ``run_config.yaml`` that the gate refuses
    (:mod:`ckptdoctor.formats.run_config_targets`: the allowlist, and what its line scanner cannot vouch for); a
    target trusted with ``--trust-global`` passes. A file too large to read is one finding (what the gate has not
    read it cannot vouch for); one that is no text is damage (Bridge's ``yaml.safe_load`` fails on it too)."""
    path = shown / RUN_CONFIG
    try:
        text = read_run_config(iteration_dir)
    except CkptError as exc:
        try:
            too_large = (iteration_dir / RUN_CONFIG).stat().st_size > MAX_RUN_CONFIG_BYTES
        except OSError:
            too_large = False
        if not too_large:  # not text, not a regular file: yaml.safe_load fails on it too (damage, not code)
            return []
        message = f"cannot be checked: {without_path(exc, iteration_dir / RUN_CONFIG)}"
        return [_about(finding(UNSAFE_CONFIG_TARGET, path, message), RUN_CONFIG)]
    if text is None:
        return []
    scan = scan_targets(text)
    trusted = set(trusted_names())
    out = []
    for found in scan.findings:
        message = describe(found).removeprefix("run_config.yaml ")
        if found.kind == "refused" and found.target in trusted:
            out.append(Finding(UNSAFE_CONFIG_TARGET.code, str(path), message, OVERRIDDEN, subject=found.target))
            continue
        out.append(_about(finding(UNSAFE_CONFIG_TARGET, path, message), found.target or found.path or RUN_CONFIG))
    if scan.truncated and not any(f.severity != OVERRIDDEN for f in out):
        message = "cannot be checked: too many _target_ entries or nesting too deep for the scanner"
        out.append(_about(finding(UNSAFE_CONFIG_TARGET, path, message), RUN_CONFIG))
    return out
