# Prepared 2026-12-06 (seventeenth session) for the session's last ~240 s of device time. Run
# 45: disagg's decode engine is now as quick a turn as round-robin's engine (2.66 / 2.64 ms at
# 128 streams), but holds 108 rows a step where round-robin's holds 121: requests wait
# outside D, in P's queue (P computes ~1.35 prompts a step, its chunk of 512 tokens allowing
# two, at up to 118 steps a second). A prefill-only engine can take bigger chunks (no decode
# rows wait behind them): the prefill chunk at 512 and 2048 taking turns (each on a stack of
# its own), disagg at 64 and 128 streams, one round. Usage: bash chunk_ab.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== chunk A/B $(date +%T)"
timeout ${C_T:-150} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns disagg --streams 64 128 --rounds 1 --requests-per-stream 5 \
  --min-requests 30 --ab-env MICROSERVING_SHIM_PREFILL_CHUNK_SIZE --ab-values 2048 512 \
  --out /tmp/r46 > $O/chunk.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r46/cells.jsonl /tmp/r46/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |round [0-9]" $O/chunk.log | cut -c1-300
echo "== end $(date +%T)"
