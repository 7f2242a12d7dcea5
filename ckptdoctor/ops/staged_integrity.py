"""The ``integrity.json`` of a staged rewrite: the source's verified first, the new dir's written last.

A compacting writer (new data files) verifies the source's manifest against every file and writes a fresh one
over the new files (as ``seal`` does); a linking writer (``edit`` without ``--compact``) carries the source's
digests over for the files it hard-linked and hashes only what it wrote, so it stays O(metadata).
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptdoctor.errors import CkptError
from ckptdoctor.ops.seal import default_jobs, hash_files, manifest_files
from ckptdoctor.rules.integrity import INTEGRITY_NAME
from ckptdoctor.storage.files import read_json


def carried_hashes(src: Path, stage: Path) -> dict[str, str]:
    """The staged dir's manifest without reading linked data: a file that is the source's own (same inode)
    keeps the digest the source's ``integrity.json`` lists for it (it vouches for the same bytes as before);
    every new or copied file is hashed. An unreadable source manifest is refused."""
    try:
        listed = read_json(src / INTEGRITY_NAME)["files"]
        if not isinstance(listed, dict):
            raise ValueError("not a manifest of file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise CkptError(f"{src / INTEGRITY_NAME}: unreadable integrity manifest ({exc})") from None
    hashes: dict[str, str] = {}
    to_hash = []
    for path in manifest_files(stage):
        source = src / path.name
        same = source.is_file() and os.stat(source).st_ino == os.stat(path).st_ino
        if same and isinstance(listed.get(path.name), str):
            hashes[path.name] = listed[path.name].lower()
        else:
            to_hash.append(path)
    hashes.update(hash_files(to_hash, default_jobs()))
    return dict(sorted(hashes.items()))


def verify_source_manifest(iteration_dir: Path, verb: str = "strip") -> None:
    """Refuse a source whose ``integrity.json`` disagrees with its files: the output's fresh manifest would
    otherwise vouch for changed bytes (a conversion would carry them into another format, where no manifest
    tells). Every file of the dir is hashed (in parallel, as ``seal`` does)."""
    path = iteration_dir / INTEGRITY_NAME
    if not path.is_file():
        return
    why = f"; refusing to {verb} it (the source's bytes changed after it was sealed): run `ckptdoctor check` on it"
    try:
        manifest = read_json(path)
        listed = manifest["files"]
        if manifest.get("algorithm", "sha256") != "sha256" or not isinstance(listed, dict):
            raise ValueError("not a sha256 manifest of file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CkptError(f"{path}: unreadable integrity manifest ({exc}){why}") from None
    files = manifest_files(iteration_dir)
    present = {p.name for p in files}
    missing = sorted(set(listed) - present)
    unlisted = sorted(present - set(listed))
    if missing or unlisted:
        name, what = (
            (missing[0], f"listed in {INTEGRITY_NAME} but missing")
            if missing
            else (unlisted[0], f"not listed in {INTEGRITY_NAME}")
        )
        raise CkptError(f"{iteration_dir / name}: {what}{why}")
    try:
        actual = hash_files(files, default_jobs())
    except OSError as exc:
        raise CkptError(f"{exc.filename or iteration_dir}: cannot read ({exc.strerror}){why}") from None
    for name, digest in actual.items():
        if str(listed[name]).lower() != digest:
            raise CkptError(f"{iteration_dir / name}: sha256 differs from {INTEGRITY_NAME}{why}")
