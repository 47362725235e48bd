# Prepared 2026-12-06 (sixteenth session). Run 38 measured the prefill engine sampling the
# first token in one round. Issue 16/21's tables want medians over three rounds: disagg and
# round-robin on the defaults (first_token_on_prefill on), 1 and 64 streams, three rounds, the
# engine alone before every cell. Each cell lands in cells.jsonl as it ends, so a run cut
# short keeps what it measured. Logs go straight to $OUT. Usage: bash three.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== three rounds $(date +%T)"
timeout ${T_T:-520} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns disagg round-robin --streams 1 64 --rounds 3 \
  --requests-per-stream 8 --min-requests 30 --out /tmp/r39 > $O/three.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r39/cells.jsonl /tmp/r39/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |round [0-9]" $O/three.log | cut -c1-300
echo "== end $(date +%T)"
