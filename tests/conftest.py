"""Shared test helpers: the real megatron-core fixtures and subprocess runners."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
MANIFESTS = FIXTURES / "manifests"


def fixture_names() -> list[str]:
    return sorted(p.stem for p in MANIFESTS.glob("*.json") if (FIXTURES / p.stem).is_dir())


def manifest(name: str) -> dict:
    return json.loads((MANIFESTS / f"{name}.json").read_text())


def require_mcore():
    """Import real megatron-core, or skip; CI sets CKPTDOCTOR_REQUIRE_MCORE=1 so a missing one fails."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        if os.environ.get("CKPTDOCTOR_REQUIRE_MCORE"):
            raise
        pytest.skip("megatron-core not installed")
    import megatron.core

    return megatron.core


@pytest.fixture
def copy_fixture(tmp_path):
    """Copy a fixture save dir into tmp_path (tests that break checkpoints work on copies)."""

    def _copy(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(FIXTURES / name, dest)
        return dest

    return _copy


# Blocks imports of the named top-level packages in a child interpreter, proving they are not needed.
_BLOCKER = """
import sys
class _Block:
    def __init__(self, names): self.names = names
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in self.names:
            raise ImportError(f'blocked import: {name}')
        return None
sys.meta_path.insert(0, _Block(NAMES))
"""


def blocker(names) -> str:
    """Code that makes the named top-level packages unimportable in a child interpreter."""
    return _BLOCKER.replace("NAMES", repr(set(names)))


def run_cli(*args: str, block: tuple[str, ...] = (), cwd: Path = REPO, python: str = sys.executable,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``ckptdoctor`` in a child interpreter, optionally with some packages unimportable."""
    code = blocker(block) + (
        "from ckptdoctor.cli import main\n"
        f"rc = main({list(args)!r})\n"
        "mods = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]\n"
        "sys.stderr.write('\\nIMPORTED:' + ','.join(sorted(mods)) + '\\n')\n"
        "raise SystemExit(rc)\n"
    )
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)
