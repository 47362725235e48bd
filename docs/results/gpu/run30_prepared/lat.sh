# Prepared 2026-12-06 (fourteenth session). Run 29 found no cpuidle driver on the GPU host
# (current_driver none: /dev/cpu_dma_latency is read by nobody), and its A/B ran out of time
# before its table. This tree keeps a bound of 0 there with idle pollers (microserving/
# cpu_latency.py). One round each, the two values taking turns on stacks of their own, the
# engine alone right before each cell (with that cell's stack, and so its pollers, up): the
# split stack at one stream, round-robin and disagg, then round-robin with the router in the
# gateway. Usage on the device: bash lat.sh "$OUT"
O=$1; R=/tmp/run30_lat; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
cat /sys/devices/system/cpu/cpuidle/current_driver
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --requests-per-stream ${L_REQUESTS:-40} --min-requests 40 --rounds 1 --alone-each-round --streams 1
  --ab-env MICROSERVING_GATEWAY_CPU_LATENCY_US --ab-values off 0 --gateway-workers 4"
echo "== split $(date +%T)"
timeout ${L_SPLIT_T:-290} python3 -m microserving.cli bench capacity $common --patterns round-robin disagg \
  --router-replicas 2 --out $R/split > $R/split.log 2>&1
grep -h -E "^\| (round|disagg)" $R/split.log
grep -h -E "round 0 \[|yardstick" $R/split.log
echo "== embed $(date +%T)"
timeout ${L_EMBED_T:-170} python3 -m microserving.cli bench capacity $common --patterns round-robin \
  --embed-router --out $R/embed > $R/embed.log 2>&1
grep -h -E "^\| (round|disagg)" $R/embed.log
grep -h -E "round 0 \[|yardstick" $R/embed.log
echo "== end $(date +%T)"
