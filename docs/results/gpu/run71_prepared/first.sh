# Prepared 2026-12-07 (twenty-sixth session) for the next session's first call, picked by card.
# An H200: issue 16's disagg rows over three rounds (as run68_prepared; then PART=rr).
# Otherwise: is the host's wake-up what made run 69's first token 3 ms later than run 60's?
# The bench now prints a wake-up probe first (busy / idle round trip to a waiting thread,
# bench/loadgen/results.py); then the split stack at one stream, both patterns, with the
# host's CPU latency bound held at 0 (idle pollers where no cpuidle driver reads the bound,
# microserving/cpu_latency.py) and without, on stacks of their own, taking turns, two rounds;
# the engine alone right before each cell (with that cell's stack, and so its pollers, up).
# Compare the probe and the first token with runs 60 (+2.59 / +3.38 ms) and 69 (+5.68 / +6.08).
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1 | tee "$O/cpuidle.txt"
if grep -q H200 "$O/card.txt"; then
  PART=${PART:-disagg} ROUNDS=3 T=${T:-540} bash docs/results/gpu/run50_prepared/table3.sh "$O/table"
else
  timeout ${L_T:-520} python3 -m microserving.cli bench capacity --backend embedded \
    --model llama-1b --device cuda --input-len 256 --output-len 256 --alone-each-round \
    --gateway-workers 4 --router-replicas 2 --patterns round-robin disagg --streams 1 \
    --rounds 2 --requests-per-stream 6 --min-requests 30 \
    --ab-env MICROSERVING_GATEWAY_CPU_LATENCY_US --ab-values off 0 --out /tmp/r71 > "$O/lat.log" 2>&1
  echo "rc=$?"; grep -h -E "^host at|round [0-9]+|^\| " "$O/lat.log" | cut -c1-240
  cp /tmp/r71/capacity.json /tmp/r71/cells.jsonl "$O/" 2>/dev/null
fi
tar -C "$O" -czf /tmp/out71.tgz . 2>/dev/null; mv /tmp/out71.tgz "$O/"
echo "== end $(date +%T)"
