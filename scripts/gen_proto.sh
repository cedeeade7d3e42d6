#!/usr/bin/env bash
# Generate Python stubs from proto/pdserve/v1/*.proto into pdserve_proto/v1/ (committed).
# The generated package is named pdserve_proto, not proto or pdserve: `proto` clashes with
# proto-plus and `pdserve` is our own package, so generated imports are rewritten to match.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=${1:-pdserve_proto}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m grpc_tools.protoc -I proto --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  proto/pdserve/v1/*.proto
mkdir -p "$out/v1"
for f in "$tmp"/pdserve/v1/*.py "$tmp"/pdserve/v1/*.pyi; do
  sed -e 's/^from pdserve\.v1 import/from pdserve_proto.v1 import/' "$f" > "$out/v1/$(basename "$f")"
done
touch "$out/__init__.py" "$out/v1/__init__.py"
