#!/usr/bin/env bash
# Refreshes constraints.txt, the pinned development/CI set: every extra of pyproject.toml,
# resolved from PyPI for CPython 3.11 on Linux x86_64, torch pinned to 2.13.0.
#   scripts/lock.sh                          after editing dependencies in pyproject.toml
#   scripts/lock.sh --upgrade                move every pin to the newest release allowed
#   scripts/lock.sh --upgrade-package NAME   move one
# Runs uv (a pinned release, installed into a throwaway virtualenv) with no user config.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet "uv==$UV_VERSION"

{
  echo "# Pinned development/CI set of batchgate: all extras, CPython 3.11, Linux x86_64."
  echo "# A constraints file (pip install -c constraints.txt ...), not requirements: the"
  echo "# ranges stay in pyproject.toml. Refresh with ONE command: scripts/lock.sh"
  echo "# (--upgrade for newer releases). Do not edit by hand."
} > "$tmp/header.txt"

echo "torch==$TORCH_VERSION" | "$tmp/venv/bin/uv" pip compile pyproject.toml \
  --no-config --all-extras --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --constraint - --custom-compile-command scripts/lock.sh --quiet \
  --output-file constraints.txt "$@"
# uv keeps a header it did not write only above its own; put ours first, once.
grep -v -x -F -f "$tmp/header.txt" constraints.txt > "$tmp/body.txt"
cat "$tmp/header.txt" "$tmp/body.txt" > constraints.txt
echo "constraints.txt: $(grep -c '^[a-z0-9]' constraints.txt) pins"
