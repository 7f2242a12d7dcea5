"""Packaging as a user meets it (issue #36): ``python -m build`` makes an sdist and a wheel from this tree; the wheel
installed into a fresh venv, away from the source tree (another cwd, no PYTHONPATH), runs ``--version``,
``inspect``, ``check`` and ``schema`` on a fixture; the sdist built where no C compiler works (``CC=false``) installs
the pure Python and says so.

Offline: the build runs without isolation on the setuptools already installed (``--no-isolation``), and the fresh
venvs get the two runtime dependencies (click, tabulate) from this environment's own copies, linked into a
directory their ``.pth`` names; the wheel's METADATA is checked to declare them. Marked ``mcore`` (the slow tier):
it compiles the C extensions and makes two venvs.
"""

from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO

from ckptdoctor import __version__
from ckptdoctor.commands.schema import schema_names

pytestmark = [pytest.mark.mcore, pytest.mark.xdist_group("packaging")]  # one build for the three tests

NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", "fixtures", "bench", "fuzz", ".*_cache"
)
C_MODULES = (
    "ckptdoctor/pickle/_native",
    "ckptdoctor/formats/_dcp_index",
    "ckptdoctor/formats/_crc32",
    "ckptdoctor/values/_health",
)
# The wheel has the C extensions where a compiler is found (CI: CKPTDOCTOR_REQUIRE_C_SCAN says it must be).
HAVE_CC = bool(os.environ.get("CKPTDOCTOR_REQUIRE_C_SCAN")) or bool(
    shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no PYTHONPATH, no pip configuration of this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "CKPTDOCTOR_", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def _run(cmd: list, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env or _clean_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _build(source: Path, outdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
    pytest.importorskip("build", reason="`build` is in the test extra")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", outdir, *args, source], source.parent, env)


def _venv_with(wheel: Path, where: Path) -> Path:
    """A fresh venv with ``wheel`` installed by pip (from the file only: no index), click and tabulate beside it."""
    _run([sys.executable, "-m", "venv", "--without-pip", where], where.parent)
    python = where / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], where.parent).strip())
    deps = where / "deps"
    deps.mkdir()
    import click
    import tabulate

    for module in (click, tabulate):
        origin = Path(module.__file__)  # type: ignore[arg-type]
        source = origin.parent if origin.name == "__init__.py" else origin
        (deps / source.name).symlink_to(source)
    (site / "runtime-deps.pth").write_text(f"{deps}\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--isolated",
            "--python",
            python,
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            wheel,
        ],
        where.parent,
    )
    return where / "bin"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and wheel of a copy of this tree (``python -m build``: the wheel is built from the sdist)."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "ckptdoctor-src"
    shutil.copytree(REPO, source, ignore=NOT_COPIED)
    dist = root / "dist"
    _build(source, dist)
    (sdist,) = dist.glob("ckptdoctor-*.tar.gz")
    (wheel,) = dist.glob("ckptdoctor-*.whl")
    return {"root": root, "sdist": sdist, "wheel": wheel}


def test_build_makes_an_sdist_and_a_wheel_with_the_schemas_and_the_c_extensions(built):
    assert built["sdist"].name == f"ckptdoctor-{__version__}.tar.gz"
    assert built["wheel"].name.startswith(f"ckptdoctor-{__version__}-")
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = whl.namelist()
        metadata = email.parser.Parser().parsestr(
            whl.read(f"ckptdoctor-{__version__}.dist-info/METADATA").decode("utf-8")
        )
    assert {f"ckptdoctor/schemas/{n}.schema.json" for n in schema_names()} <= set(names)
    stubs = {f"{module}.pyi" for module in C_MODULES}
    assert {"ckptdoctor/py.typed"} | stubs <= set(names)
    assert not [n for n in names if n.startswith(("tests/", "fixtures/", "docs/", "bench/"))]
    for module in C_MODULES:  # built from the sdist's sources and headers
        assert any(n.startswith(module) and n.endswith(".so") for n in names) == HAVE_CC, (module, names)
    requires = metadata.get_all("Requires-Dist") or []
    assert any(r.startswith("click") for r in requires) and any(r.startswith("tabulate") for r in requires)
    assert metadata.get_all("Project-URL") is None and "<org>" not in str(metadata)
    with tarfile.open(built["sdist"]) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    headers = {
        "ckptdoctor/pickle/_opcode_read.h",
        "ckptdoctor/pickle/_opcodes.h",
        "ckptdoctor/pickle/_plans.h",
        "ckptdoctor/pickle/_prune.h",
        "ckptdoctor/pickle/_records.h",
        "ckptdoctor/pickle/_scan.h",
        "ckptdoctor/formats/_dcp_attach.h",
        "ckptdoctor/formats/_dcp_fields.h",
    }
    assert headers | {"ckptdoctor/schemas/error.schema.json", "LICENSE"} <= members


def _check_installed(bin_dir: Path, cwd: Path, c_built: bool) -> None:
    ckptdoctor = bin_dir / "ckptdoctor"
    where = _run([bin_dir / "python", "-c", "import ckptdoctor; print(ckptdoctor.__file__)"], cwd)
    assert Path(where.strip()).is_relative_to(bin_dir.parent) and not Path(where.strip()).is_relative_to(REPO)
    version = _run([ckptdoctor, "--version"], cwd)
    assert version.startswith(f"ckptdoctor, version {__version__} ")
    if c_built:
        assert "pickle pre-pass: C;" in version and "index loops: C;" in version, version
        assert "health statistics: C;" in version and "CRC-32: C (" in version, version
    else:
        assert "pickle pre-pass: Python, the C extension was not built" in version, version
        assert "index loops: Python, the C extension was not built" in version, version
        assert "health statistics: numpy, the C extension was not built" in version, version
        assert "CRC-32: zlib, the C extension was not built" in version, version
    fixture = FIXTURES / "core019_tp2"
    assert "TP=2" in _run([ckptdoctor, "inspect", fixture], cwd)
    report = json.loads(_run([ckptdoctor, "check", "--isolated", fixture, "--format", "json"], cwd))
    assert report["findings"] == [] and report["checked"] == [str(fixture / "iter_0000010")]
    _run([ckptdoctor, "check", fixture], cwd)
    shipped = (REPO / "ckptdoctor" / "schemas" / "inspect.schema.json").read_text(encoding="utf-8")
    assert _run([ckptdoctor, "schema", "inspect"], cwd) == shipped
    assert _run([ckptdoctor, "schema", "--list"], cwd).split() == schema_names()


def test_the_wheel_installs_into_a_fresh_venv_and_runs_without_the_source_tree(built):
    venv = built["root"] / "venv-wheel"
    bin_dir = _venv_with(built["wheel"], venv)
    elsewhere = built["root"] / "elsewhere"
    elsewhere.mkdir()
    _check_installed(bin_dir, elsewhere, c_built=HAVE_CC)


def test_the_sdist_installs_without_a_c_compiler_as_pure_python(built):
    unpacked = built["root"] / "sdist-no-cc"
    with tarfile.open(built["sdist"]) as sdist:
        sdist.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (source,) = unpacked.iterdir()
    dist = built["root"] / "dist-no-cc"
    env = _clean_env(CC="false", CXX="false", LDSHARED="false")
    _build(source, dist, "--wheel", env=env)
    (wheel,) = dist.glob("ckptdoctor-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        assert not [n for n in whl.namelist() if n.endswith(".so")]
    bin_dir = _venv_with(wheel, built["root"] / "venv-no-cc")
    elsewhere = built["root"] / "elsewhere-no-cc"
    elsewhere.mkdir()
    _check_installed(bin_dir, elsewhere, c_built=False)
