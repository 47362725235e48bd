# Prepared 2026-12-06 (sixteenth session), for the session's last ~360 s of device time. Run
# 39 measured the defaults at 1 and 64 streams in three rounds; issue 16's table also wants 32
# and 128: one round each, round-robin and disagg, the engine alone before every cell. Cells
# land in cells.jsonl as they end. Logs go straight to $OUT. Usage: bash wide.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== 32 and 128 $(date +%T)"
timeout ${W_T:-215} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns round-robin disagg --streams 32 128 --rounds 1 \
  --requests-per-stream 4 --min-requests 30 --out /tmp/r40 > $O/wide.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r40/cells.jsonl /tmp/r40/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |round [0-9]" $O/wide.log | cut -c1-300
echo "== end $(date +%T)"
