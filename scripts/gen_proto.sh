#!/usr/bin/env bash
# Regenerate the checked-in Python bindings of proto/microserving/v1 into microserving/v1.
# Uses the pinned grpcio-tools (protoc + gRPC plugin) and mypy-protobuf (typing stubs) from
# the dev extra. tests/test_bindings_current.py fails when this would change the tree.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/microserving/v1"
"$python" -m grpc_tools.protoc \
  --proto_path="$root/proto" \
  --python_out="$out" \
  --grpc_python_out="$out" \
  --mypy_out="$out" \
  --mypy_grpc_out="$out" \
  "$root"/proto/microserving/v1/*.proto
