#!/usr/bin/env bash
# Set up .venv with what the tests need and run them. Safe to re-run; extra args go to pytest.
# torch is pinned to the 2.13.0 CPU wheel (an unpinned torch pulls a multi-GB CUDA build);
# megatron-core 0.19.2 (interop tests load our output with it) declares Python >= 3.12 but runs on
# 3.11, so it goes in without its dependency resolution, next to the few packages it imports.
#   ./scripts/test.sh                  everything (what CI runs, .ci/run)
#   ./scripts/test.sh -m "not mcore"   fast tier: no megatron-core and no torch child processes
# Before the tests: ruff check, ruff format --check, mypy, lint-imports (the layer contract) and mkdocs build --strict
# (the documentation site) (each fails the run).
# Everything (CI) runs in one process: the megatron-core and torchrun tests are heavy and the Ctrl-C and kill
# tests time signals. The fast tier (a -m expression with "not mcore") runs on 2 pytest-xdist workers, the
# object-storage tests together on one (one moto server). CKPTDOCTOR_TEST_JOBS=N|auto|0 chooses (0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
# Install only when this script, pyproject.toml or a C extension changed since the last successful install
# (the package is installed editable, so Python changes need no reinstall; the install builds the C extension).
stamp=.venv/.ckptdoctor-test-deps
want=$(find scripts/test.sh pyproject.toml ckptdoctor -name '*.[ch]' -o -name test.sh -o -name pyproject.toml | sort | xargs cat | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" -e '.[test]'
    "${pip[@]}" numpy packaging einops==0.8.2 triton==3.9.0 psutil
    "${pip[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
    # Transformer Engine's Python, one folder per release (tests/test_te_classifier_live.py runs each release's own
    # extra-state classifier; the classifier shipped in 2.18.0 and the 2.16.1/2.17.1 patch releases, 2.17.0 is the
    # last without it): --no-deps (its dependencies are CUDA builds; the tests need pydantic only, a test extra),
    # and outside site-packages (megatron-core must not find a TE without its CUDA extension).
    for te_release in 2.16.1 2.17.0 2.17.1 2.18.0 2.19.0 2.20.2; do
        rm -rf ".venv/transformer-engine/$te_release"
        "${pip[@]}" --no-deps --target ".venv/transformer-engine/$te_release" "transformer-engine==$te_release"
    done
    echo "$want" > "$stamp"
fi
.venv/bin/ruff check ckptdoctor tests bench scripts fuzz
.venv/bin/ruff format --check ckptdoctor tests bench scripts fuzz
.venv/bin/mypy
.venv/bin/lint-imports  # the layer contract in pyproject.toml (docs/architecture.md)
# The documentation site: --strict fails on a broken link, a missing page or a command mkdocs-click cannot render.
docs_site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d "$docs_site"
rm -rf "$docs_site"
jobs=${CKPTDOCTOR_TEST_JOBS:-}
if [ -z "$jobs" ]; then
    jobs=0
    previous=
    for arg in "$@"; do
        if [ "$previous" = "-m" ] && [[ $arg == *"not mcore"* ]]; then
            jobs=2
        fi
        previous=$arg
    done
fi
dist=()
[ "$jobs" = 0 ] || dist=(--dist loadgroup)
# The native modules under ASan+UBSan, fuzzed against the pure Python (2.5 minutes; fails on a sanitizer report or
# a difference), unless the run was given its own selection (CKPTDOCTOR_TEST_ONE_PASS=1 skips it too).
if [ $# -eq 0 ] && [ -z "${CKPTDOCTOR_TEST_ONE_PASS:-}" ]; then
    PYTHON=.venv/bin/python scripts/sanitize.sh --seconds 150
fi
# REQUIRE_C_SCAN: the optional C pre-pass must have been built here (its tests would skip otherwise); REQUIRE_TE:
# the Transformer Engine releases installed above must be found.
CKPTDOCTOR_REQUIRE_MCORE=1 CKPTDOCTOR_REQUIRE_C_SCAN=1 CKPTDOCTOR_REQUIRE_TE=1 .venv/bin/python -m pytest -q -n "$jobs" "${dist[@]}" "$@"
# The pure-Python path (a machine without a compiler): the fast tier again with the C extensions blocked, unless
# the first pass was given its own -m/-k/paths (a developer's selection) or CKPTDOCTOR_TEST_ONE_PASS=1.
if [ -z "${CKPTDOCTOR_TEST_ONE_PASS:-}" ]; then
    only_fast=1
    previous=
    for arg in "$@"; do
        if [ "$previous" = "-m" ] && [ "$arg" = "not mcore" ]; then
            :
        elif [ "$arg" != "-m" ]; then
            only_fast=0
        fi
        previous=$arg
    done
    if [ "$only_fast" = 1 ]; then
        echo "== the fast tier without the C extensions (CKPTDOCTOR_NO_EXTENSIONS=1)"
        CKPTDOCTOR_NO_EXTENSIONS=1 .venv/bin/python -m pytest -q -n 2 --dist loadgroup -m "not mcore" -p no:cacheprovider
    fi
fi
