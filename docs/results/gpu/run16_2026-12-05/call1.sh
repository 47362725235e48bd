# GPU call 1 (2026-12-05, fifth session): `microserving serve` (the router in each of the 4
# gateway workers) and the split stack (4 gateway workers, 2 router replicas), one round each,
# back to back on one host (run16_prepared/serve.sh, ROUNDS=1, at 1/32/64/128 streams unless
# STREAMS says otherwise). Then, if time is left, disagg at 1 and 128 streams with P logging
# each NIXL send's phases (run15's sends.sh). Both pack their results after every step, so a
# call cut off at its limit still returns what finished.
# Usage on the device: bash call1.sh "$OUT" (STREAMS="1 64 128" for fewer cells).
O=$1; t0=$(date +%s); mkdir -p "$O"
ROUNDS=1 STREAMS="${STREAMS:-1 32 64 128}" bash docs/results/gpu/run16_prepared/serve.sh "$O/serve"
left=$(( ${BUDGET_S:-570} - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then
  echo "== sends $(date +%T) ($left s left)"
  SENDS_T=$((left - 15)) bash docs/results/gpu/run15_2026-12-05/sends.sh "$O/sends"
  echo "== end $(date +%T)"
fi
