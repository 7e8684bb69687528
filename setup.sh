#!/usr/bin/env bash
# Installs batchgate and everything its demo and tests need, at the versions pinned in
# constraints.txt (refresh: scripts/lock.sh), into the active virtualenv or, when none is
# active, into .venv here (created with $PYTHON, default python3; the README's commands
# assume .venv). torch comes first, the CPU build of 2.13.0 (on local disk where there is
# one), so that nothing large is downloaded; a torch already there (GPU users install their
# CUDA build first) is kept. redis-server comes from Debian when missing and run as root.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
# generate and minilm: `batchgate demo --scenario lengths` and the real models
# (consumer.models:generator, :minilm) run after setup, on the CPU torch below.
EXTRAS=torch,generate,minilm,rq,gateway,dashboard,metrics,otel,bench,dev

if [ -n "${VIRTUAL_ENV:-}" ]; then
  venv=$VIRTUAL_ENV
else
  venv=.venv
  if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -m venv .venv; then
      # Debian's python3 ships venv (ensurepip) separately.
      if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        rm -rf .venv
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
        "$PYTHON" -m venv .venv
      else
        echo "setup.sh: '$PYTHON -m venv' failed; install python3-venv" >&2
        exit 1
      fi
    fi
  fi
fi
PY=$venv/bin/python
pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$pyver" = 3.11 ] || echo "setup.sh: constraints.txt is resolved for Python 3.11, this is" \
  "$pyver; if the install fails, run scripts/lock.sh with this Python's version" >&2

constraints=constraints.txt
if "$PY" -c "import torch" 2>/dev/null; then
  # Keep the torch that is there: pin it instead of the lock's.
  have=$("$PY" -c "import torch; print(torch.__version__)")
  tmp=$(mktemp)
  trap 'rm -f "$tmp"' EXIT
  { grep -v '^torch==' constraints.txt; echo "torch==$have"; } > "$tmp"
  constraints=$tmp
else
  "$PY" -m pip install --quiet -c constraints.txt torch
fi
"$PY" -m pip install --quiet -c "$constraints" -e ".[$EXTRAS]"

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup.sh: redis-server is not on PATH; install it (apt-get install redis-server)" \
         "or pass --redis-url to batchgate demo" >&2
  fi
fi
echo "batchgate $("$PY" -c 'import scheduler_core; print(scheduler_core.__version__)')" \
     "installed into $venv: run $venv/bin/batchgate demo, $venv/bin/python -m pytest -q"
