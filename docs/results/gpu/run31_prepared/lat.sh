# Prepared 2026-12-06 (fourteenth session), for the session's last 290 s of device time:
# round-robin at one stream with the CPU latency bound of 0 (idle pollers on this host: no
# cpuidle driver) on every stack, two rounds on one stack each, the engine alone right before
# each round's cell (under the pollers too): the router in the gateway, then the split stack.
# Logs go straight to $OUT (a call cut short still returns them). Usage: bash lat.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 MICROSERVING_GATEWAY_CPU_LATENCY_US=0
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --requests-per-stream 30 --min-requests 30 --rounds 2 --alone-each-round --streams 1
  --patterns round-robin --gateway-workers 4"
echo "== embed $(date +%T)"
timeout ${L_EMBED_T:-110} python3 -m microserving.cli bench capacity $common --embed-router \
  --out /tmp/r31e > $O/embed.log 2>&1
grep -h -E "^\| round|round [01]|yardstick" $O/embed.log
echo "== split $(date +%T)"
timeout ${L_SPLIT_T:-100} python3 -m microserving.cli bench capacity $common --router-replicas 2 \
  --out /tmp/r31s > $O/split.log 2>&1
grep -h -E "^\| round|round [01]|yardstick" $O/split.log
echo "== end $(date +%T)"
