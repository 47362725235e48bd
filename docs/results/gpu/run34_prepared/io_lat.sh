# Prepared 2026-12-06 (fifteenth session), for one call with the session's last ~700 s of
# device time (runs 32 and 33, prepared, never got a machine). Two questions in one call:
# 1. gRPC's I/O stack side by side on the GPU (every service runs on gRPC's iomgr stack since
#    cbbe4ed, measured only on the VM): GRPC_EXPERIMENTS over EventEngine (gRPC's default) and
#    iomgr, each value on a stack started with it, taking turns (bench capacity --ab-env), the
#    engine alone before each stream count's cells; split stack, round-robin and disagg at 1
#    and 64 streams, one round (128 left out for the time left); the CPU latency bound of 0 held by the gateway (idle
#    pollers: this host runs no cpuidle driver) on both sides, so that the iomgr row at one
#    stream is the stack as it would be deployed for latency, and the EventEngine row is run
#    30's configuration.
# 2. Where disagg's first token goes now: the same stack (iomgr, the bound) on the tree with
#    temporary timestamps at every hop and the KV handshake's (run33_prepared/stamps.patch,
#    run25_prepared/_stamp.py; not committed to the code), one stream, and an2.py's per-request timeline.
#    The stamped tree is expected at $S.
# Logs go straight to $OUT (a call cut short still returns them). Usage: bash io_lat.sh "$OUT" S
O=$1; S=$2; mkdir -p "$O"; H=$(cd "$(dirname "$0")/../run25_prepared" && pwd)
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 MICROSERVING_GATEWAY_CPU_LATENCY_US=0
nproc > $O/machine.txt; nvidia-smi -L >> $O/machine.txt 2>&1; cat /sys/devices/system/cpu/cpuidle/current_driver >> $O/machine.txt 2>&1
ee=event_engine_dns,event_engine_client,event_engine_listener
io=event_engine_dns,-event_engine_client,-event_engine_listener
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --requests-per-stream 4 --min-requests 30 --alone-each-round --gateway-workers 4 --router-replicas 2"
echo "== ab $(date +%T)"
timeout ${IO_T:-330} python3 -m microserving.cli bench capacity $common --rounds 1 \
  --streams ${IO_STREAMS:-1 64} --patterns round-robin disagg \
  --ab-env GRPC_EXPERIMENTS --ab-values $ee $io --out /tmp/r34ab > $O/ab.log 2>&1
echo "rc=$? $(date +%T)"
cp /tmp/r34ab/capacity.json $O/ab_capacity.json 2>/dev/null
grep -h -E "^\| |yardstick" $O/ab.log | cut -c1-400
echo "== stamped $(date +%T)"
(cd "$S" && PYTHONPATH=$S:/tmp/site MSSTAMP_DIR=/tmp/r34st timeout ${STAMP_T:-120} python3 -m microserving.cli \
  bench capacity $common --rounds 1 --streams 1 --patterns disagg --out /tmp/r34t > $O/stamped.log 2>&1)
grep -h -E "^\| disagg" $O/stamped.log | cut -c1-200
python3 $H/an2.py /tmp/r34st shim-decode > $O/timeline_disagg.txt 2>&1
cat $O/timeline_disagg.txt
echo "== end $(date +%T)"
