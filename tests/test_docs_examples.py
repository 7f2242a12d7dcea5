"""The documentation's examples are current: every ``$ ckptdoctor ...`` example of README.md and docs/ that runs
against a fixture is run, and its shown output must be what the command prints today.

An example is a fenced block whose first line is ``$ ckptdoctor ARGS`` (a ``# comment`` after the command is
dropped), followed by the output. In the shown output a line ``...`` stands for any number of lines, and ``...``
inside a line for any text (an example may shorten long output). Trailing whitespace is not compared. Examples
naming a path outside ``fixtures/`` (``/ckpt/run7``, ``ckpt``) are illustrative and not run; a path under
``/tmp/`` is an output the command writes: it is moved to a fresh temporary dir. Also: the rules reference
(docs/rules.md) is the output of its generator, and the pre-commit snippet lists hooks that exist.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_main

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```[a-z]*\n(\$ [^\n]*\n.*?)^```\n", re.M | re.S)
PROMPT = "$ "


def _steps(block: str) -> list[tuple[str, str]]:
    """A block's ``$ command`` lines, each with the output shown below it."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith(PROMPT):
            steps.append((line[len(PROMPT) :], []))
        else:
            steps[-1][1].append(line)
    return [(command, "".join(f"{line}\n" for line in shown)) for command, shown in steps]


IN_DIR = re.compile(r"^cd (\S+) && (ckptdoctor .*)$")  # a command run from a dir (check --staged in a git repo)


def _in_dir(command: str) -> tuple[str | None, str]:
    """``cd DIR && ckptdoctor ...``: (DIR, the ckptdoctor command); any other command: (None, itself)."""
    match = IN_DIR.match(command)
    return (match.group(1), match.group(2)) if match else (None, command)


def _runs_here(steps: list[tuple[str, str]]) -> bool:
    """Every path a ckptdoctor command names is a fixture or a /tmp/ output, and a fixture is named."""
    if "fixtures/" not in "".join(command for command, _ in steps):
        return False  # illustrative: a checkpoint that is not in the repository
    for command, _ in steps:
        command = _in_dir(command)[1]
        if command.startswith("ckptdoctor "):
            argv = shlex.split(command, comments=True)[1:]
            if any(("/" in a or a == "ckpt") and not a.startswith(("fixtures/", "/tmp/")) for a in argv):
                return False
    return True


def _examples() -> list[tuple[str, list[tuple[str, str]]]]:
    found = []
    for doc in DOC_FILES:
        for match in FENCE.finditer(doc.read_text(encoding="utf-8")):
            steps = _steps(match.group(1))
            if _runs_here(steps):
                found.append((str(doc.relative_to(REPO)), steps))
    return found


EXAMPLES = _examples()


def _pattern(shown: str) -> re.Pattern[str]:
    parts = []
    for line in shown.rstrip("\n").split("\n"):
        line = line.rstrip()
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*".join(re.escape(piece) for piece in line.split("...")) + r"[ \t]*\n")
    return re.compile("".join(parts), re.S)


def test_examples_found():
    """The README's quick start examples are among those run (the extraction did not silently find nothing)."""
    readme = [steps[0][0] for doc, steps in EXAMPLES if doc == "README.md"]
    assert len(readme) >= 6, readme
    assert len(EXAMPLES) >= 14, [steps[0][0] for _, steps in EXAMPLES]


def _normalised(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n"))


@pytest.mark.parametrize("doc, steps", EXAMPLES, ids=[f"{d}:{s[-1][0][:60]}" for d, s in EXAMPLES])
def test_example_output_is_current(doc, steps, capsys, monkeypatch, tmp_path):
    """Each step in order: a ckptdoctor command runs in this process and prints what is shown below it; another
    command (``cp -r fixtures/... /tmp/run7``: the set-up of an example) runs in bash and must succeed."""
    if any(c.startswith("ckptdoctor show ") or " --values" in c for c, _ in steps):
        pytest.importorskip("torch")  # statistics and values need torch (the test environment has it)
    out_dir = f"{tmp_path}/"
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COLUMNS", "100000")  # the docs show lines whole (a terminal wraps them at its width)
    for command, shown in steps:
        directory, command = _in_dir(command.replace("/tmp/", out_dir))
        if not command.startswith("ckptdoctor "):
            subprocess.run(["bash", "-c", command], cwd=REPO, check=True)
            continue
        monkeypatch.chdir(directory or REPO)
        capsys.readouterr()
        _, out, err = run_main(capsys, *shlex.split(command, comments=True)[1:])
        pattern = _pattern(shown.replace("/tmp/", out_dir))
        assert pattern.fullmatch(_normalised(out)) or pattern.fullmatch(_normalised(out + err)), (
            f"{doc}: `{command}` prints today:\n{out}{err}"
        )


def test_rules_reference_is_generated():
    """docs/rules.md is what scripts/gen_rules_doc.py writes from the rule registry."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_rules_doc.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_every_rule_has_an_example_that_reports_it():
    """Each code of the registry has an example (scripts/rule_examples.py), and its entry in docs/rules.md shows
    `ckptdoctor check` reporting that code (the page being the generator's output: see above)."""
    from ckptdoctor.rules.registry import all_rules

    sys.path.insert(0, str(REPO / "scripts"))
    from rule_examples import EXAMPLES

    codes = [r.code for r in all_rules()]
    assert sorted(EXAMPLES) == codes
    entries = re.split(r"^### ", (REPO / "docs" / "rules.md").read_text(encoding="utf-8"), flags=re.M)[1:]
    shown = {entry.split("\n", 1)[0]: entry.split("**Example.**", 1)[-1].split("**Fix.**", 1)[0] for entry in entries}
    assert sorted(shown) == codes
    missing = [code for code in codes if "```console\n$ " not in shown[code] or f": {code} [" not in shown[code]]
    assert not missing, missing


def test_every_rule_and_command_has_its_page():
    from ckptdoctor.commands import COMMAND_MODULES
    from ckptdoctor.rules.registry import all_rules

    rules_page = (REPO / "docs" / "rules.md").read_text(encoding="utf-8")
    assert all(f"### {r.code}\n" in rules_page for r in all_rules())
    for name in COMMAND_MODULES:
        assert (REPO / "docs" / "commands" / f"{name}.md").is_file(), name


def test_readme_is_short():
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_documented_hooks_exist():
    hooks = set(re.findall(r"^- id: (\S+)$", (REPO / ".pre-commit-hooks.yaml").read_text(), re.M))
    documented = set(re.findall(r"- id: (ckptdoctor-[a-z-]+)", (REPO / "docs" / "pre-commit.md").read_text()))
    assert documented and documented <= hooks


def _paths(doc: Path) -> list[str]:
    named = re.findall(r"`((?:docs|bench|fixtures|scripts|tests)/[\w./-]+)`", doc.read_text(encoding="utf-8"))
    return [p for p in named if "*" not in p and "<" not in p]


def test_repository_paths_named_in_docs_exist():
    """A path of this repository that a page names in code (`bench/README.md`) exists: a renamed file fails here."""
    missing = sorted({(str(d.relative_to(REPO)), p) for d in DOC_FILES for p in _paths(d) if not (REPO / p).exists()})
    assert not missing, missing


def test_examples_of_no_checkpoint_are_current_too(capsys):
    """Examples that name no fixture (not run above) but whose output is the command's own: the schema list."""
    block = (REPO / "docs" / "commands" / "schema.md").read_text(encoding="utf-8").split("$ ckptdoctor schema --list\n")
    shown = block[1].split("```", 1)[0]
    _, out, _ = run_main(capsys, "schema", "--list")
    assert out == shown
