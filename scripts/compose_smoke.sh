#!/usr/bin/env bash
# Build the two images, run docker-compose.yml with docker or podman, send completions
# through the gateway with the official `openai` client, scrape every service's /metrics,
# then tear everything down (also on failure). Records nothing; prints what it checked.
#
#   scripts/compose_smoke.sh                      # docker compose, or podman + podman-compose
#   BASE_IMAGE=localhost/microserving-base:bookworm scripts/compose_smoke.sh
#
# Environment:
#   BASE_IMAGE        base of both images (default python:3.11-slim; on a machine that cannot
#                     pull it, scripts/local_base_image.sh builds one from Debian packages)
#   TORCH_INDEX_URL   index of the CPU torch wheel (default the PyTorch CPU index)
#   WHEELS_DIR        a host folder of wheels (e.g. a local torch wheel) mounted into the
#                     engine build as pip's --find-links (podman only)
#   PYTHON            a Python with the `openai` package (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
base="${BASE_IMAGE:-python:3.11-slim}"
export MICROSERVING_BASE_IMAGE="$base"
export MICROSERVING_ROUTER_CLASS="${MICROSERVING_ROUTER_CLASS-}" MICROSERVING_API_KEYS="${MICROSERVING_API_KEYS-}"
project=microserving-smoke

if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
  engine=docker; compose=(docker compose -p "$project")
elif command -v podman >/dev/null && command -v podman-compose >/dev/null; then
  engine=podman; compose=(podman-compose -p "$project")
else
  echo "compose_smoke: needs docker with compose, or podman with podman-compose" >&2; exit 2
fi
echo "== $engine, base image $base"

build_args=(--build-arg "BASE_IMAGE=$base")
[ -n "${TORCH_INDEX_URL:-}" ] && build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
engine_extra=()
if [ -n "${WHEELS_DIR:-}" ]; then
  [ "$engine" = podman ] || { echo "WHEELS_DIR needs podman (build volumes)" >&2; exit 2; }
  engine_extra=(-v "$WHEELS_DIR:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
fi
network=()
[ "$engine" = podman ] && network=(--network host)

started_s=$SECONDS
"$engine" build "${network[@]}" "${build_args[@]}" --target control-plane \
  -t microserving-grpc-control-plane:latest .
echo "== control-plane image built ($((SECONDS - started_s)) s)"
started_s=$SECONDS
"$engine" build "${network[@]}" "${build_args[@]}" "${engine_extra[@]}" --target engine \
  -t microserving-grpc:latest .
echo "== engine image built ($((SECONDS - started_s)) s)"
"$engine" images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep microserving-grpc || true

cleanup() {
  echo "== tearing down"
  "${compose[@]}" down -t 10 >/dev/null 2>&1 || true
}
trap cleanup EXIT

# Start in health order, each service's own healthcheck deciding (docker compose does this
# itself with --wait; podman-compose 1.0 orders but does not wait, so this script does).
container_of() { "$engine" ps --filter "label=com.docker.compose.project=$project" \
  --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1; }
wait_healthy() {
  local service=$1 deadline=$((SECONDS + 300)) name
  while [ $SECONDS -lt $deadline ]; do
    name=$(container_of "$service")
    if [ -n "$name" ]; then
      if [ "$engine" = podman ]; then
        podman healthcheck run "$name" >/dev/null 2>&1 && { echo "   $service healthy"; return 0; }
      else
        [ "$(docker inspect -f '{{.State.Health.Status}}' "$name")" = healthy ] && {
          echo "   $service healthy"; return 0; }
      fi
    fi
    sleep 2
  done
  echo "$service not healthy after 300 s" >&2
  "$engine" logs "$(container_of "$service")" 2>&1 | tail -40 >&2
  return 1
}
started_s=$SECONDS
for service in prefill decode router gateway; do
  # --no-deps: they are up already (podman-compose 1.0 would try to create them again)
  "${compose[@]}" up -d --no-build --no-deps "$service" >/dev/null
  wait_healthy "$service"
done
echo "== stack healthy ($((SECONDS - started_s)) s)"

"$python" - <<'PY'
import re
import subprocess

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", timeout=120)
for prompt in ("Hello from compose", "Hello from compose"):
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens > 0, reply
print("   completions ok:", repr(reply.choices[0].text), reply.usage)
chat = client.chat.completions.create(model="tiny", max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi"}])
print("   chat ok:", chat.usage)
text = httpx.get("http://127.0.0.1:8000/metrics", timeout=10).text
names = {f.name for f in text_string_to_metric_families(text)}
assert "microserving_gateway_finish_reasons" in names, sorted(names)
print("   gateway /metrics ok")
PY
# The shims' and the router's /metrics are not published: scrape them from inside the network
# (the gateway container has Python and sees every service by name).
gateway=$(container_of gateway)
for service in prefill decode router; do
  "$engine" exec "$gateway" python -c "
import sys, urllib.request
text = urllib.request.urlopen('http://$service:9100/metrics', timeout=10).read().decode()
kind = 'router' if '$service' == 'router' else 'shim'
assert 'microserving_' + kind + '_' in text, text[:500]
print('   $service /metrics ok:', sum(1 for line in text.splitlines() if not line.startswith('#')), 'samples')
"
done
echo "== compose smoke passed"
