# Prepared 2026-12-06 (fourteenth session). The CPU wake-up latency bound (microserving/
# cpu_latency.py) side by side on the GPU host: `bench capacity --ab-env
# MICROSERVING_GATEWAY_CPU_LATENCY_US --ab-values off 0` (each value on a stack of its own every
# round, in the other order each round; the engine alone runs right before each round's cells,
# with that round's stack up, so under the same bound), round-robin and disagg, the split stack
# at 1 and 64 streams, then the router in the gateway's process at 1 stream. The host's idle
# driver and its parameters first. Usage on the device: bash lat.sh "$OUT"
O=$1; R=/tmp/run29_lat; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
{ uname -r; cat /proc/cmdline; nproc
  cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor_ro
  grep . /sys/module/haltpoll/parameters/* /sys/devices/system/cpu/cpu0/cpuidle/state*/name
  ls -l /dev/cpu_dma_latency; } > $R/host.txt 2>&1
cat $R/host.txt
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --requests-per-stream ${L_REQUESTS:-4} --min-requests ${L_MIN:-24} --rounds ${L_ROUNDS:-2} --alone-each-round
  --ab-env MICROSERVING_GATEWAY_CPU_LATENCY_US --ab-values off 0 --patterns round-robin disagg"
echo "== split $(date +%T)"
timeout ${L_SPLIT_T:-320} python3 -m microserving.cli bench capacity $common --streams ${L_STREAMS:-1 64} \
  --gateway-workers 4 --router-replicas 2 --out $R/split > $R/split.log 2>&1
grep -h -E "^\| (round|disagg)" $R/split.log
echo "== embed $(date +%T)"
timeout ${L_EMBED_T:-200} python3 -m microserving.cli bench capacity $common --streams 1 \
  --gateway-workers 4 --embed-router --out $R/embed > $R/embed.log 2>&1
grep -h -E "^\| (round|disagg)" $R/embed.log
grep -h "errors" $R/split.log $R/embed.log | grep -v " 0 errors" | head
echo "== end $(date +%T)"
