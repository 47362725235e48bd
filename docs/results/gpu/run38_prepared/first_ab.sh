# Prepared 2026-12-06 (sixteenth session). The prefill engine now samples the first token
# (first_token_on_prefill, default on): P's RemoteSend outputs it before its KV moves, the
# router relays it at once, D continues from it. Run 34 put disagg's one-stream first token
# 2.71 ms after round-robin's (issue 21's goal: within 2 ms), D's step for the last prompt
# token and its output (1.55 ms) on the path. Side by side, taking turns (bench capacity
# --ab-env: each value on a stack started with it): MICROSERVING_ROUTER_FIRST_TOKEN_ON_PREFILL
# true / false, disagg and round-robin, 1 and 64 streams, one round, the engine alone before
# the cells; then the same at one stream in three rounds if time is left.
# Logs go straight to $OUT. Usage: bash first_ab.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --alone-each-round --gateway-workers 4 --router-replicas 2
  --ab-env MICROSERVING_ROUTER_FIRST_TOKEN_ON_PREFILL --ab-values true false"
echo "== ab 1+64 $(date +%T)"
timeout ${A_T:-300} python3 -m microserving.cli bench capacity $common --patterns disagg round-robin \
  --streams 1 64 --rounds 1 --requests-per-stream 8 --min-requests 30 --out /tmp/r38a > $O/ab.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r38a/cells.jsonl $O/ab_cells.jsonl 2>/dev/null
cp /tmp/r38a/capacity.json $O/ab_capacity.json 2>/dev/null
grep -h -E "^\| |yardstick|first token" $O/ab.log | cut -c1-300
echo "== ab one stream x3 $(date +%T)"
timeout ${B_T:-200} python3 -m microserving.cli bench capacity $common --patterns disagg --streams 1 \
  --rounds 3 --requests-per-stream 30 --min-requests 30 --out /tmp/r38b > $O/one.log 2>&1
echo "rc=$? $(date +%T)"; cp /tmp/r38b/cells.jsonl $O/one_cells.jsonl 2>/dev/null
cp /tmp/r38b/capacity.json $O/one_capacity.json 2>/dev/null
grep -h -E "^\| |yardstick|first token" $O/one.log | cut -c1-300
echo "== end $(date +%T)"
