# Prepared 2026-12-06 (sixteenth session), for the session's last ~250 s of device time (run
# 40's wide.sh did not get a machine): 128 streams only, round-robin then disagg, one round,
# two requests per stream, the engine alone before each cell. The bench writes straight under
# $OUT (cells.jsonl as each cell ends), so a call cut short keeps what it measured.
# Usage: bash wide128.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== 128 $(date +%T)"
timeout ${W_T:-125} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns round-robin disagg --streams 128 --rounds 1 \
  --requests-per-stream 2 --min-requests 30 --out $O/r41 > $O/wide128.log 2>&1
echo "rc=$? $(date +%T)"
grep -h -E "^\| |round [0-9]" $O/wide128.log | cut -c1-300
echo "== end $(date +%T)"
