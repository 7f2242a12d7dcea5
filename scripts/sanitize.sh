#!/usr/bin/env bash
# The native modules under AddressSanitizer + UndefinedBehaviorSanitizer, fuzzed against the pure Python
# (issue #34 §6; scripts/test.sh runs it in CI). The tree is copied to a temporary directory and built there
# with the sanitizers, so no sanitized .so is ever left in the working tree; python runs with libasan preloaded,
# leak detection off (the interpreter's own allocations at exit are not ours), and the first UBSan report stops
# the run. Exits non-zero on a sanitizer report or on any difference between C and Python.
#   scripts/sanitize.sh [--seconds N] [--seed S]     (fuzz/fuzz_native.py's options; default 150 s)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=${PYTHON:-.venv/bin/python}
python=$(command -v "$python" || echo "$python")
case "$python" in /*) ;; *) python=$PWD/$python ;; esac
cc=${CC:-gcc}
libasan=$("$cc" -print-file-name=libasan.so)
if [ ! -e "$libasan" ]; then
    echo "sanitize.sh: $cc has no libasan ($libasan)" >&2
    exit 2
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
    tar --null -T - -cf - | tar -xf - -C "$tmp"
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g -O1"
(cd "$tmp" && CC=$cc CFLAGS="$flags" LDFLAGS="-fsanitize=address,undefined" \
    "$python" -c "from setuptools import setup; setup()" -q build_ext --inplace >build.log 2>&1) || {
    tail -50 "$tmp/build.log" >&2
    exit 2
}
built=0
for so in $(find "$tmp/ckptdoctor" -name '*.so'); do
    syms=$(nm -D "$so")  # (not piped into grep -q: nm killed by SIGPIPE fails the pipeline under pipefail)
    grep -q __asan_ <<<"$syms" || { echo "sanitize.sh: $so is not instrumented" >&2; exit 2; }
    grep -q __ubsan_ <<<"$syms" || { echo "sanitize.sh: $so has no UBSan checks" >&2; exit 2; }
    built=$((built + 1))
done
[ "$built" -gt 0 ] || { echo "sanitize.sh: no native module was built" >&2; exit 2; }
echo "== sanitize.sh: $built native modules built with ASan+UBSan in $tmp"
cd "$tmp"
LD_PRELOAD=$libasan ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    PYTHONMALLOC=malloc PYTHONPATH=$tmp "$python" fuzz/fuzz_native.py --seconds 150 --out "$OLDPWD/fuzz-failure.bin" "$@"
