# Run 36 (fifteenth session, the last ~190 s of device time, the machine of run 35 still warm):
# round-robin at one stream on the defaults (gRPC's iomgr stack, no CPU latency bound), three
# rounds on one stack, the engine alone before each round's cell. Usage: bash default3.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
timeout ${D_T:-140} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --requests-per-stream 30 --min-requests 30 \
  --rounds 3 --alone-each-round --streams 1 --patterns round-robin --gateway-workers 4 \
  --router-replicas 2 --out /tmp/r36 > $O/run.log 2>&1
echo "rc=$?"; cp /tmp/r36/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |yardstick|round [0-9]:" $O/run.log | cut -c1-300
