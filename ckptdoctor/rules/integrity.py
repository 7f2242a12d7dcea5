"""Integrity rules (CKD3xx): the rule table of the family, and Megatron's ``integrity.json`` hashes.

The manifest check streams each listed file in 1 MiB pieces. The ``--deep`` rules (CKD310-314) are defined here
with the family; decoding every blob is :mod:`ckptdoctor.rules.deep_decode`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ckptdoctor.errors import CkptError, without_path
from ckptdoctor.formats import BACKEND_ZARR
from ckptdoctor.rules import ERROR, WARNING, Finding, family_rule, finding
from ckptdoctor.rules.structure import Scanned
from ckptdoctor.storage.files import file_sizes, open_regular, read_json

INTEGRITY_NAME = "integrity.json"  # megatron.core.dist_checkpointing.validation.INTEGRITY_FNAME
_READ_SIZE = 1 << 20


_rule = family_rule("integrity")


HASH_MISMATCH = _rule(
    "CKD301",
    "integrity-hash-mismatch",
    ERROR,
    "a file's sha256 differs from integrity.json",
    "Megatron (--verify-integrity) hashed every file at save time; a different hash is silent corruption or "
    "a file replaced after the save, and Megatron's own verification would refuse the load.",
)
LISTED_FILE_MISSING = _rule(
    "CKD302",
    "integrity-file-missing",
    ERROR,
    "a file listed in integrity.json does not exist",
    "The file existed when the save finished; it was lost in a copy or deleted since.",
)
MANIFEST_INVALID = _rule(
    "CKD303",
    "integrity-manifest-invalid",
    ERROR,
    "integrity.json does not parse or uses another algorithm",
    "Megatron's verification needs {'algorithm': 'sha256', 'files': {name: hexdigest}}; anything else fails it.",
)
FILE_UNLISTED = _rule(
    "CKD304",
    "integrity-file-unlisted",
    WARNING,
    "a file in the dir is not listed in integrity.json",
    "integrity.json is written after every other file; an unlisted file was added or rewritten afterwards.",
)
BLOB_UNDECODABLE = _rule(
    "CKD310",
    "blob-undecodable",
    ERROR,
    "--deep: a tensor chunk does not decode to the tensor .metadata declares",
    "Each chunk is a torch.save blob; a corrupt archive, a pickle that is no tensor or a shape/dtype differing "
    "from .metadata makes torch.load fail or load the wrong tensor.",
)
BLOB_SIZE = _rule(
    "CKD311",
    "blob-size-mismatch",
    ERROR,
    "--deep: a chunk's storage bytes differ from numel x itemsize",
    "A storage record shorter or longer than its element count, or a view reaching past its storage, is a "
    "torn write or a hand-made blob; torch reads out of bounds or refuses it.",
)
ITEM_UNDECODABLE = _rule(
    "CKD312",
    "item-undecodable",
    ERROR,
    "--deep: a bytes item (ShardedObject, _extra_state) does not deserialize",
    "Bytes items are torch.save blobs Megatron unpickles on load; a corrupt one fails the load of its module.",
)

NON_FINITE = _rule(
    "CKD313",
    "non-finite-values",
    ERROR,
    "--deep: a model or optimizer tensor holds NaN or Inf values",
    "No converging training run saves NaN or Inf weights or optimizer moments: they are what a loss spike, an "
    "fp16 overflow or a flipped exponent byte leaves behind, and a resume from them trains on garbage. One "
    "finding per key with the NaN and Inf counts (IEEE float16/bfloat16/float32/float64, read without torch); "
    "`latest-good --deep` skips such a checkpoint. The distributed optimizer's flat buckets (keys with "
    "`.bucket_idx_`) are scanned and named with the element ranges of their bad chunks; the padding between "
    "their parameters is not (uninitialized memory, arbitrary bits in a real save: its chunks hold no element at "
    "a multiple of 64, where DDP starts every parameter).",
)
CRC_MISMATCH = _rule(
    "CKD314",
    "crc-mismatch",
    ERROR,
    "--deep: a record of a tensor chunk or bytes item fails the CRC-32 torch.save wrote for it",
    "Every record of a torch.save archive carries the CRC-32 of its bytes as saved; a mismatch is bytes changed "
    "since (a flipped bit on a disk, a bad copy, a hand edit). torch.load does not check it: it loads the changed "
    "values without a word, where a NaN or a shape would be the only sign. Found only by reading every byte "
    "(`--deep`); `seal` and Megatron's integrity.json (CKD301) hash whole files.",
)

RULES = [
    HASH_MISMATCH,
    LISTED_FILE_MISSING,
    MANIFEST_INVALID,
    FILE_UNLISTED,
    BLOB_UNDECODABLE,
    BLOB_SIZE,
    ITEM_UNDECODABLE,
    NON_FINITE,
    CRC_MISMATCH,
]
# --- integrity.json -------------------------------------------------------------------------------------


def check_manifest(state: Scanned, verify_hashes: bool) -> list[Finding]:
    """integrity.json, when present: listed files exist, nothing unlisted, and (``verify_hashes``) sha256."""
    directory, shown = state.iteration_dir, state.shown
    path = directory / INTEGRITY_NAME
    if not path.is_file():
        if path.is_symlink() or path.exists():  # a dir, FIFO, device or dangling link under the manifest's name
            why = "not a regular file (a directory, FIFO, device or dangling link): nothing can verify against it"
            return [finding(MANIFEST_INVALID, shown / INTEGRITY_NAME, why)]
        return []
    try:
        data = read_json(path)
    except OSError as exc:
        return [finding(MANIFEST_INVALID, shown / INTEGRITY_NAME, f"unreadable manifest ({exc.strerror})")]
    except ValueError as exc:  # JSONDecodeError
        return [finding(MANIFEST_INVALID, shown / INTEGRITY_NAME, f"unreadable manifest (not valid JSON: {exc})")]
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        why = "unreadable manifest (not an object whose 'files' maps file names to hex digests)"
        return [finding(MANIFEST_INVALID, shown / INTEGRITY_NAME, why)]
    algorithm = data.get("algorithm", "sha256")
    if algorithm != "sha256":
        return [finding(MANIFEST_INVALID, shown / INTEGRITY_NAME, f"algorithm {algorithm!r}, Megatron verifies sha256")]
    out: list[Finding] = []
    present = {name for name in file_sizes(directory) if name != INTEGRITY_NAME}
    for name, expected in files.items():
        if "/" in name or os.sep in name or name in ("", ".", ".."):
            out.append(finding(MANIFEST_INVALID, shown / INTEGRITY_NAME, f"entry {name!r} is not a file name"))
        elif name not in present:
            # a FIFO, device, dir or dangling link under a listed name is no file Megatron can hash either
            listed = directory / name
            what = "not a regular file" if listed.is_symlink() or listed.exists() else "missing"
            out.append(finding(LISTED_FILE_MISSING, shown, f"{name} listed in {INTEGRITY_NAME} but {what}"))
        elif verify_hashes:
            try:
                actual = sha256_file(directory / name)
            except OSError as exc:
                out.append(finding(LISTED_FILE_MISSING, shown / name, f"unreadable ({exc.strerror})"))
                continue
            except CkptError as exc:
                out.append(finding(LISTED_FILE_MISSING, shown / name, without_path(exc, directory / name)))
                continue
            if actual != expected.lower():
                out.append(
                    finding(
                        HASH_MISMATCH,
                        shown / name,
                        f"sha256 {actual[:16]}... but {INTEGRITY_NAME} records {expected[:16]}...",
                    )
                )
    for name in sorted(present - set(files)):
        out.append(finding(FILE_UNLISTED, shown / name, f"not listed in {INTEGRITY_NAME}"))
    if state.checkpoint is not None and state.checkpoint.location.backend == BACKEND_ZARR:
        why = (
            f"a legacy zarr checkpoint keeps its tensors in per-tensor subdirectories, which {INTEGRITY_NAME} "
            "cannot list: no hash covers them"
        )
        out.append(finding(FILE_UNLISTED, shown, why))
    return out


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(_READ_SIZE):
            digest.update(block)
    return digest.hexdigest()
