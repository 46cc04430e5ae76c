#!/usr/bin/env bash
# The first `make run` on a fresh clone: seconds from `make run` to the server answering /readyz, and the
# venv's size. pip's own cache is whatever this machine has (warm after any earlier install).
#   bench/fresh_make_run.sh [COMMIT] [PORT]      (default: HEAD, 8790)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
commit=${1:-HEAD}
port=${2:-8790}
dir=$(mktemp -d)
git clone -q "$repo" "$dir/repo"
cd "$dir/repo"
git checkout -q "$commit"
start=$(date +%s.%N)
make run ARGS="--no-demo --port $port --data-dir $dir/data" > "$dir/run.log" 2>&1 &
make_pid=$!
until curl -sf "http://127.0.0.1:$port/readyz" > /dev/null; do
  kill -0 "$make_pid" 2> /dev/null || { echo "make run exited: $dir/run.log"; exit 1; }
  sleep 1
done
end=$(date +%s.%N)
echo "$(git rev-parse --short HEAD): $(echo "$end - $start" | bc) s to /readyz; venv $(du -sh .venv | cut -f1)"
pkill -TERM -P "$make_pid" || true
wait "$make_pid" || true
rm -rf "$dir"
