#!/usr/bin/env bash
# Makes a venv with the Kubernetes policy scanner (checkov, pinned in
# tools/policy-requirements.txt) and prints the path of its checkov. The venv is cached
# outside the repository, keyed by the pin file's hash, so a machine pays the install
# (~45 s on 2 cores) once; a venv without the marker written last (an interrupted install)
# is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=tools/policy-requirements.txt
key=$(sha256sum "$pins" | cut -c1-12)
cache="${MICROSERVING_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/microserving-grpc}"
venv="$cache/policy-$key"
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$cache"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$pins" >&2
  "$venv/bin/checkov" --version >/dev/null
  touch "$venv/.complete"
fi
echo "$venv/bin/checkov"
