#!/usr/bin/env bash
# The one test command (README and CI): sets up everything the tests need on a fresh
# machine, then runs the proto lint, ruff, mypy and the test suite. Extra arguments go to
# pytest (e.g. `scripts/test.sh -m unit`).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]"
# The Kubernetes policy scanner lives in a cached venv of its own; built in the background
# (once per machine) while the installs, lint and type checks below run.
policy_log=$(mktemp)
scripts/policy_tools.sh >"$policy_log" 2>&1 &
policy_pid=$!
for dir in tools examples/node; do
  if [ -f "$dir/package-lock.json" ]; then
    (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
  fi
done
export PATH="$PWD/$venv/bin:$PATH"
# The Go client's plugins (buf.gen.go.yaml, tests/test_client_codegen.py) are Debian
# packages, not npm or PyPI ones: installed where this runs as root with apt-get (CI),
# otherwise that test skips and says how to install them.
go_plugins="protoc-gen-go protoc-gen-go-grpc"
if ! command -v protoc-gen-go-grpc >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq $go_plugins >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $go_plugins >/dev/null 2>&1; } \
    || echo "note: could not install $go_plugins; the Go codegen test will skip"
fi

echo "== buf lint"
tools/node_modules/.bin/buf lint
echo "== ruff"
ruff check .
echo "== mypy"
mypy microserving engine_shim router gateway colocated bench
if ! wait "$policy_pid"; then
  echo "scripts/policy_tools.sh failed (the policy scanner's venv):" >&2
  cat "$policy_log" >&2
  exit 1
fi
CHECKOV=$(tail -n 1 "$policy_log")
export CHECKOV
rm -f "$policy_log"
echo "== pytest"
status=0
pytest -q "$@" || status=$?
# Exit code 5 means the selection held no tests: not a failure of the code under test.
if [ "$status" -eq 5 ]; then status=0; fi
exit "$status"
