#!/usr/bin/env bash
# Builds the wheel and sdist as a user would (`python -m build`), checks their metadata
# (`twine check --strict`) and contents (no bench/, no tests/), installs the wheel with the
# base dependencies only into a fresh virtualenv outside the checkout, and runs there,
# from a directory outside the checkout: `batchgate --version`, `import producer` (which
# must not import torch, and torch must not be installed), a short `batchgate demo`, and
# short `batchgate simulate` and `batchgate plan` runs. .ci/run calls it; alone:
#   scripts/wheel_check.sh                 (PY: a Python with build and twine, the dev extra;
#                                            default .venv/bin/python)
# The demo starts its own redis-server: redis-server must be on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${PY:-.venv/bin/python}
# Absolute, for the steps that run from a directory outside the checkout (not resolved
# through the venv's symlink: that would leave the venv).
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "wheel_check: $*" >&2; exit 1; }

"$PY" -m build --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 \
  || { tail -30 "$tmp/build.log" >&2; fail "python -m build failed"; }
"$PY" -m twine check --strict "$tmp"/dist/*
wheel=$(ls "$tmp"/dist/batchgate-*.whl)
"$PY" - "$wheel" <<'EOF'
"""The wheel holds the package only: no benchmark lab, no tests."""
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
lab = [n for n in names if n.startswith(("bench/", "tests/", "batchgate/bench/"))]
if lab:
    sys.exit(f"wheel_check: the wheel ships the lab or tests: {lab[:5]}")
for needed in ("scheduler_core/lua/enqueue.lua", "batchgate/dashboard/static/index.html"):
    if needed not in names:
        sys.exit(f"wheel_check: the wheel lacks {needed}")
print(f"wheel_check: {sys.argv[1].rsplit('/', 1)[1]}: {len(names)} files, no lab, no tests")
EOF

# The base install, as a web app that only enqueues gets it.
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet -c "$root/constraints.txt" "$wheel"
mkdir "$tmp/elsewhere"
cd "$tmp/elsewhere"
bg=$tmp/venv/bin/batchgate
want=$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import scheduler_core; print(scheduler_core.__version__)' "$root")
[ "$("$bg" --version)" = "batchgate, version $want" ] || fail "batchgate --version: $("$bg" --version)"
"$tmp/venv/bin/python" - "$root" <<'EOF'
"""`import producer` from the installed wheel, without torch."""
import importlib.util
import sys

import producer

root = sys.argv[1]
if producer.__file__.startswith(root):
    sys.exit(f"wheel_check: producer came from the checkout: {producer.__file__}")
if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
    sys.exit("wheel_check: the base install has torch")
print(f"wheel_check: import producer ok ({producer.__file__}), no torch")
EOF
"$bg" demo --duration 1 --consumers 1 --rate 40 >"$tmp/demo.txt" 2>&1 \
  || { cat "$tmp/demo.txt"; fail "batchgate demo failed"; }
grep -q '^summary: ' "$tmp/demo.txt" || { cat "$tmp/demo.txt"; fail "no summary line"; }
"$bg" simulate --strategy dynamic --rate 200 --duration-s 2 --cost-ms '5+0.5*b' >/dev/null
"$bg" plan --rate 200 --slo-p99-ms 200 --cost-ms '5+0.5*b' >/dev/null
echo "wheel_check: batchgate --version, demo ($(grep '^summary: ' "$tmp/demo.txt")), simulate" \
     "and plan ran from the wheel in $tmp/venv"
