#!/usr/bin/env bash
# The suite against timing flakes on a loaded machine: on a fresh clone of this checkout's
# HEAD, `.ci/run` once and then the README's test command, N runs in all (default 5), each
# while a busy loop keeps one core busy; stops at the first failure. Logs: $OUT/run<i>.log.
set -uo pipefail
runs=${1:-5}
src=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$(mktemp -d /tmp/batchgate-flake-logs.XXXXXX)}
clone=$(mktemp -d /tmp/batchgate-flake.XXXXXX)
git clone -q "$src" "$clone" && cd "$clone" || exit 1
echo "$(git log --oneline -1); logs in $out"
for i in $(seq 1 "$runs"); do
  ( while :; do :; done ) & busy=$!
  start=$(date +%s)
  if [ "$i" = 1 ]; then CI=true bash .ci/run > "$out/run$i.log" 2>&1; rc=$?
  else .venv/bin/python -m pytest -q > "$out/run$i.log" 2>&1; rc=$?; fi
  kill "$busy"
  echo "run $i: exit $rc, $(( $(date +%s) - start )) s, $(tail -1 "$out/run$i.log")"
  [ "$rc" = 0 ] || exit "$rc"
done
