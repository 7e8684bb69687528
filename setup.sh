#!/usr/bin/env bash
# Installs batchgate and everything its demo and tests need into the current Python.
# torch comes first, pinned to the CPU build on local disk, so that the `torch>=2.3`
# range in pyproject.toml is already satisfied and nothing large is downloaded. GPU users
# install their CUDA build of torch before running this (or instead of the extra).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet "torch==2.13.0"
fi
"$PYTHON" -m pip install --quiet -e ".[torch,rq,gateway,metrics,bench,dev]"

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup.sh: redis-server is not on PATH; install it (apt-get install redis-server)" \
         "or pass --redis-url to batchgate demo" >&2
  fi
fi
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
echo "batchgate installed: $("$PYTHON" -c 'import scheduler_core; print(scheduler_core.__version__)')"
