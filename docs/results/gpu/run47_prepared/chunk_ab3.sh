# Prepared 2026-12-06 (eighteenth session). Run 46 (one round, an H100): P's prefill chunk
# 2048 against 512 at disagg 64 / 128 streams relayed 29.9k / 40.0k against 28.8k / 39.6k
# tok/s, the router's first-token mean 42 / 54 against 50 / 74 ms, while the engine alone
# (each cell's yardstick) moved 31.4-36.7k at 64 streams within the call: one round says
# little. Three rounds, the two values taking turns (the other order each round), the engine
# alone right before each cell; the rows give client tok/s side by side and disagg's ratio
# medians at 64 and 128 streams. Usage: bash chunk_ab3.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== chunk A/B x3 $(date +%T)"
timeout ${C_T:-540} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns disagg --streams 64 128 --rounds 3 --requests-per-stream 6 \
  --min-requests 30 --ab-env MICROSERVING_SHIM_PREFILL_CHUNK_SIZE --ab-values 2048 512 \
  --out /tmp/r47 > $O/chunk3.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r47/cells.jsonl /tmp/r47/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |round [0-9]" $O/chunk3.log | cut -c1-300
echo "== end $(date +%T)"
