# Prepared 2026-12-08 (twenty-eighth session) after run 71: with no cpuidle driver a bound of
# 0 starts one idle poller on each CPU the holder may run on (microserving/cpu_latency.py,
# sched_getaffinity), so on run 71's host it took 0.7-0.9 ms off the one-stream first token at
# the price of all 16 cores busy. Does the stack confined to half the CPUs (taskset: the bench,
# every service it starts and so their pollers inherit the mask) keep the gain at 8 busy
# cores? Round-robin and disagg at one stream, the bound off and 0, taking turns, two rounds,
# the whole bench under `taskset -c 0-7`. Either card.
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1 | tee "$O/cpuidle.txt"
timeout ${L_T:-520} taskset -c ${CPUS:-0-7} python3 -m microserving.cli bench capacity \
  --backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256 \
  --alone-each-round --gateway-workers 4 --router-replicas 2 --patterns round-robin disagg \
  --streams 1 --rounds 2 --requests-per-stream 6 --min-requests 30 \
  --ab-env MICROSERVING_GATEWAY_CPU_LATENCY_US --ab-values off 0 --out /tmp/r75 > "$O/lat.log" 2>&1
echo "rc=$?"; grep -h -E "^host at|round [0-9]+|^\| " "$O/lat.log" | cut -c1-240
cp /tmp/r75/capacity.json /tmp/r75/cells.jsonl "$O/" 2>/dev/null
echo "== end $(date +%T)"
