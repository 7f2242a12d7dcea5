#!/usr/bin/env bash
# Set up .venv with what the tests need and run them. Safe to re-run; extra args go to pytest.
# torch is pinned to the 2.13.0 CPU wheel (an unpinned torch pulls a multi-GB CUDA build);
# megatron-core 0.19.2 (interop tests load our output with it) declares Python >= 3.12 but runs on
# 3.11, so it goes in without its dependency resolution, next to the few packages it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e '.[test]'
"${pip[@]}" numpy packaging einops==0.8.2 triton==3.9.0 psutil
"${pip[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
CKPTDOCTOR_REQUIRE_MCORE=1 .venv/bin/python -m pytest -q "$@"
