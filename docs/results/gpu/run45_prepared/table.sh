# Prepared 2026-12-06 (seventeenth session), when an H200 was offered (the kind issue 16's
# goals name; the sessions before got H100s only): issue 16's table on the current tree,
# round-robin and disagg at 1, 32, 64 and 128 streams, one round, six requests a stream (at
# least 30 a cell), the engine alone before every cell. Cells land in cells.jsonl as they end.
# Usage: bash table.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== table $(date +%T)"
timeout ${T_T:-520} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns round-robin disagg --streams 1 32 64 128 --rounds 1 \
  --requests-per-stream 6 --min-requests 30 --out /tmp/r45 > $O/table.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r45/cells.jsonl /tmp/r45/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |round [0-9]" $O/table.log | cut -c1-330
echo "== end $(date +%T)"
