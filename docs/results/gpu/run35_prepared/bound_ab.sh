# Prepared 2026-12-06 (fifteenth session), for the session's last ~340 s of device time.
# Run 34 measured round-robin's one-stream first token at +2.53 ms over the engine alone on
# gRPC's iomgr stack with the CPU latency bound of 0 (idle pollers) held by the gateway. Is
# the bound still needed on iomgr? MICROSERVING_GATEWAY_CPU_LATENCY_US off and 0, each on a
# stack started with it, taking turns (bench capacity --ab-env), the engine alone before the
# cells; split stack, round-robin, one stream, one round. Usage: bash bound_ab.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== ab $(date +%T)"
timeout ${B_T:-220} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --requests-per-stream 30 --min-requests 30 \
  --rounds 1 --alone-each-round --streams 1 --patterns round-robin --gateway-workers 4 \
  --router-replicas 2 --ab-env MICROSERVING_GATEWAY_CPU_LATENCY_US --ab-values off 0 \
  --out /tmp/r35 > $O/ab.log 2>&1
echo "rc=$? $(date +%T)"
cp /tmp/r35/capacity.json $O/capacity.json 2>/dev/null
grep -h -E "^\| |yardstick" $O/ab.log | cut -c1-300
