# Prepared 2026-12-08 (twenty-eighth session), right after run 71 (an H100): issue 16's disagg
# rows of the table on the current tree (three rounds, the engine alone right before every
# cell), on whichever card comes: on an H200 the first since run 22; on an H100 the current
# tree against runs 58 and 60 (the KV pushes now default to NIXL on a GPU, so the staged
# pushes' stream of session 27 is not on this path).
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
PART=disagg ROUNDS=${ROUNDS:-3} T=${T:-540} bash docs/results/gpu/run50_prepared/table3.sh "$O/table"
tar -C "$O" -czf /tmp/out72.tgz . 2>/dev/null; mv /tmp/out72.tgz "$O/"
echo "== end $(date +%T)"
